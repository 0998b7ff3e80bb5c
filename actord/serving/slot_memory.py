"""What a slot's sequence holds, and how it is cut back, evicted and snapshotted.

A mixin of `Slot` (serving/slot.py): the slot's memory between requests. `kv_tokens` is
exactly the tokens whose KV sit in the sequence; `cut_to` makes it hold the longest usable
prefix of a new prompt (cutting the memory back where it can be cut, else resuming from the
newest context checkpoint at or below the divergence, else from zero); `evict` gives an idle
sequence up (to the mind's page, else its file, else dropped); the checkpoint list is kept
in step with the CheckpointBudget's mirror; KV cells and the device footprint are told to
the scheduler and the residency whenever the sequence changes outside a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from actord.serving.kernel import Envelope
from actord.serving.checkpoint_budget import AdmitCheckpoint, Decision, SlotCheckpoints
from actord.serving.gene_residency import EvictDone, Finish as GeneFinish, SlotFootprint
from actord.serving.messages import Cells, SlotInbox
from actord.engine import jobs as J
from actord.vocabulary.errors import ActordError, PageRamExceeded, SlotBusy
from actord.vocabulary.log import get
from actord.policy.checkpoint_records import CheckpointSize, SlotCheckpoint
from actord.vocabulary.metrics import Metrics


if TYPE_CHECKING:
    from actord.serving.checkpoint_budget import CheckpointInbox
    from actord.serving.checkpoint_plan import CheckpointPlan
    from actord.serving.gene_residency import GeneInbox
    from actord.serving.kernel import Actor
    from actord.serving.messages import SchedulerInbox
    from actord.serving.page_store import PageStoreInbox
    from actord.storage.files import PageFiles

log = get("actord.slot")


class SlotMemory:
    """The slot's sequence between requests (see the module docstring)."""

    # Provided by Slot.
    id: int
    seq: int
    engine: Any
    props: J.ModelProps
    metrics: Metrics
    scheduler: Actor[SchedulerInbox]
    pages: Actor[PageStoreInbox]
    residency: Actor[GeneInbox]
    ckpt_budget: Actor[CheckpointInbox]
    files: PageFiles
    ckpt: CheckpointPlan
    active: Any
    track_footprint: bool
    _acquired: bool
    kv_tokens: list[int]
    draft_n: int
    resume_raw_lcp: int | None
    checkpoints: list[SlotCheckpoint]
    mind: str | None
    genes: Any
    scope: str
    handling: int
    cells_batched: bool
    cells_dirty: bool
    kv_epoch: int
    take_share_note: Callable[[], dict[str, int]]  # serving/prefix_share.py

    async def erase(self) -> None:
        await self.engine.run(J.SeqRm(seq=self.seq, p0=-1, p1=-1))
        await self._hold_only(())

    async def _hold_only(self, tokens: Any) -> None:
        """The sequence now holds exactly `tokens` and nothing else of before: no draft (the
        draft context catches up from zero), no mind's name, no checkpoints; told upward."""
        self.kv_tokens = list(tokens)
        self.draft_n = 0
        self.resume_raw_lcp = None
        self.mind = None
        self.ckpt.reset()
        await self.release_checkpoints(self.checkpoints)
        self.checkpoints = []
        await self.footprint_changed()
        await self._tell_cells()

    async def _tell_cells(self, release: int = 0) -> None:
        """The scheduler charges KV cells per slot; tell it after a change outside a step.
        Inside a page move that tells once at its end (`cells_batched`), only that end's
        count is sent, with the move's room token (`release`)."""
        if self.cells_batched and not release:
            self.cells_dirty = True
            return
        self.cells_dirty = False
        self.owe_cells = False
        self._cells_seq = getattr(self, "_cells_seq", 0) + 1
        await self.scheduler.tell(Cells(slot=self.id, n=len(self.kv_tokens), seq=self._cells_seq, release=release,
                                        epoch=self.kv_epoch, **self.take_share_note()))

    async def _on_evict(self, reason: str, env: Envelope[SlotInbox]) -> None:
        try:
            freed = await self.evict(reason)
        except ActordError as e:
            if reason == "device":
                await self.residency.tell(EvictDone(slot=self.id, freed=False, kept=not isinstance(e, SlotBusy)))
            if env.reply is not None:
                env.reply.fail(e)
            return
        if reason == "device":
            await self.residency.tell(EvictDone(slot=self.id, freed=True))
        if env.reply is not None:
            env.reply.send((freed, getattr(self, "_cells_seq", 0)))

    async def evict(self, reason: str, *, ram_only: bool = False) -> int:
        """Give up an idle sequence: to the mind's page, else its file; a sequence without a
        mind (a slot-addressed cache) is dropped.

        Returns the cells freed. A mind's state goes only once a copy of it is whole in the
        page store or durable in its page file: when the page RAM refuses and the file cannot
        be written (a full or read-only page folder, EIO), the eviction is refused with that
        error and the sequence stays as it was. A slot with a running request refuses too:
        eviction never touches work in flight. A request still waiting for its genes has a
        quiet sequence, which may go too (the request then decodes its prompt from zero).
        """
        a = self.active
        if a is not None and a.running:
            # Whoever asked may wait for this slot (the scheduler parks): it hears from us
            # when the request ends, even where the end changes no count.
            self.owe_cells = True
            raise SlotBusy(f"slot {self.id} has work in flight", slot=self.id)
        n = len(self.kv_tokens)
        if n == 0:
            await self.footprint_changed()  # whoever asked may hold a stale size: correct it
            return 0
        how = "dropped"
        mind = self.mind
        if mind is not None:
            try:
                await self.page_out(mind)
                how = "paged_out"
            except PageRamExceeded as e:
                if ram_only:  # the asker spills by its own order and asks again; nothing moved
                    raise PageRamExceeded(e.message, **{**e.data, "mind": mind}) from None
                from actord.serving.placer import mind_file

                try:
                    await self.save(mind_file(mind))
                except ActordError as e:
                    self.metrics.slot_evictions_refused_total.labels(reason=reason).inc()
                    log.warning("slot.evict_refused", slot=self.id, mind=mind, reason=reason, n_tokens=n,
                                why="no room in page RAM and its page file cannot be written", error=e.to_dict())
                    raise
                how = "spilled"
        if how != "paged_out":
            await self.erase()
        self.metrics.slot_evictions_total.labels(reason=reason, how=how).inc()
        log.info("slot.evicted", slot=self.id, mind=mind, reason=reason, how=how, n_tokens=n)
        return n

    async def release_checkpoints(self, dropped: list[SlotCheckpoint]) -> None:
        """The list is being emptied (erase, page_out): tell the budget."""
        await self._sync_budget([])

    async def _sync_budget(self, ckpts: list[SlotCheckpoint]) -> None:
        if not self.props.needs_checkpoints:
            return  # a model that never checkpoints: the budget holds nothing of ours to mirror
        history, n, population = self.ckpt.view(len(self.kv_tokens))
        await self.ckpt_budget.tell(SlotCheckpoints(
            slot=self.id, metas=[CheckpointSize(pos=c.pos, n_bytes=c.n_bytes) for c in ckpts],
            raw_lcp=self.selection_lcp(), history=history, n_tokens=n, population=population,
        ))

    async def cut_to(self, n: int) -> tuple[int, bool]:
        """Make the sequence hold exactly kv_tokens[:m] for the largest usable m <= n.

        Returns (m, resumed_from_checkpoint). Memory that can be cut back at n is cut there.
        Memory that cannot (SWA without a full cache whose window has moved past n,
        recurrent, hybrid) resumes from the newest checkpoint at or below n, else from zero.
        Checkpoints past the resume point are invalidated.
        """
        held = len(self.kv_tokens)
        m, from_ckpt = await self._cut(n)
        if any(c.pos > m for c in self.checkpoints):
            self.checkpoints = [c for c in self.checkpoints if c.pos <= m]
        self.ckpt.observe(self.resume_raw_lcp or 0)
        await self._sync_budget(self.checkpoints)
        if (m < held and not from_ckpt and self.props.needs_checkpoints
                and self.ckpt.wants_at_resume(m, [c.pos for c in self.checkpoints])):
            # The memory served this divergence; the next one is likely here again.
            st = await self.engine.run(J.StateGet(seq=self.seq, partial=True))
            await self.on_checkpoint(m, st.data)
        return m, from_ckpt

    async def _cut(self, n: int) -> tuple[int, bool]:
        if n >= len(self.kv_tokens):
            return len(self.kv_tokens), False
        p = self.props
        # Even a full SWA cache is checked: libllama 0.3.36 writes a sequence's state without
        # its SWA-masked cells (llama_kv_cache::state_write), so after a page-in or restore
        # the SWA layers hold only the last window, and pos_min says so.
        if (not p.needs_checkpoints and p.n_swa == 0) or await self._memory_holds(n):
            if await self.engine.run(J.SeqRm(seq=self.seq, p0=n, p1=-1)):
                self.kv_tokens = self.kv_tokens[:n]
                return n, False
        for ck in reversed(self.checkpoints):
            if ck.pos > n:
                continue
            try:
                await self.engine.run(J.StateSet(seq=self.seq, data=ck.data, partial=True))
                ok = await self.engine.run(J.SeqRm(seq=self.seq, p0=ck.pos, p1=-1))
            except ActordError as e:
                log.warning("slot.checkpoint_restore_failed", slot=self.id, pos=ck.pos, error=e.to_dict())
                break
            if ok:
                self.kv_tokens = self.kv_tokens[:ck.pos]
                self.metrics.ctx_checkpoint_restores_total.inc()
                log.info("slot.checkpoint_restored", slot=self.id, pos=ck.pos, raw_lcp=self.resume_raw_lcp)
                return ck.pos, True
            break
        await self.engine.run(J.SeqRm(seq=self.seq, p0=-1, p1=-1))
        self.kv_tokens = []
        return 0, False

    async def _memory_holds(self, n: int) -> bool:
        """Can the memory itself serve a resume at n (without a checkpoint)?"""
        p = self.props
        if p.recurrent or p.hybrid:
            return False
        rng: J.SeqRange = await self.engine.run(J.MemoryRange(seq=self.seq))
        # The window attending from position n needs positions down to n - n_swa.
        return rng.pos_min <= max(0, n - p.n_swa)

    def checkpoint_positions(self, pos0: int, n_prompt: int, shared_at: int = 0) -> list[int]:
        """Plan where to snapshot the prompt, decoded from pos0 (its divergence was noted
        by `cut_to`): as few pieces as the plan needs, and `shared_at`, where the prompt
        parts from what other minds hold (serving/prefix_share.py: the next mind that opens
        alike starts from there)."""
        self.ckpt.started(n_prompt)
        if not self.props.needs_checkpoints:
            return []
        out = self.ckpt.positions(pos0, n_prompt, [c.pos for c in self.checkpoints])
        if pos0 < shared_at < n_prompt and shared_at not in out and all(c.pos != shared_at for c in self.checkpoints):
            out = sorted([*out, shared_at])
        if out:
            log.debug("slot.checkpoint_plan", slot=self.id, pos0=pos0, n_prompt=n_prompt, at=out,
                      policy=self.ckpt.policy, history=len(self.ckpt.history))
        return out

    async def on_checkpoint(self, pos: int, data: bytearray) -> None:
        self.ckpt.ckpt_bytes = len(data)
        history, n, population = self.ckpt.view(len(self.kv_tokens))
        d: Decision = await self.ckpt_budget.ask(AdmitCheckpoint(
            slot=self.id, pos=pos, n_bytes=len(data), raw_lcp=self.selection_lcp(), history=history, n_tokens=n,
            population=population,
        ))
        if d.drop_own:
            self.checkpoints = [c for c in self.checkpoints if c.pos not in d.drop_own]
        if d.admit:
            self.checkpoints.append(SlotCheckpoint(pos=pos, data=data))

    async def device_bytes(self) -> int:
        """What the sequence holds on the device: its state (the KV cells of its attention
        layers plus, on recurrent/hybrid memory, its fixed recurrent state) and, when libllama
        keeps rollback snapshots (n_rs_seq > 0), n_rs_seq more copies of the recurrent state."""
        if not self.kv_tokens:
            return 0
        n = await self.engine.run(J.StateSize(seq=self.seq))
        return n + self.props.n_rs_seq * self.props.recurrent_state_bytes

    async def finish_genes(self) -> None:
        if not (self._acquired or self.track_footprint):
            return
        self._acquired = False
        n = await self.device_bytes() if self.track_footprint else 0
        await self.residency.tell(GeneFinish(slot=self.id, n_bytes=n))

    async def footprint_changed(self) -> None:
        if self.track_footprint:
            await self.residency.tell(SlotFootprint(slot=self.id, n_bytes=await self.device_bytes()))

    def quiet(self) -> bool:
        """No request and no handler at work: every engine job of this sequence has returned,
        so `kv_tokens` is what the sequence holds (a peer's fork reads it: `fork_from`)."""
        return self.active is None and self.handling == 0

    async def fork_from(self, src: Any, tokens: list[int]) -> bool:
        """Hold a copy of slot `src`'s sequence (messages.Fork), which must be quiet and hold
        exactly `tokens`; False, and nothing changed (but a mind this slot held paged out), when
        it does not. The check and the copy's submission happen in one tick of the loop, so no
        job of src's can come between them (the engine runs between-steps jobs in order)."""
        def same() -> bool:
            return src is not self and src.quiet() and src.kv_tokens == tokens

        if not same():
            return False
        if self.mind is not None and self.kv_tokens:
            await self.evict("fork")  # the mind keeps its history: to its page, else its file
            if not same():
                return False
        job = self.engine.submit(J.SeqCopy(src=src.seq, dst=self.seq))
        try:
            await self.engine.wait(job)
        except ActordError:
            await self.erase()  # what the sequence holds is unknown: nothing
            raise
        self.genes, self.scope = src.lineage
        await self._hold_only(tokens)  # (the draft context's copy was cleared)
        return True

    async def cut_back_after_failure(self) -> None:
        """A failed step may have left cells past what we know: cut back to kv_tokens. Memory
        that refuses the cut (recurrent or hybrid after a decode that failed part-way) is
        erased, so the token list never claims a state the sequence does not hold."""
        try:
            ok = await self.engine.run(J.SeqRm(seq=self.seq, p0=len(self.kv_tokens), p1=-1))
        except ActordError:
            ok = False
        if not ok:
            log.info("slot.cut_back_refused", slot=self.id, n_tokens=len(self.kv_tokens))
            await self.erase()
