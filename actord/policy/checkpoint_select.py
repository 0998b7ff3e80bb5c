"""Which context checkpoints a slot keeps, and which one it gives up under the byte budget.

Why this exists. A hybrid/SWA model cannot cut its memory back to an arbitrary position, so
a request that shares only a prefix with what a slot holds resumes from the newest context
checkpoint at or below the raw longest common prefix (raw lcp), else from zero. llama-server
kept a slot's oldest checkpoint plus its newest N, and its byte budget evicted each list's
oldest checkpoint after the head. On the original C++ server's machine (4 minds paging over
3 slots, 35-40k-token prompts whose next request diverged about 11k in) that was exactly
wrong: the checkpoints near the end survived, the ones just under the divergence went first,
and turns re-prefilled 20k+ tokens, once from zero ("no checkpoint passed the search, raw
lcp 9710"). A 300-turn simulation of the fix moved the mean re-prefill from 32-37k to about
26.6k tokens and near-full re-prefills from 154-300 to 1.

The fix, within the same count: keep the head, up to min(2, keep // 2) of the newest
checkpoints at or below the slot's last raw lcp (the next divergence is likely near the
last one; two of them absorb some spread), the newest, and fill with the newest remaining.
The budget's victim is the one checkpoint this selection leaves out when it keeps all but
one, so a page and the budget agree about what matters. With the raw lcp unknown both
reduce to the old behaviour exactly.

Pure and synchronous: no I/O, no engine. The Slot/PageStore actors, the CheckpointBudget
actor and `bench/reprefill_sim.py` all call these same functions.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, MutableMapping, Sequence, TypeVar

import msgspec

from actord.policy.checkpoint_records import CheckpointLike

__all__ = [
    "Admission", "apply_evictions", "plan_budget_admission",
    "select", "select_indices", "under_break_indices", "victim",
]

# The names `--checkpoint-policy` takes (vocabulary/config.py CHECKPOINT_POLICIES): "placement"
# (actord.policy.checkpoint_placement) and the original C++ server's two rules here, kept as
# baselines.


T = TypeVar("T", bound=CheckpointLike)
K = TypeVar("K", bound=Hashable)


class Admission(msgspec.Struct, frozen=True):
    """The plan for admitting one new checkpoint into the byte budget.

    `evictions` are (holder key, index in that holder's list as it stands when this eviction
    is applied), to be applied in order. `skipped` means the new checkpoint is not admitted;
    a skipped admission never evicts anything. `freed_bytes` is what the evictions free.
    """

    evictions: list[tuple[Any, int]] = []
    skipped: bool = False
    freed_bytes: int = 0


def under_break_indices(checkpoints: Sequence[CheckpointLike], keep: int, raw_lcp: int | None) -> list[int]:
    """Indices (newest first) of the up to min(2, keep // 2) newest checkpoints with
    pos <= raw_lcp: the ones `select` keeps "under the break". Empty when raw_lcp is None.
    They may include the head or the newest; those are kept anyway."""
    if raw_lcp is None:
        return []
    want = min(2, keep // 2)
    out: list[int] = []
    for i in range(len(checkpoints) - 1, -1, -1):
        if len(out) >= want:
            break
        if checkpoints[i].pos <= raw_lcp:
            out.append(i)
    return out


def select_indices(checkpoints: Sequence[CheckpointLike], keep: int, raw_lcp: int | None) -> list[int]:
    """Indices (ascending) of what `select` keeps; see there."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    n = len(checkpoints)
    if n <= 1 + keep:
        return list(range(n))
    chosen = {0}
    chosen.update(under_break_indices(checkpoints, keep, raw_lcp))
    if keep >= 1:
        chosen.add(n - 1)
    i = n - 1
    while len(chosen) < 1 + keep:  # n > 1 + keep, so this always finds enough
        chosen.add(i)
        i -= 1
    return sorted(chosen)


def select(checkpoints: Sequence[T], keep: int, raw_lcp: int | None) -> list[T]:
    """What a slot's list (oldest first) keeps: a subset, in the same order, of at most 1 + keep.

    - A list of at most 1 + keep is kept whole.
    - Otherwise: the head (oldest); up to min(2, keep // 2) of the newest checkpoints with
      pos <= raw_lcp; the newest; then the newest of the rest until 1 + keep are kept.
    - raw_lcp None (no divergence known): exactly the head and the newest `keep`, the old
      behaviour.
    - keep == 0 keeps only the head (1 + 0), whatever raw_lcp says; keep == 1 keeps the
      head and the newest (min(2, 0) == 0 under the break). keep < 0 is a ValueError.
    """
    return [checkpoints[i] for i in select_indices(checkpoints, keep, raw_lcp)]


def victim(checkpoints: Sequence[CheckpointLike], raw_lcp: int | None) -> int | None:
    """Index of the checkpoint the byte budget takes from this list, or None.

    It is the one `select(checkpoints, len - 2, raw_lcp)` leaves out, so never the head,
    the newest, or one kept under the break; with raw_lcp None it is index 1 (the oldest
    after the head), as before. A list of fewer than 3 offers no victim (all it holds is a
    head and a newest).
    """
    n = len(checkpoints)
    if n < 3:
        return None
    kept = set(select_indices(checkpoints, n - 2, raw_lcp))  # exactly n - 1 of n
    return next(i for i in range(n) if i not in kept)


def _bytes(cps: Sequence[CheckpointLike]) -> int:
    return sum(c.n_bytes for c in cps)


def plan_budget_admission(
    holdings: Mapping[K, Sequence[CheckpointLike]],
    raw_lcps: Mapping[K, int | None],
    used_bytes: int,
    budget_bytes: int,
    new_bytes: int,
) -> Admission:
    """Plan how a new checkpoint of `new_bytes` enters a budget of `budget_bytes`.

    `holdings` maps each holder (a slot) to its current list, oldest first; `raw_lcps` its
    last raw lcp (a missing key means unknown). `used_bytes` is the budget's current charge
    (the caller's count; evictions subtract their n_bytes from it).

    - new_bytes > budget_bytes: skipped, nothing evicted.
    - While used + new > budget: among holders that offer a `victim`, the one holding the
      most checkpoint bytes gives it up. Ties go to the holder that comes first in
      `holdings`' iteration order (pass slots in slot-id order for a stable plan).
    - If no holder offers a victim and it still does not fit: skipped, and the plan evicts
      nothing (dropping checkpoints for a snapshot that is not kept would only lose state).
    Callers that need the budget restored without a new checkpoint pass new_bytes=0.
    """
    if new_bytes > budget_bytes:
        return Admission(skipped=True)
    lists: dict[Any, list[CheckpointLike]] = {k: list(v) for k, v in holdings.items()}
    order = list(lists)
    used = used_bytes
    evictions: list[tuple[Any, int]] = []
    freed = 0
    while used + new_bytes > budget_bytes:
        best: tuple[int, int, Any, int] | None = None  # (-bytes, rank, key, index)
        for rank, key in enumerate(order):
            idx = victim(lists[key], raw_lcps.get(key))
            if idx is None:
                continue
            cand = (-_bytes(lists[key]), rank, key, idx)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            return Admission(skipped=True)
        _, _, key, idx = best
        gone = lists[key].pop(idx)
        used -= gone.n_bytes
        freed += gone.n_bytes
        evictions.append((key, idx))
    return Admission(evictions=evictions, skipped=False, freed_bytes=freed)


def apply_evictions(lists: MutableMapping[K, list[T]], admission: Admission) -> list[tuple[K, T]]:
    """Apply a plan's evictions in order to mutable lists; returns what left, in order."""
    out: list[tuple[K, T]] = []
    for key, idx in admission.evictions:
        out.append((key, lists[key].pop(idx)))
    return out
