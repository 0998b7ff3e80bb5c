"""Serving: the actors that hold minds' memory and the per-token core that runs their turns.

    kernel/              the actor kernel: bounded typed mailboxes, tell/ask, supervision, the dispatch seam
    messages.py          the messages slots, the scheduler and the placer exchange
    steps/               the per-token path as a pure, synchronous core (no actors, no engine calls)
    scheduler.py         the Scheduler actor: runs the core against the engine, step after step
    slot.py              a Slot actor: one sequence's memory between turns
    slot_memory.py       a slot's resume, checkpoints and gene leases
    slot_pages.py        a slot's page moves and page files
    placer.py            the MindPlacer: which slot holds which mind
    page_store.py        the PageStore: named pages of slot state in host RAM under one ceiling
    buffer_pool.py       host buffers kept warm for the next page_out
    gene_residency.py    GeneResidency: which genes hold device memory
    checkpoint_budget.py CheckpointBudget: one byte budget for every slot's checkpoints
    checkpoint_plan.py   a slot's checkpoint plan (its mind's divergence history + policy)
"""
