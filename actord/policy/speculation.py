"""Speculative decoding's pure rules: how many tokens a request drafts, what the draft
context catches up on, and which drafted tokens the target accepts.

Why these live apart from the engine: they are policy over token lists and positions, the
same for the real engine and any stand-in, and they are easiest to pin with no model.

The shape (llama-server's draft-simple, fitted to actord's step):
- A speculating request's step entry feeds its last token t at position p (or the last
  piece of its prompt). The draft context first catches up (`draft_tokens`: what the target
  holds that the draft does not, ending with t), then proposes d1..dk greedily; the target
  decodes [t, d1..dk] in the same batch as every other slot's entry, with logits on all k+1.
- Acceptance (`accept`) runs the request's OWN sampler chain at positions 0..k in order and
  stops at the first sample that differs from the draft: the samples g0..ga are exactly the
  tokens the chain would have produced one step at a time (each is taken in the state the
  previous ones left, and the target's logits at a position depend only on the tokens
  before it, which are the same). So greedy output is identical with and without
  speculation, and so is sampled output at temperature > 0 for the same seed (the chain
  draws its random numbers in the same order): not only the same distribution, the same
  tokens. The price at temperature > 0 is a lower acceptance than the speculative-sampling
  rule (min(1, p/q)), which would keep only the distribution; we keep the stronger
  guarantee. "Identical" holds to the last bits of the logits, which a verify's batch shape
  can move as any batching does (bit-equal on the f32 test models; on a quantized model a
  verify of 4+ rows takes other kernels: see docs/limits.md).
- The target's KV then holds t, d1..da (p+1+a positions), the draft's t, d1..d_min(a,k-1);
  the engine takes the rest back in both contexts in the same job: seq_rm on attention
  memory, and on recurrent or hybrid memory a rollback inside the verify batch (n_rs_seq
  snapshots) or a restore of the state copied before it and a replay of the accepted
  tokens (engine/step.py `_verify`, engine/draft.py `keep`). The MTP head (engine/mtp.py)
  follows the target's decode one position behind and re-decodes the accepted drafts.

A speculating request steps at depth 1: its next entry needs the tokens this one accepts.

A draft that keeps missing pauses (`pause_after`): after 4 verifies in a row that accepted
nothing, the request stops drafting, and its draft stops catching up, for a growing number
of steps, then probes again; one accepted token ends the pause. On a CPU, where a verify of
k+1 rows costs more than k+1 single steps, a useless draft otherwise costs several times
the plain decode; paused, it costs a catch-up of the tokens it missed, in one batch.
"""

from __future__ import annotations

from typing import Callable, Sequence


def draft_len(k_max: int, n_out: int, n_predict: int, end: int, n_ctx: int, room: int) -> int:
    """Draft tokens after an entry whose tokens end at position `end`: at most k_max; never
    more than the request may still output less the target's own token (n_predict); within
    the context (the step holds end + k positions and the next step feeds one more) and the
    `room` left in the step's batch after the entry's own tokens."""
    k = min(k_max, n_predict - n_out - 1, room)
    if n_ctx:
        k = min(k, n_ctx - end - 1)
    return max(0, k)


def catch_up(draft_done: int, end: int, budget: int) -> tuple[int, int]:
    """The positions [start, stop) the draft context decodes this step: from what it holds
    up to `end` (what the target will hold after the entry's tokens), within `budget`."""
    start = min(draft_done, end)
    return start, min(end, start + max(0, budget))


def accept(draft: Sequence[int], sample: Callable[[int], int], is_end: Callable[[int], bool]) -> list[int]:
    """Sample the target at draft positions 0..k in order (`sample(i)`), stopping after the
    first sample that differs from the draft, or that ends generation. Returns the samples
    g0..ga: g0..g(a-1) equal d1..da (accepted) and ga is the target's own next token."""
    out: list[int] = []
    for i in range(len(draft) + 1):
        g = sample(i)
        out.append(g)
        if i == len(draft) or g != draft[i] or is_end(g):
            break
    return out


def pause_after(misses: int) -> int:
    """Steps without drafting after `misses` verifies in a row accepted nothing: none for up
    to 3, then 2, 4, 8, ... up to 32. A draft whose tokens are each accepted half the time
    misses 4 verifies in a row 1 time in 16 (and one hit resets the count); one that never
    agrees probes about log2 of the steps it is given."""
    return 0 if misses < 4 else min(32, 1 << (misses - 3))
