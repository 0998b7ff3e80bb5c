"""When a generation gives its slot up to a mind waiting for one, and how it goes on.

Why: a slot is held from a request's first token to its last, so with every slot busy a
mind arriving waited for a whole generation to end (thousands of tokens, minutes on a slow
device), whatever share of the engine the scheduler gave her once she was in. A mind's
state moves between a slot and her page as a memory copy, so a long generation can step
aside instead: past `yield_after_tokens` tokens, while another mind waits for a slot, it
ends its part at a clean boundary with the internal reason "yield"; her state stays hers
(in the slot, then her page when the waiting mind takes the slot), and the caller asks for
the rest as a continuation (prompt + what she wrote, the tokens left) that waits its turn
behind the minds that waited first. The client sees one answer and one stream.

A continuation starts a new sampler, so only a request whose sampling carries no state a
new sampler would lose may yield: no grammar (its parse stack), no penalties (the tokens
they count), no thought budget, no stop strings (a match may straddle the boundary), no
fixed seed with temperature (the draw's sequence), no progress chunks or per-token timings
(a stream's running figures). Greedy decoding, and
sampling with a fresh seed, go on exactly as they would have in one part.
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from actord.vocabulary.types import CompletionRequest, CompletionResult, Timings

YIELD = "yield"  # the stop reason of a part that gave its slot up (never a client's answer)


def yieldable(req: CompletionRequest) -> bool:
    """Whether `req` may end a part early and go on as a continuation with nothing lost."""
    return (req.mind is not None and not req.grammar and req.json_schema is None and not req.grammar_triggers
            and not req.stop and req.thought_budget is None and not req.return_progress and not req.timings_per_token
            and req.presence_penalty == 0 and req.frequency_penalty == 0 and req.repeat_penalty == 1
            and not (req.seed is not None and req.temperature > 0))


def continuation(req: CompletionRequest, prompt: list[int], parts: Sequence[CompletionResult]) -> CompletionRequest:
    """The rest of `req` after `parts`: its prompt tokens and what they wrote, the tokens left."""
    out = [t for p in parts for t in p.tokens]
    return msgspec.structs.replace(req, prompt=prompt + out, n_predict=req.n_predict - len(out))


def merged(parts: Sequence[CompletionResult]) -> CompletionResult:
    """One answer from a request's parts: the first part's prompt, every part's output."""
    first, last = parts[0], parts[-1]
    prompt_ms = first.timings.prompt_ms
    predicted_ms = first.timings.predicted_ms + sum(p.timings.prompt_ms + p.timings.predicted_ms for p in parts[1:])
    n_out = sum(len(p.tokens) for p in parts)
    lps = [lp for p in parts for lp in (p.logprobs or [])] if first.logprobs is not None else None
    return CompletionResult(
        content="".join(p.content for p in parts), tokens=[t for p in parts for t in p.tokens],
        n_prompt_tokens=first.n_prompt_tokens, n_prompt_processed=sum(p.n_prompt_processed for p in parts),
        n_cached=first.n_cached, slot=last.slot, stop_reason=last.stop_reason,
        resumed_from_checkpoint=first.resumed_from_checkpoint, logprobs=lps,
        timings=Timings(
            prompt_ms=prompt_ms, predicted_ms=predicted_ms, prompt_per_second=first.timings.prompt_per_second,
            queued_ms=first.timings.queued_ms,
            predicted_per_second=n_out / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            draft_n=sum(p.timings.draft_n for p in parts),
            draft_n_accepted=sum(p.timings.draft_n_accepted for p in parts),
            draft_steps=sum(p.timings.draft_steps for p in parts),
            engine_ms=last.timings.engine_ms),  # each part's account went on from the one before
    )


def to_yield(candidates: Sequence[tuple[int, int]], after: int) -> int | None:
    """Of (rid, tokens written so far) for the yieldable requests at a clean boundary, the
    one that gives its slot up: the one that has written most, once past `after`."""
    past = [(n, rid) for rid, n in candidates if n >= after > 0]
    return max(past)[1] if past else None
