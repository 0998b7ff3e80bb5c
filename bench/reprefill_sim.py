"""Re-prefill cost of checkpoint policies, side by side on one workload, against the floor.

Why: the original C++ server chose its checkpoint rule by a throwaway simulation (mean
re-prefill 32-37k -> ~26.6k tokens, near-full re-prefills 154-300 -> 1 over 300 turns). This
script is that experiment made repeatable, driven through the real policy functions, so a
change to a rule shows its cost here. Three policies replay the very same turns:

- oldest: a checkpoint every `--spacing` tokens; a page keeps the head and the newest
  `--keep`; the budget takes the fullest list's oldest after its head (raw lcp unknown);
- divergence: the original C++ server's rule (`actord.policy.checkpoint_select`): the same
  spacing, and the keep and the budget's victim aware of the slot's last raw lcp;
- placement (the default, `actord.policy.checkpoint_placement`): checkpoints made where the expected
  re-prefill of the mind's next request is least, given its divergence history, under the
  slot's share of the byte budget (grid aligned to `--align`, the scheduler's chunk); a
  page keeps the best subset; the budget evicts least expected-cost increase per byte.

The model (all draws from one seeded RNG):

- `--minds` minds share `--slots` slots. Each mind first runs one cold turn (full prefill,
  not measured). Each measured turn serves one mind: with probability `--page-rate` a
  paged-out one (the least recently used resident pages out to make room), else a resident
  one, uniformly. With 4 minds over 3 slots that is `--page-rate` pages per turn.
- A mind's prompt starts at 35-40k tokens. Each turn appends its last reply (100-600
  tokens) and a new message (200-1000); past 40k the oldest history is trimmed by 4-6k.
- The next request shares a raw prefix (raw lcp) with what the slot holds:
  * extend (probability `--extend-prob`, never after a trim): everything it holds, so no
    checkpoint is needed and only the new tokens are decoded;
  * diverge: at the mind's own point (`--diverge-at` +- up to 2k, fixed per mind: the
    stable system/persona part) plus Gaussian jitter of sd `--spread` per turn.
- Hybrid/SWA semantics: a diverging request resumes from the newest checkpoint at or below
  the raw lcp, else from 0; checkpoints past the resume point die. Each checkpoint is
  `--ckpt-mb` MB (default ~7.9 MB, Gemma 3 270M's SWA partial state), admitted under one
  `--budget-mb` budget across slots. A slot and a page hold at most 1 + `--keep`
  (`--ctx-checkpoints`: a safety cap); pages do not count against the budget; a page-in
  re-admits its checkpoints oldest first.

Reported per measured turn: re-prefill tokens (prompt length - resume point), near-full
re-prefills (> 90% of the prompt), checkpoints made per turn (each a state copy; off the
grid also an extra decode split), and the floor (prompt - raw lcp: what a model that can
cut its memory anywhere would pay; no checkpoint rule can beat it). The goal for the
default policy at the default budget: near-full <= 1 and mean within 5% of the floor; the
script exits 1 when it is not met.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actord.vocabulary.config import Config  # noqa: E402
from actord.policy.checkpoint_records import CheckpointSize  # noqa: E402
from actord.policy.checkpoint_select import (  # noqa: E402
    apply_evictions, plan_budget_admission, select,
)
from actord.policy.checkpoint_placement import (  # noqa: E402
    Divergence, forecast, keep_best, plan, plan_admission, remember, slot_count,
)

POLICIES = ("oldest", "divergence", "placement")

NEAR_FULL = 0.9


@dataclass(frozen=True)
class Turn:
    mind: int
    evict: int | None  # the mind paged out first, if any
    page_in: bool  # the mind comes from the page store (or cold)
    raw_lcp_cap: int | None  # divergence point; None = extend (all the slot holds)
    new_len: int
    gen: int
    measured: bool


def workload(a: argparse.Namespace, seed: int) -> list[Turn]:
    rng = random.Random(seed)
    centre = [a.diverge_at + rng.randint(-2000, 2000) for _ in range(a.minds)]
    length = [rng.randint(35_000, 40_000) for _ in range(a.minds)]
    gen = [0] * a.minds
    lru: list[int] = []  # resident minds, least recently used first
    turns: list[Turn] = []
    order = list(range(a.minds)) + [None] * a.turns  # cold turns, then measured ones
    for pick in order:
        measured = pick is None
        if measured:
            out = [m for m in range(a.minds) if m not in lru]
            pool = out if out and rng.random() < a.page_rate else lru
            pick = rng.choice(pool)
        evict = lru.pop(0) if pick not in lru and len(lru) >= a.slots else None
        page_in = pick not in lru
        if not page_in:
            lru.remove(pick)
        lru.append(pick)
        if not measured:
            turns.append(Turn(pick, evict, True, 0, length[pick], g := rng.randint(100, 600), False))
            gen[pick] = g
            continue
        new_len = length[pick] + gen[pick] + rng.randint(200, 1000)
        trimmed = new_len > 40_000
        if trimmed:
            new_len -= rng.randint(4000, 6000)
        if not trimmed and rng.random() < a.extend_prob:
            cap = None
        else:
            cap = max(1, round(rng.gauss(centre[pick], a.spread)))
        g = rng.randint(100, 600)
        turns.append(Turn(pick, evict, page_in, cap, new_len, g, True))
        length[pick], gen[pick] = new_len, g
    return turns


@dataclass
class Result:
    reprefill: list[int] = field(default_factory=list)
    floor: list[int] = field(default_factory=list)
    near_full: int = 0
    evicted: int = 0
    skipped: int = 0
    made: int = 0  # checkpoints made (each a state copy, most an extra decode split)


def simulate(turns: list[Turn], a: argparse.Namespace, policy: str) -> Result:
    """Replay `turns` under one policy: "oldest" and "divergence" make a checkpoint every
    `--spacing` tokens and keep by count (the original C++ server's rules, with the raw lcp unknown or
    known); "placement" makes and keeps what minimizes the expected re-prefill."""
    size = int(a.ckpt_mb * 1_000_000)
    budget = int(a.budget_mb * 1_000_000)
    cap = 1 + a.keep
    share = budget // a.slots
    lists: dict[int, list[CheckpointSize]] = {}  # resident mind -> its slot's list
    held: dict[int, int] = {}  # resident mind -> tokens its slot holds
    lcp: dict[int, int | None] = {}  # resident mind -> resume_raw_lcp
    history: dict[int, list[Divergence]] = {}  # every mind's divergences (slot, page, file)
    prompt_end: dict[int, int] = {}  # every mind's last prompt length
    pages: dict[int, tuple[list[CheckpointSize], int]] = {}
    slot_of: dict[int, int] = {}  # resident mind -> its slot
    free = list(range(a.slots))
    population: dict[int, list[float]] = {s: [] for s in range(a.slots)}  # per slot, as in the daemon
    used = 0
    res = Result()

    def fc_of(mind: int, n: int | None = None):
        pop = population[slot_of[mind]] if mind in slot_of else []
        return forecast(history.get(mind, []), n or prompt_end.get(mind, held.get(mind, 0)), population=pop)

    def admit(mind: int, ck: CheckpointSize) -> None:
        nonlocal used
        res.made += 1
        if policy == "placement":
            fcs = {m: fc_of(m) for m in lists}
            plan_ = plan_admission(lists, fcs, used, budget, mind, ck, cap=cap)
        else:
            plan_ = plan_budget_admission(lists, lcp if policy == "divergence" else {}, used, budget, ck.n_bytes)
        if plan_.skipped:
            res.skipped += 1
            return
        for _, gone in apply_evictions(lists, plan_):
            used -= gone.n_bytes
            res.evicted += 1
        lists[mind].append(ck)
        used += ck.n_bytes

    for t in turns:
        if t.evict is not None:
            free.append(slot_of[t.evict])
            ev = lists.pop(t.evict)
            used -= sum(c.n_bytes for c in ev)
            raw_ev = lcp.pop(t.evict)
            if policy == "placement":
                kept = [ev[i] for i in keep_best(fc_of(t.evict), [c.pos for c in ev], cap)]
            else:
                kept = select(ev, a.keep, raw_ev if policy == "divergence" else None)
            pages[t.evict] = (kept, held.pop(t.evict))
            del slot_of[t.evict]
        if t.page_in:
            slot_of[t.mind] = free.pop(0)
            saved, n_held = pages.pop(t.mind, ([], 0))
            lists[t.mind], held[t.mind], lcp[t.mind] = [], n_held, None
            for ck in saved:
                res.made -= 1  # re-admitted, not made
                admit(t.mind, ck)
        n_held = held[t.mind]
        raw = n_held if t.raw_lcp_cap is None else min(t.raw_lcp_cap, n_held)
        lcp[t.mind] = raw
        if n_held:
            end = prompt_end.get(t.mind, n_held)
            history[t.mind] = remember(history.get(t.mind, []), Divergence(raw, end))
            if raw < end - 1:
                population[slot_of[t.mind]] = [*population[slot_of[t.mind]], raw / end][-32:]
        if raw >= n_held:
            resume = n_held
        else:
            resume = max((c.pos for c in lists[t.mind] if c.pos <= raw), default=0)
        dead = [c for c in lists[t.mind] if c.pos > resume]
        used -= sum(c.n_bytes for c in dead)
        lists[t.mind] = [c for c in lists[t.mind] if c.pos <= resume]
        if policy == "placement":
            k = slot_count(share, size, cap)
            fc = fc_of(t.mind, t.new_len)
            at = plan(fc, [c.pos for c in lists[t.mind]], resume, t.new_len - 1, k, align=a.align)
        else:
            at = list(range((resume // a.spacing + 1) * a.spacing, t.new_len + 1, a.spacing))
        prompt_end[t.mind] = t.new_len
        for pos in at:
            admit(t.mind, CheckpointSize(pos=pos, n_bytes=size))
        held[t.mind] = t.new_len + t.gen
        if t.measured:
            cost = t.new_len - resume
            res.reprefill.append(cost)
            res.floor.append(t.new_len - raw)
            res.near_full += cost > NEAR_FULL * t.new_len
    return res


def run(a: argparse.Namespace, seed: int) -> dict[str, Result]:
    turns = workload(a, seed)
    return {p: simulate(turns, a, p) for p in POLICIES}


def report(a: argparse.Namespace) -> bool:
    rs = run(a, a.seed)
    n = len(rs["oldest"].reprefill)
    pages = sum(1 for t in workload(a, a.seed) if t.measured and t.page_in)
    print(f"seed {a.seed}: {n} turns, {a.minds} minds over {a.slots} slots, {pages / n:.2f} page-ins/turn, "
          f"checkpoints of {a.ckpt_mb} MB, keep {a.keep}, budget {a.budget_mb:g} MB; "
          f"oldest/divergence: one every {a.spacing} tok; placement: aligned to {a.align}")
    print(f"{'policy':<10} {'mean re-prefill':>16} {'near-full (>90%)':>17} {'made/turn':>10} {'evicted':>8} "
          f"{'skipped':>8}")
    for name, r in rs.items():
        print(f"{name:<10} {statistics.fmean(r.reprefill):>16,.0f} {r.near_full:>17} {r.made / n:>10.1f} "
              f"{r.evicted:>8} {r.skipped:>8}")
    floor = statistics.fmean(rs["placement"].floor)
    print(f"{'floor':<10} {floor:>16,.0f}   (prompt - raw lcp: no checkpoint rule beats it)")
    new = rs["placement"]
    ratio = statistics.fmean(new.reprefill) / floor
    ok = new.near_full <= 1 and ratio <= 1.05
    print(f"placement: mean re-prefill {ratio:.3f}x the floor, {new.near_full} near-full "
          f"(goal: <= 1.05x and <= 1): {'met' if ok else 'NOT met'}")
    return ok


SWEEP = [
    ("defaults", {}),
    ("spacing", {"spacing": [1024, 4096, 8192]}),
    ("keep", {"keep": [2, 4, 16, 32]}),
    ("budget_mb", {"budget_mb": [64.0, 128.0, 512.0, 1e9]}),
    ("spread", {"spread": [0.0, 3000.0]}),
    ("page_rate", {"page_rate": [0.5, 1.0]}),
    ("extend_prob", {"extend_prob": [0.0, 0.3]}),
]


def sweep(a: argparse.Namespace) -> None:
    seeds = range(a.seed, a.seed + a.sweep_seeds)
    print(f"\nsweep: one flag at a time from the defaults above, mean over seeds {seeds.start}..{seeds.stop - 1}")
    print(f"{'flag':<12} {'value':>8} {'oldest':>8} {'diverg.':>8} {'placem.':>8} {'floor':>7} {'pl/floor':>8} "
          f"{'nf old':>7} {'nf div':>7} {'nf pl':>6}")
    for flag, values in SWEEP:
        for v in values.get(flag, [None]) if values else [None]:
            b = argparse.Namespace(**vars(a))
            if v is not None:
                setattr(b, flag, v)
            rs = [run(b, s) for s in seeds]
            mean = {p: statistics.fmean(statistics.fmean(r[p].reprefill) for r in rs) for p in POLICIES}
            nf = {p: statistics.fmean(r[p].near_full for r in rs) for p in POLICIES}
            fl = statistics.fmean(statistics.fmean(r["placement"].floor) for r in rs)
            shown = "-" if v is None else f"{v:g}"
            print(f"{flag:<12} {shown:>8} {mean['oldest']:>8,.0f} {mean['divergence']:>8,.0f} "
                  f"{mean['placement']:>8,.0f} {fl:>7,.0f} {mean['placement'] / fl:>8.3f} "
                  f"{nf['oldest']:>7.1f} {nf['divergence']:>7.1f} {nf['placement']:>6.1f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turns", type=int, default=300)
    p.add_argument("--minds", type=int, default=4)
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--spacing", type=int, default=2048, help="tokens between checkpoints")
    p.add_argument("--keep", type=int, default=Config(model="").ctx_checkpoints,
                   help="a slot and a page hold at most 1 + keep (--ctx-checkpoints)")
    p.add_argument("--align", type=int, default=512, help="the scheduler's chunk (--batch): placement's grid")
    p.add_argument("--ckpt-mb", type=float, default=7.9, help="bytes per checkpoint, MB")
    p.add_argument("--budget-mb", type=float, default=256.0, help="checkpoint budget over all slots")
    p.add_argument("--diverge-at", type=int, default=11_000)
    p.add_argument("--spread", type=float, default=1000.0, help="sd of the divergence per turn")
    p.add_argument("--extend-prob", type=float, default=0.1)
    p.add_argument("--page-rate", type=float, default=0.75)
    p.add_argument("--sweep", action="store_true", help="also print a one-flag-at-a-time sweep")
    p.add_argument("--sweep-seeds", type=int, default=3)
    a = p.parse_args(argv)
    if a.spacing < 1 or a.keep < 0 or a.minds < 1 or a.slots < 1:
        p.error("spacing, minds and slots must be >= 1, keep >= 0")
    t0 = time.perf_counter()
    ok = report(a)
    if a.sweep:
        sweep(a)
    print(f"({time.perf_counter() - t0:.1f} s)")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
