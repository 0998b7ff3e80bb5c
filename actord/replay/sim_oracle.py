"""The seeded simulation's output oracle: sharing never changes output.

Every completion the simulation answered (whatever it resumed from: the slot's own cells, a
peer's share, a checkpoint, a page, a base, a file, the prompt cache's mind) is asked again
of a reference system that holds nothing else: one slot erased before each prompt, no
sharing, no prompt cache, no speculation, every gene loaded. Greedy decoding makes the
answer a function of the prompt and the genes, so the two must agree token for token.

They may part only where the reference itself could have gone either way: at the first
token where they differ, the simulation's token must be within `TIE` of the reference's
likeliest, by the reference's own log probabilities. A batch of other shapes (other slots'
tokens beside it, a resume, a chunk boundary, a verify batch) sums in another order; on the
tiny random models that moved the first parting token's log probability by up to 0.04 nats
(19 near ties in 200 seeds x 60 steps, as many with an f32 KV cache as with f16). Cells
computed under other genes, for another prompt or from a stale recurrent state move it by
whole nats: the token a wrong state picks is seldom even among the reference's top four.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from actord.vocabulary.config import Config
from actord.vocabulary.errors import ActordError

TIE = 0.25  # nats: 6x the most a summation order moved one in 600 seeds x 60 steps (0.04)


@dataclass(frozen=True)
class Answered:
    """One completion as the simulation got it: what was asked and the tokens it answered."""

    prompt: tuple[int, ...]
    genes: tuple[tuple[str, float], ...]  # (the gene's file, scale): genes by content, not load-order id
    n_predict: int
    think_key: str = ""  # the thought budget's parameters (`think`), as a key
    think: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    tokens: tuple[int, ...] = field(default=(), compare=False)
    n_cached: int = field(default=0, compare=False)
    how: str = field(default="", compare=False)  # the simulation's kind of operation, for the report


def reference_config(cfg: Config) -> Config:
    """A system that answers from a fresh prefill only: one slot holding the whole cache. No
    draft model; a model's own MTP head stays on where the simulation drove it (libllama
    loads a model's MTP block only then, and a gene with tensors for it needs it loaded);
    greedy speculation answers as plain decoding does (tests/serving/test_spec_memory_kinds.py)."""
    return msgspec.structs.replace(
        cfg, slots=1, prefix_sharing=False, prompt_cache_minds=0, device_bytes=0, spec_draft_model=None,
        spec=cfg.spec if cfg.spec == "mtp" else "", page_ram_bytes=10**6, ctx_checkpoints_bytes=0,
        write_behind_s=0.0, pipeline_depth=0, yield_after_tokens=0)


def parted(sim: tuple[int, ...], ref: Any) -> str | None:
    """Where the simulation's tokens part from the reference's beyond a near tie, or None."""
    for j, (a, b) in enumerate(zip(sim, ref.tokens)):
        if a == b:
            continue
        lp = ref.logprobs[j] if ref.logprobs and j < len(ref.logprobs) else None
        if lp is not None and lp.top:
            best = lp.top[0].logprob
            theirs = next((t.logprob for t in lp.top if t.token == a), None)
            if theirs is not None and best - theirs <= TIE:
                return None  # a near tie: either token is the model's answer
            margin = "beyond the top" if theirs is None else f"{best - theirs:.4f} nats below"
        else:
            margin = "at a forced token"
        return f"token {j}: {a} where a fresh prefill gives {b} ({margin})"
    if len(ref.tokens) < len(sim):
        return f"{len(sim)} tokens where a fresh prefill gives {len(ref.tokens)}"
    return None


async def output_problem(cfg: Config, answered: list[Answered]) -> str | None:
    """Ask each distinct completion of a reference system; the first that parts, described."""
    from actord.service.system import ActorSystem

    # One ask per question (its prompt, genes and budget); every distinct answer to it checked.
    todo: dict[Answered, dict[tuple[int, ...], Answered]] = {}
    for a in answered:
        if a.tokens:
            todo.setdefault(a, {}).setdefault(a.tokens, a)
    if not todo:
        return None
    async with ActorSystem(reference_config(cfg)) as ref:
        ids: dict[str, int] = {}
        for path in sorted({p for a in todo for p, _ in a.genes}):
            ids[path] = (await ref.gene_load(path)).id
        for q, answers in todo.items():
            await ref.slot_erase(0)
            try:
                got = await ref.complete(prompt=list(q.prompt), n_predict=q.n_predict, ignore_eos=True, slot=0,
                                         genes=[{"id": ids[p], "scale": s} for p, s in q.genes],
                                         logprobs=True, top_logprobs=4, **q.think)
            except ActordError as e:  # the reference must answer what the simulation answered
                return f"a fresh prefill of a {q.how} the simulation answered failed: {e.type}: {e.message}"
            if got.n_cached:
                return f"the reference resumed {got.n_cached} cells of an erased slot"
            for a in answers.values():
                why = parted(a.tokens, got)
                if why is not None:
                    return (f"a {a.how} of {len(a.prompt)} prompt tokens ({a.n_cached} cached, genes "
                            f"{[s for _, s in a.genes]}) answered other tokens than a fresh prefill: {why}")
    return None
