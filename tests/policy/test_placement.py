"""Checkpoint placement by expected re-prefill (actord.policy.checkpoint_placement).

Why: where checkpoints are made and which survive decides how much of a prompt a
diverging request re-prefills. These pin that the dynamic program is the exact optimum
(against brute force over every subset on small instances), that more budget never costs
more, that the forecast reads a history the way the module says, and that the budget's
admission never trades a checkpoint for one worth less.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from actord.policy.checkpoint_records import CheckpointSize
from actord.policy.checkpoint_select import apply_evictions
from actord.policy.checkpoint_placement import (
    GRID, Divergence, Forecast, candidates, choose, expected_cost, forecast, keep_best, marginal_losses, plan,
    plan_admission, remember, slot_count,
)


def brute_cost(fc: Forecast, positions) -> float:
    """E[d - max{p <= d}] by summing over every integer d: the definition, nothing clever."""
    ps = sorted(positions)
    total = 0.0
    for d in range(fc.length + 1):
        p = max((x for x in ps if x <= d), default=0)
        prob = fc.uniform / (fc.length + 1) + sum(w for x, w in fc.points if x == d)
        total += prob * (d - p)
    return total


@st.composite
def forecasts(draw, max_len: int = 60):
    length = draw(st.integers(1, max_len))
    xs = draw(st.lists(st.integers(0, length), max_size=5, unique=True))
    ws = draw(st.lists(st.integers(1, 9), min_size=len(xs), max_size=len(xs)))
    u = draw(st.integers(0, 9))
    total = sum(ws) + u or 1
    if not ws and not u:
        u, total = 1, 1
    return Forecast(length=length, points=tuple(sorted((x, w / total) for x, w in zip(xs, ws))),
                    uniform=u / total)


@settings(max_examples=300, deadline=None)
@given(forecasts(), st.lists(st.integers(-3, 70), max_size=6))
def test_expected_cost_is_the_definition(fc, positions):
    assert math.isclose(expected_cost(fc, positions), brute_cost(fc, [p for p in positions if p > 0]),
                        rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=300, deadline=None)
@given(forecasts(), st.data())
def test_the_dp_is_the_exact_optimum_over_every_subset(fc, data):
    pool = sorted(set(data.draw(st.lists(st.integers(1, fc.length), max_size=7))))
    have = [p for p in pool if data.draw(st.booleans())]
    make = [p for p in pool if p not in have]
    k = data.draw(st.integers(0, 5))
    price = data.draw(st.sampled_from([0.0, 0.5, 3.0]))
    got = choose(fc, have, make, k, price)
    best = math.inf
    for r in range(0, min(k, len(pool)) + 1):
        for sub in itertools.combinations(pool, r):
            best = min(best, brute_cost(fc, sub) + price * sum(1 for p in sub if p in make))
    assert math.isclose(got.objective, best, rel_tol=1e-9, abs_tol=1e-9)
    chosen = got.keep + got.make
    assert len(chosen) <= k and set(got.keep) <= set(have) and set(got.make) <= set(make)
    assert math.isclose(got.cost + price * len(got.make), got.objective, rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=200, deadline=None)
@given(forecasts(max_len=16), st.integers(0, 3))
def test_on_point_masses_the_candidates_lose_nothing_against_every_position(fc, k):
    fc = Forecast(length=fc.length, points=fc.points or ((fc.length, 1.0),), uniform=0.0)
    got = choose(fc, [], candidates(fc, 0, fc.length), k)
    best = min(brute_cost(fc, sub) for r in range(k + 1) for sub in itertools.combinations(range(1, fc.length + 1), r))
    assert math.isclose(got.objective, best, rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=200, deadline=None)
@given(forecasts(), st.data())
def test_a_larger_budget_never_raises_the_expected_re_prefill(fc, data):
    pool = sorted(set(data.draw(st.lists(st.integers(1, fc.length), max_size=8))))
    price = data.draw(st.sampled_from([0.0, 2.0]))
    objectives = [choose(fc, [], pool, k, price).objective for k in range(0, 7)]
    assert all(b <= a + 1e-9 for a, b in zip(objectives, objectives[1:]))
    costs = [choose(fc, [], pool, k).cost for k in range(0, 7)]
    assert all(b <= a + 1e-9 for a, b in zip(costs, costs[1:]))


@settings(max_examples=200, deadline=None)
@given(forecasts(), st.lists(st.integers(-2, 70), max_size=7))
def test_marginal_loss_is_the_cost_without_that_one(fc, positions):
    base = expected_cost(fc, positions)
    for i, loss in enumerate(marginal_losses(fc, positions)):
        without = expected_cost(fc, positions[:i] + positions[i + 1:])
        assert math.isclose(loss, without - base, rel_tol=1e-9, abs_tol=1e-9)


def test_with_nothing_known_it_places_the_end_and_even_spacing():
    fc = forecast([], 1001)
    assert fc.length == 1000 and fc.points == ((1000, 0.5),) and fc.uniform == 0.5
    made = plan(fc, [], 0, 1000, 4, align=1, creation_cost=0.0, grid=1000)
    assert made[-1] == 1000
    gaps = [b - a for a, b in zip([0, *made[:-1]], made[:-1])]
    assert max(gaps) - min(gaps) <= 1  # three evenly spaced below the end


def test_history_pulls_checkpoints_to_where_the_mind_diverges():
    hist = [Divergence(lcp=300 + i, end=1000) for i in range(-2, 3)]
    fc = forecast(hist, 1100)
    made = plan(fc, [], 0, 1099, 3, align=64)
    assert 1099 in made and any(280 <= p <= 300 for p in made)  # at or just under the cluster
    assert expected_cost(fc, made) < expected_cost(fc, [366, 732, 1099])  # beats even spacing


def test_the_forecast_reads_appends_end_anchored_and_start_anchored_divergences():
    hist = [Divergence(lcp=1000, end=1000),  # reached the old end: an append
            Divergence(lcp=940, end=1000),  # 60 before the old end: the same before the new one
            Divergence(lcp=200, end=1000)] * 2  # near the start: the same position
    # Each group agrees with itself (no spread seen): 2/3 of it stays exactly where it was.
    fc = forecast(hist, 2001, prior_append=0.0, prior_unknown=0.0, decay=1.0)
    heavy = sorted(fc.points, key=lambda p: -p[1])[:3]
    assert sorted(x for x, _ in heavy) == [200, 2000 - 59, 2000]
    assert all(w >= 2 / 3 * 1 / 3 - 1e-9 for _, w in heavy)
    assert fc.uniform == 0.0 and math.isclose(sum(w for _, w in fc.points), 1.0)
    newer = forecast([Divergence(10, 100), Divergence(20, 100)], 101, prior_append=0.0, prior_unknown=0.0)
    assert newer.points[0][0] < 10 and newer.points[-1][0] > 20  # spread: smoothed, with tails
    body = dict(newer.points)
    assert body[20] > body[10]  # newer weighs more


def test_a_lone_divergence_is_smoothed_and_the_tails_hold_mass_beyond_what_was_seen():
    fc = forecast([Divergence(11_000 + 500 * (i % 3), 38_000) for i in range(9)], 38_001,
                  prior_append=0.0, prior_unknown=0.0)
    below = sum(w for x, w in fc.points if x < 11_000)
    assert 0.05 < below < 0.3  # about 1/(n + 1) below the lowest seen, plus the kernel's share
    lone = forecast([Divergence(5000, 38_000)], 38_001, prior_append=0.0, prior_unknown=0.0)
    assert len(lone.points) == 9 and math.isclose(sum(w for _, w in lone.points), 1.0)
    assert max(lone.points, key=lambda p: p[1])[0] == 5000  # half of it stays where it was seen


def test_history_is_bounded_and_oldest_first():
    h: list[Divergence] = []
    for i in range(20):
        h = remember(h, Divergence(i, 100), bound=16)
    assert len(h) == 16 and h[0].lcp == 4 and h[-1].lcp == 19


def test_plan_keeps_what_survives_the_cut_and_makes_only_new_ones_past_the_resume_point():
    fc = forecast([Divergence(500, 900)], 1000)
    made = plan(fc, [500], 600, 999, 2)
    assert made == [999]  # 500 (kept, free) and the end: two, the count
    assert all(p > 600 for p in plan(fc, [], 600, 999, 5))
    assert plan(fc, [], 999, 999, 5) == []  # nothing left to decode
    assert plan(fc, [], 0, 999, 0) == []


def test_creation_cost_keeps_the_plan_from_cutting_the_prompt_for_nothing():
    fc = Forecast(length=100, points=((100, 1.0),), uniform=0.0)
    assert plan(fc, [], 0, 100, 8, creation_cost=4.0) == [100]


def test_grid_candidates_sit_on_chunk_boundaries():
    fc = forecast([], 5000)
    cands = candidates(fc, 100, 4999, align=256, grid=8)
    assert cands[-1] == 4999
    assert all((p - 100) % 256 == 0 for p in cands[:-1]) and len(cands) <= 10
    short = candidates(fc, 0, 1499, align=512, grid=48)  # too short for 48 chunks: finer than one
    assert len(short) >= 40 and short[1] - short[0] < 512


def test_a_page_keeps_the_best_subset():
    fc = forecast([Divergence(300, 1000)] * 3, 1000)
    positions = [100, 200, 290, 300, 700, 999]
    for k in (1, 2, 3):
        idx = keep_best(fc, positions, k)
        best = min(expected_cost(fc, list(c)) for c in itertools.combinations(positions, k))
        assert len(idx) == k and math.isclose(expected_cost(fc, [positions[i] for i in idx]), best)
    below, end = [positions[i] for i in keep_best(fc, positions, 2)]
    assert end == 999 and below in (290, 300)  # at or just under where it repeats, and the end
    assert keep_best(fc, positions, 10) == list(range(6))


def test_slot_count_is_the_share_under_the_cap():
    assert slot_count(100, 30, 16) == 3 and slot_count(100, 30, 2) == 2
    assert slot_count(100, 0, 5) == 5 and slot_count(10, 30, 5) == 0


# ---- the budget ---------------------------------------------------------------------------

MB = 1_000_000


def metas(*ps, size=MB):
    return [CheckpointSize(pos=p, n_bytes=size) for p in ps]


def exact_at(pos: int, length: int = 999) -> Forecast:
    """A mind known to diverge exactly at pos or append, or anywhere now and then."""
    return Forecast(length=length, points=((pos, 0.6), (length, 0.2)), uniform=0.2)


def test_admission_evicts_the_least_valuable_per_byte_across_slots():
    fcs = {0: exact_at(300), 1: exact_at(700)}
    hold = {0: metas(150, 300, 999), 1: metas(100, 500, 999, size=2 * MB)}
    raw = {(k, c.pos): loss for k, v in hold.items() for c, loss in zip(v, marginal_losses(fcs[k], [c.pos for c in v]))}
    assert min(raw, key=raw.get) == (0, 150)  # the least loss in tokens...
    assert raw[(1, 100)] / 2 < raw[(0, 150)]  # ...but slot 1's 100 loses less per byte
    plan_ = plan_admission(hold, fcs, 9 * MB, 9 * MB, 1, CheckpointSize(pos=700, n_bytes=MB))
    assert not plan_.skipped and plan_.freed_bytes == 2 * MB
    gone = apply_evictions({k: list(v) for k, v in hold.items()}, plan_)
    assert [(k, c.pos) for k, c in gone] == [(1, 100)]


def test_admission_skips_a_checkpoint_worth_less_than_what_it_would_evict():
    fcs = {0: exact_at(300)}
    hold = {0: metas(300, 999)}
    p = plan_admission(hold, fcs, 2 * MB, 2 * MB, 0, CheckpointSize(pos=900, n_bytes=MB))
    assert p.skipped and p.evictions == []
    assert plan_admission(hold, fcs, 0, MB // 2, 0, CheckpointSize(pos=10, n_bytes=MB)).skipped  # > budget


def test_the_count_cap_only_competes_within_the_holder():
    fcs = {0: forecast([], 1000), 1: forecast([], 1000)}
    hold = {0: metas(10, 20), 1: metas(500, 999)}
    p = plan_admission(hold, fcs, 0, 100 * MB, 0, CheckpointSize(pos=700, n_bytes=MB), cap=2)
    assert not p.skipped and all(k == 0 for k, _ in p.evictions)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.data())
def test_admission_never_raises_the_total_expected_re_prefill(data):
    n_slots = data.draw(st.integers(1, 3))
    fcs, hold = {}, {}
    for s in range(n_slots):
        fcs[s] = data.draw(forecasts(max_len=200))
        ps = data.draw(st.lists(st.integers(1, 200), max_size=5))
        hold[s] = [CheckpointSize(pos=p, n_bytes=data.draw(st.integers(1, 4)) * MB) for p in ps]
    used = sum(c.n_bytes for v in hold.values() for c in v)
    budget = data.draw(st.integers(0, used + 4 * MB))
    used_now = min(used, budget)
    who = data.draw(st.integers(0, n_slots - 1))
    new = CheckpointSize(pos=data.draw(st.integers(1, 200)), n_bytes=data.draw(st.integers(1, 4)) * MB)
    cap = data.draw(st.none() | st.integers(1, 6))
    p = plan_admission(hold, fcs, used_now, budget, who, new, cap=cap)

    def total(lists):
        return sum(expected_cost(fcs[k], [c.pos for c in v]) for k, v in lists.items())

    if p.skipped:
        assert p.evictions == []
        return
    lists = {k: list(v) for k, v in hold.items()}
    before = total(lists)
    apply_evictions(lists, p)
    lists[who].append(new)
    assert total(lists) <= before + 1e-9
    assert used_now - p.freed_bytes + new.n_bytes <= budget
    if cap is not None and len(hold[who]) < cap:
        assert len(lists[who]) <= cap


@pytest.mark.parametrize("k", [1, 4, 12])
def test_a_forty_thousand_token_plan_is_cheap(k):
    """Cheap by construction, not by a clock: the DP is O(k m^2) over the candidates, and m
    is bounded by the forecast's points and the grid, never by the prompt's length."""
    fc = forecast([Divergence(11_000 + 300 * i, 38_000) for i in range(16)], 39_000)
    cands = candidates(fc, 0, 38_999, align=512)
    assert len(cands) <= len(fc.points) + GRID + 1 and len(fc.points) <= 16 * 10 + 2 * 6 * 2 + 2
    made = plan(fc, [], 0, 38_999, k, align=512)
    assert 0 < len(made) <= k


def test_with_a_tile_grid_candidates_are_the_schedulers_piece_boundaries():
    from tests.serving.test_scheduler_pieces import pieces, sched

    fc = Forecast.unknown(6000)
    ends = {start + length for start, length in pieces(sched(512, 64), 411, 6000 - 411)}
    grid = [p for p in candidates(fc, 411, 5999, align=512, grid=8, tile=64) if p != 5999]
    assert grid and all(p % 64 == 0 and p in ends for p in grid)  # a grid checkpoint adds no piece
    short = [p for p in candidates(fc, 411, 1499, align=512, grid=48, tile=64) if p != 1499]
    assert all(p % 64 == 0 for p in short) and len(short) >= 10  # finer than a chunk, still whole tiles
