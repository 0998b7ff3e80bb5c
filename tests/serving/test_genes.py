"""Genes: LoRA adapters page between device and host RAM; the scheduler groups by gene set."""

from __future__ import annotations

import anyio
import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import GeneInUse, GeneIsDefault, GeneNotFound
from actord.service.system import ActorSystem
from tests.waits import eventually, slot_in

pytestmark = pytest.mark.anyio

PROMPT = [1, 30, 41, 52, 63, 74, 85, 96, 107, 118]


@pytest.fixture(scope="session")
def loras(tiny_model, models_dir):
    from actord.testing.models import write_tiny_lora

    return [str(write_tiny_lora(models_dir / f"lora{i}.gguf", tiny_model, seed=10 + i)) for i in range(3)]


def cfg(model: str, **kw) -> Config:
    return Config(model=model, slots=kw.pop("slots", 3), ctx=kw.pop("ctx", 768), batch=kw.pop("batch", 64), **kw)


async def _gen(s, slot, genes, n=10, prompt=PROMPT):
    return await s.complete(prompt=prompt, n_predict=n, slot=slot, ignore_eos=True,
                            genes=[{"id": g, "scale": sc} for g, sc in genes])


async def test_page_out_then_in_gives_the_output_of_never_paging(tiny_model, loras):
    async with ActorSystem(cfg(tiny_model)) as s:
        g = (await s.gene_load(loras[0])).id
        base = await _gen(s, 0, [])
        with_gene = await _gen(s, 1, [(g, 1.0)])
        assert with_gene.tokens != base.tokens, "the adapter must change the output"
        out = await s.gene_page_out(g)
        assert out.resident is False and out.n_moved == out.n_bytes > 0
        back = await s.gene_page_in(g)
        assert back.resident is True
        await s.slot_erase(1)
        again = await _gen(s, 1, [(g, 1.0)])
        assert again.tokens == with_gene.tokens


async def test_request_applying_a_paged_out_gene_pages_it_in_and_counts_the_miss(tiny_model, loras):
    async with ActorSystem(cfg(tiny_model)) as s:
        g = (await s.gene_load(loras[0])).id
        ref = await _gen(s, 0, [(g, 1.0)])
        await s.gene_page_out(g)
        got = await _gen(s, 1, [(g, 1.0)])
        assert got.tokens == ref.tokens
        m = s.metrics.snapshot()
        assert m["lora_page_in_on_demand_total"] == 1 and m["lora_page_in_total"] == 1
        assert [x.resident for x in await s.gene_list()] == [True]


async def test_refusals_change_nothing_and_repeats_are_idempotent(tiny_model, loras):
    async with ActorSystem(cfg(tiny_model, gene=[loras[2]])) as s:
        default_id = (await s.gene_list())[0].id
        g = (await s.gene_load(loras[0])).id
        with pytest.raises(GeneNotFound):
            await s.gene_page_out(999)
        with pytest.raises(GeneIsDefault):
            await s.gene_page_out(default_id)
        with pytest.raises(GeneIsDefault):
            await s.gene_unload(default_id)
        results = {}

        async def long_turn():
            results["r"] = await _gen(s, 0, [(g, 1.0)], n=60)

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_turn)
            await eventually(lambda: slot_in(s, 0, "processing"), "slot 0 runs the long turn", every=0.001)
            with pytest.raises(GeneInUse):
                await s.gene_page_out(g)
            with pytest.raises(GeneInUse):
                await s.gene_unload(g)
        assert len(results["r"].tokens) == 60
        assert all(x.resident for x in await s.gene_list())
        first = await s.gene_page_out(g)
        second = await s.gene_page_out(g)
        assert first.n_moved > 0 and second.n_moved == 0 and not second.resident
        assert (await s.gene_page_in(g)).n_moved > 0 and (await s.gene_page_in(g)).n_moved == 0


async def test_unloading_a_paged_out_gene_frees_its_host_copy(tiny_model, loras):
    async with ActorSystem(cfg(tiny_model)) as s:
        g = await s.gene_load(loras[0])
        m = s.metrics.snapshot()
        assert m["lora_device_bytes"] == g.n_bytes and m["lora_host_bytes"] == g.n_bytes
        await s.gene_page_out(g.id)
        assert s.metrics.snapshot()["lora_device_bytes"] == 0
        await s.gene_unload(g.id)
        m = s.metrics.snapshot()
        assert m["lora_device_bytes"] == 0 and m["lora_host_bytes"] == 0
        assert await s.gene_list() == []
        with pytest.raises(GeneNotFound):
            await _gen(s, 0, [(g.id, 1.0)])


async def test_different_gene_sets_never_share_a_step_and_match_solo_output(tiny_model, loras):
    async with ActorSystem(cfg(tiny_model)) as s:
        a = (await s.gene_load(loras[0])).id
        b = (await s.gene_load(loras[1])).id
        sets = {0: [(a, 1.0)], 1: [(b, 1.0)], 2: [(a, 0.5)]}
        together = {}

        async def run(slot):
            together[slot] = await _gen(s, slot, sets[slot], n=12)

        async with anyio.create_task_group() as tg:
            for slot in sets:
                tg.start_soon(run, slot)
        records = await s.step_records()
        key = {slot: tuple(sorted(v)) for slot, v in sets.items()}
        for r in records:
            assert len({key[q] for q in r.seqs}) == 1, f"step {r.step} mixed gene sets"
            assert all(r.genes == key[q] for q in r.seqs)
        # Fair rotation: every group was served before any group had all its steps.
        first_step = {g: min(r.step for r in records if r.genes == g) for g in key.values()}
        last_step = {g: max(r.step for r in records if r.genes == g) for g in key.values()}
        assert max(first_step.values()) < min(last_step.values())
        for slot in sets:
            await s.slot_erase(slot)
            alone = await _gen(s, slot, sets[slot], n=12)
            assert alone.tokens == together[slot].tokens
