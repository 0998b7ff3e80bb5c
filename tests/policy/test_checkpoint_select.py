"""Checkpoint selection and budget eviction (actord.policy.checkpoint_select).

Why: the original server lost every checkpoint under an early divergence (it kept the
newest and evicted oldest-first), so a paged mind re-prefilled its whole prompt. These
properties pin the rule that fixes it: within the same count, a list keeps its head, the
newest ones at or below the last raw lcp, and its newest; the budget's victim is the one
that selection gives up first; with no divergence known nothing changes from before.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from actord.policy.checkpoint_records import CheckpointSize
from actord.policy.checkpoint_select import (
    Admission, apply_evictions, plan_budget_admission, select, select_indices,
    under_break_indices, victim,
)

MB = 1_000_000


@st.composite
def ckpt_lists(draw, min_size: int = 0, max_size: int = 24):
    """Oldest-first lists with ascending positions (how a slot builds them), sizes 1-9 MB."""
    gaps = draw(st.lists(st.integers(1, 4096), min_size=min_size, max_size=max_size))
    pos, out = 0, []
    for g in gaps:
        pos += g
        out.append(CheckpointSize(pos=pos, n_bytes=draw(st.integers(1, 9)) * MB))
    return out


@st.composite
def cases(draw, min_size: int = 0):
    cps = draw(ckpt_lists(min_size=min_size))
    keep = draw(st.integers(0, 12))
    top = cps[-1].pos + 10 if cps else 10
    raw_lcp = draw(st.none() | st.integers(-5, top))
    return cps, keep, raw_lcp


def newest_under(cps, keep, raw_lcp):
    """Reference: the min(2, keep // 2) newest with pos <= raw_lcp, by brute force."""
    if raw_lcp is None:
        return set()
    below = [i for i, c in enumerate(cps) if c.pos <= raw_lcp]
    return set(below[len(below) - min(2, keep // 2):]) if keep // 2 else set()


@pytest.mark.slow
@settings(max_examples=400)
@given(cases())
def test_never_more_than_one_plus_keep_and_an_ordered_subset(case):
    cps, keep, raw_lcp = case
    idx = select_indices(cps, keep, raw_lcp)
    assert len(idx) <= 1 + keep
    assert len(idx) == min(len(cps), 1 + keep)  # never keeps fewer than it may
    assert idx == sorted(set(idx)) and all(0 <= i < len(cps) for i in idx)
    assert select(cps, keep, raw_lcp) == [cps[i] for i in idx]


@pytest.mark.slow
@settings(max_examples=400)
@given(cases(min_size=1))
def test_head_and_newest_always_kept(case):
    cps, keep, raw_lcp = case
    idx = select_indices(cps, keep, raw_lcp)
    assert 0 in idx
    if keep >= 1:
        assert len(cps) - 1 in idx


@pytest.mark.slow
@settings(max_examples=400)
@given(cases())
def test_newest_under_the_break_are_kept(case):
    cps, keep, raw_lcp = case
    idx = set(select_indices(cps, keep, raw_lcp))
    under = newest_under(cps, keep, raw_lcp)
    assert set(under_break_indices(cps, keep, raw_lcp)) == under
    assert under <= idx


@settings(max_examples=300)
@given(ckpt_lists(), st.integers(0, 12))
def test_unknown_raw_lcp_is_head_plus_newest_keep(cps, keep):
    n = len(cps)
    want = list(range(n)) if n <= 1 + keep else [0] + list(range(n - keep, n))
    assert select_indices(cps, keep, None) == want


def test_keep_zero_keeps_only_the_head():
    cps = [CheckpointSize(p, 1) for p in (10, 20, 30)]
    assert select(cps, 0, 25) == [cps[0]]
    assert select(cps, 0, None) == [cps[0]]
    assert select([], 0, 5) == []


def test_early_divergence_keeps_the_two_under_it():
    cps = [CheckpointSize(p, 1) for p in range(2048, 40000, 2048)]  # 19 of them
    kept = [c.pos for c in select(cps, 8, 11_000)]
    assert kept == [2048, 8192, 10240, 28672, 30720, 32768, 34816, 36864, 38912]
    assert [c.pos for c in select(cps, 8, None)][:2] == [2048, 24576]


@pytest.mark.slow
@settings(max_examples=400)
@given(cases())
def test_victim_is_what_select_all_but_one_leaves_out(case):
    cps, _, raw_lcp = case
    n = len(cps)
    v = victim(cps, raw_lcp)
    if n < 3:
        assert v is None
        return
    assert v is not None
    kept = select_indices(cps, n - 2, raw_lcp)
    assert set(range(n)) - set(kept) == {v}
    assert v not in (0, n - 1)
    assert v not in newest_under(cps, n - 2, raw_lcp)
    if raw_lcp is None:
        assert v == 1  # the old rule: oldest after the head


def held(lists):
    return sum(c.n_bytes for v in lists.values() for c in v)


def test_fuller_list_evicts_until_the_new_one_fits_and_keeps_its_under_break():
    a = [CheckpointSize(p, 8 * MB) for p in range(2048, 36000, 2048)]  # 17 -> 136 MB
    b = [CheckpointSize(p, 8 * MB) for p in range(2048, 12000, 2048)]  # 5 -> 40 MB
    lists = {"a": list(a), "b": list(b)}
    lcps = {"a": 11_000, "b": None}
    used = held(lists)
    budget = used  # full: the new one needs 8 MB freed
    plan = plan_budget_admission(lists, lcps, used, budget, 3 * 8 * MB)
    assert not plan.skipped and plan.freed_bytes == 3 * 8 * MB
    assert [k for k, _ in plan.evictions] == ["a", "a", "a"]
    gone = apply_evictions(lists, plan)
    assert [c.pos for _, c in gone] == [4096, 6144, 12288]  # oldest outside head/break/newest
    kept = [c.pos for c in lists["a"]]
    assert {2048, 8192, 10240, 34816} <= set(kept)
    assert lists["b"] == b
    assert held(lists) + 3 * 8 * MB <= budget


def test_eviction_alternates_by_bytes_with_ties_to_the_first_holder():
    lists = {s: [CheckpointSize(p, MB) for p in (1, 2, 3, 4)] for s in ("x", "y")}
    plan = plan_budget_admission(lists, {}, 8 * MB, 8 * MB, 2 * MB)
    assert plan.evictions == [("x", 1), ("y", 1)]


def test_over_budget_checkpoint_drops_nothing_and_is_skipped():
    lists = {"a": [CheckpointSize(p, MB) for p in range(1, 9)]}
    plan = plan_budget_admission(lists, {"a": 5}, 8 * MB, 10 * MB, 11 * MB)
    assert plan == Admission(skipped=True)
    assert apply_evictions(lists, plan) == [] and len(lists["a"]) == 8


def test_no_victim_left_skips_without_evicting():
    lists = {"a": [CheckpointSize(1, 4 * MB), CheckpointSize(2, 4 * MB)],
             "b": [CheckpointSize(1, 4 * MB), CheckpointSize(2, 4 * MB), CheckpointSize(3, 4 * MB)]}
    plan = plan_budget_admission(lists, {}, 20 * MB, 20 * MB, 8 * MB)
    assert plan.skipped and plan.evictions == []


@settings(max_examples=200)
@given(st.lists(ckpt_lists(max_size=10), min_size=1, max_size=4),
       st.lists(st.none() | st.integers(0, 40000), min_size=4, max_size=4),
       st.integers(0, 120), st.integers(0, 12))
def test_plan_fits_or_skips_and_only_takes_victims(lists_, lcps_, budget_mb, new_mb):
    lists = {i: list(v) for i, v in enumerate(lists_)}
    lcps = dict(enumerate(lcps_))
    used, budget, new = held(lists), budget_mb * MB, new_mb * MB
    plan = plan_budget_admission(lists, lcps, used, budget, new)
    if plan.skipped:
        assert plan.evictions == []
        return
    for key, idx in plan.evictions:
        assert idx == victim(lists[key], lcps[key])
        offering = [k for k in lists if victim(lists[k], lcps[k]) is not None]
        fullest = max(sum(c.n_bytes for c in lists[k]) for k in offering)
        assert sum(c.n_bytes for c in lists[key]) == fullest
        assert key == next(k for k in offering if sum(c.n_bytes for c in lists[k]) == fullest)
        lists[key].pop(idx)
    assert held(lists) + new <= budget
    assert plan.freed_bytes == used - held(lists)
