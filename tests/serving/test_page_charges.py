"""The page store's charge always equals the sum of live pages, under any sequence of moves."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actord.serving.kernel import Dispatcher
from actord.serving.page_store import Page, PageStore
from actord.vocabulary.errors import PageNotFound, PageRamExceeded
from actord.vocabulary.metrics import Metrics

NAMES = st.sampled_from(["a", "b", "c"])
CEILING = 1000


# Named predicates, not lambdas: hypothesis describes a lambda by parsing this file's
# source with ast, and that parse once raised SystemError in CI (a flaky replay).
def _taking(machine) -> bool:
    return bool(machine.taken)


def _spilling(machine) -> bool:
    return bool(machine.spilling)


class PageCharges(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = PageStore(Dispatcher(), CEILING, Metrics())
        self.taken: list[Page] = []  # pages a slot holds mid page_in
        self.spilling: list[Page] = []  # pages an in-flight spill holds

    @rule(name=NAMES, n=st.integers(1, 600))
    def page_out(self, name, n):
        old = self.store.names.get(name)
        sole = old is not None and self.store.gens[old].holders == 1
        before = self.store.charged
        try:
            r = self.store.admit(name, n)
        except PageRamExceeded:
            assert before - (self.store.gens[old].n_bytes if sole else 0) + n > CEILING
            assert self.store.charged == before  # a refusal changes nothing
            return
        self.store.commit(r, Page(gen=r, name=name, n_bytes=n, state=bytearray(), tokens=[7] * (n % 5)))

    @rule(name=NAMES, n=st.integers(1, 600))
    def failed_copy(self, name, n):
        before = self.store.charged
        try:
            r = self.store.admit(name, n)
        except PageRamExceeded:
            return
        self.store.cancel(r)
        assert self.store.charged == before

    @rule(name=NAMES)
    def take(self, name):
        try:
            self.taken.append(self.store.take(name))
        except PageNotFound:
            pass

    @precondition(_taking)
    @rule(ok=st.booleans())
    def finish_page_in(self, ok):
        page = self.taken.pop(0)
        (self.store.release if ok else self.store.give_back)(page.gen)

    @rule(name=NAMES)
    def spill_begin(self, name):
        try:
            self.spilling.append(self.store.spill_begin(name))
        except PageNotFound:
            pass

    @precondition(_spilling)
    @rule(drop=st.booleans())
    def spill_end(self, drop):
        page = self.spilling.pop(0)
        self.store.spill_end(page.gen, drop)

    @rule(name=NAMES)
    def drop(self, name):
        try:
            self.store.drop(name)
        except PageNotFound:
            pass

    @invariant()
    def charge_is_the_sum_of_live_pages(self):
        held = {p.gen for p in self.taken} | {p.gen for p in self.spilling} | set(self.store.names.values())
        assert set(self.store.gens) == held
        assert self.store.charged == sum(g.n_bytes for g in self.store.gens.values())
        assert self.store.charged == self.store.live_bytes()

    @invariant()
    def the_index_says_what_the_store_names(self):
        """Placements read pages' sizes from the index (serving/kv_index.py), not the store."""
        for name in ("a", "b", "c"):
            gen = self.store.names.get(name)
            page = self.store.gens[gen].page if gen is not None else None
            assert self.store.index.page_tokens(name) == (len(page.tokens) if page is not None else None)

    @invariant()
    def never_over_the_ceiling_by_admission(self):
        assert self.store.charged <= CEILING


TestPageCharges = pytest.mark.slow(PageCharges.TestCase)  # 200 runs of 40 steps: seconds
TestPageCharges.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_page_held_by_a_spill_keeps_counting_after_drop():
    s = PageStore(Dispatcher(), CEILING, Metrics())
    r = s.admit("m", 300)
    s.commit(r, Page(gen=r, name="m", n_bytes=300, state=bytearray(), tokens=[]))
    page = s.spill_begin("m")
    s.drop("m")
    assert s.charged == 300 and s.names == {}
    s.spill_end(page.gen, drop=False)
    assert s.charged == 0


def test_replacement_while_a_spill_holds_the_old_page_charges_both():
    s = PageStore(Dispatcher(), CEILING, Metrics())
    r = s.admit("m", 400)
    s.commit(r, Page(gen=r, name="m", n_bytes=400, state=bytearray(), tokens=[]))
    page = s.spill_begin("m")
    try:
        s.admit("m", 700)  # the store is not the sole owner: the old 400 still counts
        raise AssertionError("admitted over the ceiling")
    except PageRamExceeded:
        pass
    r2 = s.admit("m", 500)
    s.commit(r2, Page(gen=r2, name="m", n_bytes=500, state=bytearray(), tokens=[]))
    assert s.charged == 900
    assert s.spill_end(page.gen, drop=True) is False  # a newer generation stays
    assert s.charged == 500 and s.names["m"] == r2
