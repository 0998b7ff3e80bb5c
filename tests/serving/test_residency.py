"""GeneResidency under a device budget: genes before slots, pinning, LRU-2, reconcile."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from actord.vocabulary.config import Config
from actord.vocabulary.errors import DeviceBudgetExceeded, GeneInUse
from actord.service.system import ActorSystem
from tests.waits import eventually

PROMPT = [1, 30, 41, 52, 63, 74, 85, 96]


@pytest.fixture(scope="session")
def loras(tiny_model, models_dir):
    from actord.testing.models import write_tiny_lora

    return [str(write_tiny_lora(models_dir / f"res-lora{i}.gguf", tiny_model, seed=20 + i)) for i in range(4)]


def cfg(model: str, budget: int) -> Config:
    return Config(model=model, slots=3, ctx=768, batch=64, device_bytes=budget)


async def _gen(s, slot, gids, n=4):
    return await s.complete(prompt=PROMPT, n_predict=n, slot=slot, ignore_eos=True,
                            genes=[{"id": g, "scale": 1.0} for g in gids])


def _resident(genes):
    return {g.id for g in genes if g.resident}


@pytest.mark.anyio
async def test_cold_unpinned_genes_page_out_before_any_slot_and_pinned_ones_stay(tiny_model, loras):
    probe = 0
    async with ActorSystem(cfg(tiny_model, 10**9)) as s:
        probe = (await s.gene_load(loras[0])).n_bytes
    budget = 2 * probe + 20_000  # two genes and the slots' small states, not three genes
    async with ActorSystem(cfg(tiny_model, budget)) as s:
        a = (await s.gene_load(loras[0])).id
        b = (await s.gene_load(loras[1])).id
        await _gen(s, 0, [a])  # a is pinned: slot 0's current gene set
        await _gen(s, 1, [])  # a slot with state, no genes
        await _gen(s, 1, [])
        # b has never been used: coldest. Loading c must page b out, not a, not slot 1.
        c = (await s.gene_load(loras[2])).id
        assert _resident(await s.gene_list()) == {a, c}
        assert (await s.slot_list())[1].n_tokens > 0, "a slot was evicted before a cold gene"
        # b requested: a is pinned, c is cold and unpinned -> c goes.
        await _gen(s, 2, [b])
        assert _resident(await s.gene_list()) == {a, b}
        m = s.metrics.snapshot()
        assert m["lora_page_in_on_demand_total"] == 1 and m["lora_page_out_total"] == 2
        assert s.residency.device_bytes() <= budget


@pytest.mark.anyio
async def test_lru2_pages_out_the_gene_used_once_recently_before_one_used_twice(tiny_model, loras):
    async with ActorSystem(cfg(tiny_model, 10**9)) as s:
        probe = (await s.gene_load(loras[0])).n_bytes
    async with ActorSystem(cfg(tiny_model, 2 * probe + 20_000)) as s:
        twice = (await s.gene_load(loras[0])).id
        once = (await s.gene_load(loras[1])).id
        await _gen(s, 0, [twice])
        await _gen(s, 0, [twice])
        await _gen(s, 0, [once])  # most recent single use
        await _gen(s, 0, [])  # nobody pins either now
        await s.gene_load(loras[2])
        assert _resident(await s.gene_list()) == {twice, 3}


@pytest.mark.anyio
async def test_after_a_turn_pinned_host_genes_are_back_on_device(tiny_model, loras):
    async with ActorSystem(cfg(tiny_model, 10**9)) as s:
        a = (await s.gene_load(loras[0])).id
        await _gen(s, 0, [a])  # slot 0's current set pins a
        await s.gene_page_out(a)
        assert _resident(await s.gene_list()) == set()
        await _gen(s, 1, [])  # any turn ends with a coalesced reconcile
        async def back() -> bool:  # a coalesced reconcile: it comes after the answer
            return _resident(await s.gene_list()) == {a}

        await eventually(back, "the pinned gene is back on the device", every=0.005)
        assert s.metrics.snapshot()["lora_page_in_on_demand_total"] == 0


class ResidencyMachine(RuleBasedStateMachine):
    """Random turns and gene moves under a tight budget: the budget holds, no decode uses a
    freed adapter (the engine refuses such a step, which would fail the request)."""

    model: str = ""
    loras: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.portal_cm = start_blocking_portal("asyncio")
        self.portal = self.portal_cm.__enter__()
        self.system = ActorSystem(cfg(self.model, 10**9))
        self.system_cm = self.portal.wrap_async_context_manager(self.system)
        self.system_cm.__enter__()
        self.ids = [self.portal.call(self.system.gene_load, p).id for p in self.loras[:3]]
        n = self.portal.call(self.system.gene_list)[0].n_bytes
        self.budget = 2 * n + 15_000
        self.system.residency.budget = self.budget
        self.portal.call(self._fit_budget)

    async def _fit_budget(self) -> None:
        for g in self.ids[2:]:
            await self.system.gene_page_out(g)

    def teardown(self) -> None:
        self.system_cm.__exit__(None, None, None)
        self.portal_cm.__exit__(None, None, None)

    @rule(slot=st.integers(0, 2), gene=st.sampled_from([None, 0, 1, 2]))
    def turn(self, slot, gene):
        gids = [] if gene is None else [self.ids[gene]]
        try:
            r = self.portal.call(_gen, self.system, slot, gids)
            assert len(r.tokens) == 4
        except DeviceBudgetExceeded:
            pass

    @rule(gene=st.sampled_from([0, 1, 2]), out=st.booleans())
    def move(self, gene, out):
        try:
            fn = self.system.gene_page_out if out else self.system.gene_page_in
            self.portal.call(fn, self.ids[gene])
        except (DeviceBudgetExceeded, GeneInUse):
            pass

    @rule(slot=st.integers(0, 2))
    def erase(self, slot):
        self.portal.call(self.system.slot_erase, slot)

    @invariant()
    def budget_holds(self):
        assert self.system.residency.device_bytes() <= self.budget

    @invariant()
    def mirror_matches_the_engine(self):
        engine = {g.id: g.resident for g in self.portal.call(self.system.gene_list)}
        assert engine == {g.id: g.resident for g in self.system.residency.genes.values()}


def test_residency_state_machine(tiny_model, loras):
    ResidencyMachine.model = tiny_model
    ResidencyMachine.loras = loras
    run = ResidencyMachine.TestCase
    run.settings = settings(max_examples=15, stateful_step_count=12, deadline=None)
    run().runTest()
