"""Residency policy: LRU-2 temperature, genes before slots, pinned and in-use never chosen."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from actord.policy.residency import GeneView, SlotView, device_used, heat, plan_room, record_use


def test_a_gene_used_once_recently_is_colder_than_one_used_twice():
    once_recent = record_use((), 100)
    twice_older = record_use(record_use((), 10), 20)
    assert heat(once_recent) < heat(twice_older)
    genes = [GeneView(id=1, n_bytes=10, resident=True, uses=once_recent),
             GeneView(id=2, n_bytes=10, resident=True, uses=twice_older)]
    plan = plan_room(10, 20, genes, [], protected_genes=set(), pinned=set())
    assert plan.genes == [1] and plan.fits


def test_cold_unpinned_genes_go_before_any_slot():
    genes = [GeneView(id=1, n_bytes=30, resident=True, uses=(1, 2)),
             GeneView(id=2, n_bytes=30, resident=True, uses=(3, 4))]
    slots = [SlotView(id=0, n_bytes=40, processing=False, last_use=0)]
    plan = plan_room(50, 100, genes, slots, protected_genes=set(), pinned=set())
    assert plan.genes == [1, 2] and plan.slots == [] and plan.fits
    plan = plan_room(90, 100, genes, slots, protected_genes=set(), pinned=set())
    assert plan.genes == [1, 2] and plan.slots == [0] and plan.fits


def test_pinned_and_in_use_genes_and_processing_slots_are_never_chosen():
    genes = [GeneView(id=1, n_bytes=30, resident=True), GeneView(id=2, n_bytes=30, resident=True)]
    slots = [SlotView(id=0, n_bytes=40, processing=True, last_use=0)]
    plan = plan_room(50, 100, genes, slots, protected_genes={1}, pinned={2})
    assert plan.genes == [] and plan.slots == [] and not plan.fits


@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    slot_sizes=st.lists(st.tuples(st.integers(0, 80), st.booleans()), max_size=4),
    pinned=st.sets(st.integers(0, 7)),
    need=st.integers(0, 200),
    budget=st.integers(1, 400),
)
def test_a_plan_that_fits_leaves_room_and_never_touches_protected(sizes, slot_sizes, pinned, need, budget):
    genes = [GeneView(id=i, n_bytes=n, resident=True, uses=(i,)) for i, n in enumerate(sizes)]
    slots = [SlotView(id=i, n_bytes=n, processing=p, last_use=i) for i, (n, p) in enumerate(slot_sizes)]
    plan = plan_room(need, budget, genes, slots, protected_genes=set(), pinned=pinned)
    assert not set(plan.genes) & pinned
    assert not any(slots[i].processing for i in plan.slots)
    if plan.slots:  # slots are only touched once every evictable gene is gone
        assert set(plan.genes) == {g.id for g in genes if g.id not in pinned}
    freed = sum(sizes[i] for i in plan.genes) + sum(slots[i].n_bytes for i in plan.slots)
    free = budget - device_used(genes, slots) + freed
    assert plan.fits == (free >= need)
