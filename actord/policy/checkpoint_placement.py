"""Where a slot makes context checkpoints, which it keeps, and which the budget gives up.

Why this exists. A model whose memory cannot be cut back (SWA without a full cache,
recurrent, hybrid) resumes a request that diverges at raw lcp `d` from the newest checkpoint
`p <= d`, and re-prefills `d - p` tokens it already had. Where checkpoints are made and
which survive decides that cost. The original C++ server made one every `--checkpoint-every`
tokens and kept a count (head, two under the last raw lcp, the newest): on a workload none
of us wrote (issue 11) that processed 17% more than the floor, and making checkpoints denser
made it worse, because the keep was by count and the dense ones crowded out the ones under
the divergence. More information led to a worse decision.

The rule here is one objective everywhere: the expected re-prefill of the mind's next
request, E[d - max{p <= d}] (0 stands in when no checkpoint is at or below d),

- over a forecast of `d` (`forecast`): the divergences this mind's requests actually had
  (`Divergence`, a bounded history kept in its slot, page and page file, newer ones
  weighing more), plus two priors that count as observations, "it appends at the end"
  (the next prompt extends this one: the checkpoint at the prompt's end serves it) and
  "nothing known yet" (uniform over the prompt), so a mind with no history gets an end
  checkpoint and evenly spaced ones, and history pulls them to where it diverges;
- subject to bytes: a slot plans as many as its share of the byte budget holds (never
  more than the `--ctx-checkpoints` safety cap), choosing positions by an exact dynamic
  program over candidate positions (`choose`, `plan`); a page keeps the best subset of
  what its slot held (`keep_best`); and the one budget across slots evicts the checkpoint
  whose loss raises its slot's expected re-prefill least per byte freed, admitting a new
  one only when the trade lowers the total (`plan_admission`): more checkpoints can never
  make the expected cost worse than fewer.

Placement is a 1-D problem: choosing a set P, |P| <= k, minimizing the sum over
consecutive P of a segment cost. The DP over m candidates is O(k m^2), done as k numpy
passes over an m x m matrix; m stays in the low hundreds. Candidates are every forecast point in
range (for point masses those are exact: moving a checkpoint up to the next point never
hurts), the prompt's end, and a grid at multiples of `align` past the resume point: the
scheduler cuts prompt chunks there anyway, so a grid checkpoint costs a state copy and no
extra decode. Each new checkpoint is charged `creation_cost` tokens (its copy, maybe a
split), so the plan never cuts a prompt into more pieces than its expected saving pays for.

Classifying a past divergence needs where the prompt before it ended (`Divergence.end`):
a divergence at or past it was an append (mass at the new prompt's end); one nearer that
end than the start is end-anchored (same distance before the new end: "edit the last
message"); others are start-anchored (same position: "edit the system text").

Pure and synchronous, like every policy: the Slot, the CheckpointBudget and
`bench/reprefill_sim.py` call these same functions.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Protocol, Sequence, TypeVar

import msgspec
import numpy as np

from actord.policy.checkpoint_select import Admission

__all__ = [
    "CREATION_COST", "Choice", "DECAY", "Divergence", "Forecast", "GRID", "HISTORY", "PRIOR_APPEND",
    "PRIOR_UNKNOWN", "candidates", "choose", "expected_cost", "forecast", "keep_best", "marginal_losses",
    "plan", "plan_admission", "remember", "slot_count",
]

HISTORY = 16  # divergences remembered per mind
DECAY = 0.85  # weight of an observation per newer one after it
PRIOR_APPEND = 1.0  # pseudo-observations: "the next prompt extends this one"
PRIOR_UNKNOWN = 1.0  # pseudo-observations: "it may diverge anywhere" (uniform)
CREATION_COST = 4.0  # tokens of expected re-prefill a new checkpoint must save
GRID = 48  # most grid candidates per placement
SPREAD_PRIOR = 1 / 32  # a divergence group's spread before any is seen, as a share of the prompt
SPREAD_WEIGHT = 2.0  # pseudo-observations behind that prior spread


class _Ckpt(Protocol):
    @property
    def pos(self) -> int: ...

    @property
    def n_bytes(self) -> int: ...


K = TypeVar("K", bound=Hashable)


class Divergence(msgspec.Struct, frozen=True, array_like=True):
    """One request's raw lcp and where the prompt before it ended (its length)."""

    lcp: int
    end: int


def remember(history: Sequence[Divergence], d: Divergence, bound: int = HISTORY) -> list[Divergence]:
    """The history with `d` appended, oldest first, at most `bound` long."""
    out = [*history, d]
    return out[-bound:] if bound > 0 else []


@dataclass(frozen=True)
class Forecast:
    """A distribution of the next divergence d over the integers 0..length.

    `points` are (position, probability), sorted and merged; `uniform` is the probability
    spread evenly over 0..length. They sum to 1.
    """

    length: int
    points: tuple[tuple[int, float], ...]
    uniform: float
    _xs: list[int] = field(init=False, repr=False, compare=False)
    _w: list[float] = field(init=False, repr=False, compare=False)
    _wx: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        xs, w, wx = [], [0.0], [0.0]
        for x, p in self.points:
            xs.append(x)
            w.append(w[-1] + p)
            wx.append(wx[-1] + p * x)
        object.__setattr__(self, "_xs", xs)
        object.__setattr__(self, "_w", w)
        object.__setattr__(self, "_wx", wx)

    @staticmethod
    def unknown(length: int) -> "Forecast":
        return Forecast(length=max(0, length), points=(), uniform=1.0)

    def seg(self, a: int, b: int | None = None) -> float:
        """Expected cost of the d in [a, b) resuming at a (b None: to the end)."""
        top = self.length + 1
        b = top if b is None or b > top else b
        if b <= a:
            return 0.0
        i0, i1 = bisect.bisect_left(self._xs, a), bisect.bisect_left(self._xs, b)
        cost = (self._wx[i1] - self._wx[i0]) - a * (self._w[i1] - self._w[i0])
        if self.uniform:
            m = b - a
            cost += self.uniform * m * (m - 1) / (2 * top)
        return cost

    def prefix(self, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(W, WX): point mass and mass-weighted position below each q."""
        idx = np.searchsorted(np.asarray(self._xs, dtype=np.int64), qs, side="left")
        return np.asarray(self._w)[idx], np.asarray(self._wx)[idx]


def _bandwidth(xs: list[float], ws: list[float], fallback: float) -> float:
    """Silverman's rule on the weighted sample; `fallback` when it cannot say (one point)."""
    n_eff = sum(ws) ** 2 / sum(w * w for w in ws) if ws else 0.0
    if n_eff < 1.5:
        return fallback
    mean = sum(w * x for x, w in zip(xs, ws)) / sum(ws)
    var = sum(w * (x - mean) ** 2 for x, w in zip(xs, ws)) / sum(ws)
    return 1.06 * var ** 0.5 * n_eff ** -0.2


def _shrunk(observed: float, prior: float, n_eff: float) -> float:
    """A width from n_eff observations, shrunk toward `prior` worth SPREAD_WEIGHT of them."""
    return ((SPREAD_WEIGHT * prior * prior + n_eff * observed * observed) / (SPREAD_WEIGHT + n_eff)) ** 0.5


def _spread(xs: list[float], ws: list[float], fallback: float) -> float:
    n_eff = sum(ws) ** 2 / sum(w * w for w in ws) if ws else 0.0
    if n_eff < 1.5:
        return fallback
    mean = sum(w * x for x, w in zip(xs, ws)) / sum(ws)
    return (sum(w * (x - mean) ** 2 for x, w in zip(xs, ws)) / sum(ws)) ** 0.5


_TAIL = [(j, 2.718281828459045 ** (-j * j / 8)) for j in range(1, 7)]  # half N(0, 1) at 0.5..3 sd
_TSUM = sum(v for _, v in _TAIL)
_KERNEL = [(j, 2.718281828459045 ** (-j * j / 8)) for j in range(-4, 5)]  # N(0, 1) at j/2, +-2 sd
_KSUM = sum(v for _, v in _KERNEL)


def forecast(history: Sequence[Divergence], n_prompt: int, *, population: Sequence[float] = (),
             prior_append: float = PRIOR_APPEND, prior_unknown: float = PRIOR_UNKNOWN,
             decay: float = DECAY) -> Forecast:
    """Where the next request on a prompt of `n_prompt` tokens is likely to diverge.

    d ranges over 0..n_prompt - 1: the end checkpoint sits at n_prompt - 1 (one token is
    always left to decode for logits), and an append resumes from it. Appends are exact
    (mass at the end); start- and end-anchored divergences are each smoothed by a Gaussian
    kernel whose width is their own spread (Silverman's rule) shrunk toward a prior spread
    of 1/32 of the prompt (worth two observations), discretized at nine points over +-2
    widths: the next divergence is rarely exactly a past one, and a forecast that put no
    mass between or below the observed ones would leave no checkpoint there. Part of each
    observation stays exactly where it was: most of it when the group agrees exactly (a
    lone one keeps half), 1/(n + 1) once a spread is seen.

    `population`: where other minds diverged, as fractions of their prompts (what the slot
    has seen). Minds built from one template tend to diverge in the same place; when given,
    half of the "nothing known yet" prior goes there (smoothed the same way) and half stays
    uniform, so a mind's first divergence is not a blind guess either.
    """
    length = max(0, n_prompt - 1)
    mass: dict[int, float] = {}

    def add(x: float, w: float) -> None:
        xi = min(max(0, int(round(x))), length)
        mass[xi] = mass.get(xi, 0.0) + w

    if prior_append > 0:
        add(length, prior_append)
    groups: dict[str, tuple[list[float], list[float]]] = {"start": ([], []), "end": ([], [])}
    # Recency shapes the weights, not the evidence: n observations weigh n against the priors.
    scale = len(history) / sum(decay ** age for age in range(len(history))) if history else 0.0
    for age, h in enumerate(reversed(history)):
        w = scale * decay ** age
        if h.lcp >= h.end - 1:  # reached the old prompt's end: an append
            add(length, w)
            continue
        kind = "end" if h.end - h.lcp < h.lcp else "start"  # nearer the end than the start
        x = length - (h.end - 1 - h.lcp) if kind == "end" else h.lcp
        groups[kind][0].append(float(x))
        groups[kind][1].append(w)
    pop = [min(1.0, max(0.0, f)) * length for f in population]
    if pop and prior_unknown > 0:
        groups["population"] = (pop, [prior_unknown / 2 / len(pop)] * len(pop))
        prior_unknown /= 2
    s0 = length * SPREAD_PRIOR
    for xs, ws in groups.values():
        if not xs:
            continue
        n_eff = sum(ws) ** 2 / sum(w * w for w in ws)
        h = _bandwidth(xs, ws, fallback=0.0)
        sd = _spread(xs, ws, fallback=0.0)
        # A spread seen in a few observations is a poor estimate of the next one's (two
        # edits 7 tokens apart say little about a word picked from a 76-token span), so
        # the width is shrunk toward the prior spread as if that had SPREAD_WEIGHT
        # observations behind it; as evidence accumulates, the observed spread takes over.
        bw = _shrunk(h, s0, n_eff)
        # Observations that agree exactly are evidence of an exact repeat (a fixed template
        # slot): all but 1/(n + 1) of their weight stays exactly where they were. Once a
        # spread is seen, only 1/(n + 1) does.
        exact = n_eff / (n_eff + 1) if h < 1 else 1 / (n_eff + 1)
        for x, w in zip(xs, ws):
            add(x, w * exact)
            if bw >= 1:
                for j, v in _KERNEL:
                    add(x + j * bw / 2, w * (1 - exact) * v / _KSUM)
            else:
                add(x, w * (1 - exact))
        # The next one falls below the lowest seen (or above the highest) with probability
        # about 1/(n + 1) each (Hill's predictive): half-Gaussian tails of the group's
        # spread, shrunk the same way. Only where a spread is seen: one observation, or
        # several that agree, say nothing about it (their kernel above is all they get).
        tail = sum(ws) / (n_eff + 1)
        if sd >= 1:
            sd = _shrunk(sd, s0, n_eff)
            for j, v in _TAIL:
                add(min(xs) - j * sd / 2, tail * v / _TSUM)
                add(max(xs) + j * sd / 2, tail * v / _TSUM)
    total = sum(mass.values()) + max(0.0, prior_unknown)
    if total <= 0:
        return Forecast.unknown(length)
    points = tuple((x, w / total) for x, w in sorted(mass.items()) if w > 0)
    return Forecast(length=length, points=points, uniform=max(0.0, prior_unknown) / total)


def expected_cost(fc: Forecast, positions: Sequence[int]) -> float:
    """E[d - max{p in positions, p <= d}] (0 when none is), in tokens."""
    ps = sorted({p for p in positions if 0 < p <= fc.length})
    cost, prev = 0.0, 0
    for p in ps:
        cost += fc.seg(prev, p)
        prev = p
    return cost + fc.seg(prev, None)


def marginal_losses(fc: Forecast, positions: Sequence[int]) -> list[float]:
    """For each position (in the given order): how much the expected cost rises without it.

    A duplicate, a position <= 0 or one past the forecast's end loses nothing.
    """
    counts: dict[int, int] = {}
    for p in positions:
        counts[p] = counts.get(p, 0) + 1
    ps = sorted(p for p in counts if 0 < p <= fc.length)
    loss: dict[int, float] = {}
    for i, p in enumerate(ps):
        if counts[p] > 1:
            loss[p] = 0.0
            continue
        lo = ps[i - 1] if i else 0
        hi = ps[i + 1] if i + 1 < len(ps) else None
        loss[p] = fc.seg(lo, hi) - fc.seg(lo, p) - fc.seg(p, hi)
    return [max(0.0, loss.get(p, 0.0)) for p in positions]


@dataclass(frozen=True)
class Choice:
    cost: float  # expected re-prefill of keep + make (tokens)
    objective: float  # cost + creation_cost per made checkpoint
    keep: list[int]  # positions of `have` chosen, ascending
    make: list[int]  # positions of `can_make` chosen, ascending


def choose(fc: Forecast, have: Sequence[int], can_make: Sequence[int], k: int,
           creation_cost: float = 0.0) -> Choice:
    """The exact optimum over subsets S of have (free) and can_make (each at creation_cost),
    |S| <= k, of expected_cost(S) + creation_cost * |S & can_make|.

    A position in both lists counts as had. Positions outside 1..length are never chosen
    (they serve nothing). Ties go to fewer checkpoints, then to lower positions.
    """
    had = {p for p in have if 0 < p <= fc.length}
    new = {p for p in can_make if 0 < p <= fc.length} - had
    q = np.array([0, *sorted(had | new)], dtype=np.int64)
    m = len(q)
    k = max(0, min(k, m - 1))
    price = np.array([0.0] + [0.0 if int(p) in had else creation_cost for p in q[1:]])
    # seg[i, j] = cost of the d in [q_i, q_j) resuming at q_i; tail[i] = seg to the end.
    qf = q.astype(np.float64)
    top = fc.length + 1
    W, WX = fc.prefix(q)
    Wt, WXt = fc.prefix(np.array([top]))
    span = qf[None, :] - qf[:, None]
    seg = (WX[None, :] - WX[:, None]) - qf[:, None] * (W[None, :] - W[:, None])
    seg += fc.uniform * span * (span - 1) / (2 * top)
    seg = np.where(span > 0, seg, np.inf)
    tspan = top - qf
    tail = (WXt[0] - WX) - qf * (Wt[0] - W) + fc.uniform * tspan * (tspan - 1) / (2 * top)
    dp = np.full(m, np.inf)
    dp[0] = 0.0
    back: list[np.ndarray] = []
    best, best_c, best_j = float(tail[0]), 0, 0
    for c in range(1, k + 1):
        tot = dp[:, None] + seg  # [i, j]
        arg = np.argmin(tot, axis=0)
        dp = tot[arg, np.arange(m)] + price
        dp[0] = np.inf
        back.append(arg)
        fin = dp + tail
        j = int(np.argmin(fin))
        if fin[j] < best - 1e-9 * max(1.0, abs(best)):
            best, best_c, best_j = float(fin[j]), c, j
    chosen: list[int] = []
    j = best_j
    for c in range(best_c, 0, -1):
        chosen.append(int(q[j]))
        j = int(back[c - 1][j])
    chosen.reverse()
    keep = [p for p in chosen if p in had]
    make = [p for p in chosen if p not in had]
    return Choice(cost=expected_cost(fc, chosen), objective=best, keep=keep, make=make)


def candidates(fc: Forecast, lo: int, hi: int, *, align: int = 1, grid: int = GRID, tile: int = 1) -> list[int]:
    """Positions in (lo, hi] worth considering for a prompt decoded from lo to hi.

    Every forecast point there, hi itself (the prompt's end), and up to `grid` grid
    positions lo + j * step. On a prompt long enough for `grid` chunks of `align` (the
    scheduler's chunk size) the step is a multiple of it, so a grid checkpoint costs no
    extra decode; on a shorter one the grid is finer than a chunk (a split decode costs
    less than hundreds of re-prefilled tokens). With `tile` > 1 (`Config.piece_tile`)
    the scheduler ends pieces on multiples of it, and grid positions are rounded down to
    them: ggml's batched matmuls run a piece of 135 tokens ~11% slower than one of 128 or
    192 (measured on Gemma 3 270M, 2 cores), so pieces between grid checkpoints stay whole.
    """
    if hi <= lo:
        return []
    out = {x for x, _ in fc.points if lo < x <= hi}
    out.add(hi)
    align = max(1, align)
    step = max(1, -(-(hi - lo) // max(1, grid)))
    if step >= align:
        step = align * -(-step // align)
    elif tile > 1:
        step = min(align, tile * -(-step // tile))
    if tile > 1:  # the scheduler's piece boundaries: lo + j * step, each rounded down to a tile
        out.update(p for p in ((lo + j * step) // tile * tile for j in range(1, (hi - lo) // step + 1))
                   if lo < p < hi)
    else:
        out.update(range(lo + step, hi, step))
    return sorted(out)


def plan(fc: Forecast, have: Sequence[int], lo: int, hi: int, k: int, *, align: int = 1,
         creation_cost: float = CREATION_COST, grid: int = GRID, tile: int = 1) -> list[int]:
    """The positions to make while a prompt is decoded from `lo` to `hi` (ascending).

    `have` are the slot's checkpoints (those <= lo survive the cut); the plan is the best
    set of at most k of them and new ones, and returns only the new ones.
    """
    cands = candidates(fc, lo, hi, align=align, grid=grid, tile=tile)
    if not cands or k <= 0:
        return []
    return choose(fc, [p for p in have if p <= lo], cands, k, creation_cost).make


def keep_best(fc: Forecast, positions: Sequence[int], k: int) -> list[int]:
    """Indices (ascending) of the at most k positions a page keeps: the exact best subset."""
    if len(positions) <= k:
        return list(range(len(positions)))
    kept = set(choose(fc, positions, [], k).keep)
    out: list[int] = []
    for i, p in enumerate(positions):
        if p in kept:
            out.append(i)
            kept.discard(p)
    return out


def slot_count(share_bytes: int, ckpt_bytes: int, cap: int) -> int:
    """How many checkpoints a slot plans: what its byte share holds, at most `cap`.
    With the size not yet known, the cap (the budget sorts it out at admission)."""
    if ckpt_bytes <= 0:
        return cap
    return max(0, min(cap, share_bytes // ckpt_bytes))


def plan_admission(
    holdings: Mapping[K, Sequence[_Ckpt]], forecasts: Mapping[K, Forecast], used_bytes: int,
    budget_bytes: int, holder: K, new: _Ckpt, cap: int | None = None,
) -> Admission:
    """Plan how `new` (for `holder`) enters a budget of `budget_bytes`, at most `cap` per list.

    While the budget (or the holder's count) is exceeded, the checkpoint whose removal
    raises its own list's expected re-prefill least per byte goes (only the holder's
    list competes when the count is what is exceeded; ties: holder order, then older).
    If that is `new` itself, or the trade would not lower the total expected re-prefill,
    the plan is skipped and evicts nothing. Evictions are (holder, index in its list as it
    stands when applied); `new` is not in the lists given.
    """
    if new.n_bytes > budget_bytes:
        return Admission(skipped=True)
    lists: dict[Any, list[_Ckpt]] = {key: list(v) for key, v in holdings.items()}
    lists.setdefault(holder, [])
    order = {key: r for r, key in enumerate(lists)}

    def fc_of(key: Any) -> Forecast:
        f = forecasts.get(key)
        if f is None:
            top = max((c.pos for c in lists[key]), default=0)
            f = Forecast.unknown(top + 1)
        return f

    before = {key: expected_cost(fc_of(key), [c.pos for c in lists[key]]) for key in lists}
    lists[holder].append(new)
    used = used_bytes + new.n_bytes
    evictions: list[tuple[Any, int]] = []
    freed = 0
    touched = {holder}
    while used > budget_bytes or (cap is not None and len(lists[holder]) > cap):
        pool = [holder] if used <= budget_bytes else list(lists)
        best: tuple[float, int, int, Any] | None = None
        for key in pool:
            lst = lists[key]
            losses = marginal_losses(fc_of(key), [c.pos for c in lst])
            for idx, (c, loss) in enumerate(zip(lst, losses)):
                cand = (loss / max(1, c.n_bytes), order[key], idx, key)
                if best is None or cand[:3] < best[:3]:
                    best = cand
        if best is None:
            return Admission(skipped=True)
        _, _, idx, key = best
        if lists[key][idx] is new:
            return Admission(skipped=True)
        gone = lists[key].pop(idx)
        used -= gone.n_bytes
        freed += gone.n_bytes
        evictions.append((key, idx))
        touched.add(key)
    if evictions:
        after = sum(expected_cost(fc_of(key), [c.pos for c in lists[key]]) for key in touched)
        if after >= sum(before[key] for key in touched) - 1e-9:
            return Admission(skipped=True)
    return Admission(evictions=evictions, skipped=False, freed_bytes=freed)
