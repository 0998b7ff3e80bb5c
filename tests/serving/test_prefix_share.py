"""A request starts from the longest prefix another slot's sequence holds, by cells.

Pins serving/prefix_share.py: what is shared is prefilled by nobody, the output is what a
prefill of the whole prompt gives, the scheduler charges the shared cells once and stops
when either sequence lets go, and nothing is shared where it would be another state (other
genes, recurrent memory, a sliding window already past the shared point)."""

from __future__ import annotations

import anyio
import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem
from tests.waits import eventually

pytestmark = pytest.mark.anyio

SYSTEM = [1] + [3 + (i * 37) % 500 for i in range(299)]


def own(k: int, n: int = 5) -> list[int]:
    return [7 + (k * 11 + i * 5) % 490 for i in range(n)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def loras(tiny_model, models_dir):
    from actord.testing.models import write_tiny_lora

    return [str(write_tiny_lora(models_dir / "share-lora.gguf", tiny_model, seed=21))]


def cfg(model: str, **kw) -> Config:
    return Config(model=model, **{"slots": 3, "ctx": 2048, "batch": 128, "threads": 1, **kw})


async def turns(model: str, sharing: bool, prompts: list[tuple[str | None, int | None, list[int]]], **kw):
    async with ActorSystem(cfg(model, prefix_sharing=sharing, **kw)) as s:
        out = []
        for mind, slot, prompt in prompts:
            r = await s.complete(prompt=prompt, n_predict=8, ignore_eos=True,
                                 **({"mind": mind} if mind else {}), **({"slot": slot} if slot is not None else {}))
            out.append((r.tokens, r.n_cached))
        return out


async def test_a_new_mind_prefills_only_what_follows_a_prefix_another_mind_holds(tiny_model):
    prompts = [("ada", None, SYSTEM + own(1)), ("bob", None, SYSTEM + own(2)), ("cy", None, SYSTEM + own(3))]
    on = await turns(tiny_model, True, prompts)
    off = await turns(tiny_model, False, prompts)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert [c for _, c in off] == [0, 0, 0]
    assert [c for _, c in on] == [0, len(SYSTEM), len(SYSTEM)]


async def test_an_unnamed_request_shares_and_the_mind_it_shares_with_keeps_her_turn(tiny_model):
    async with ActorSystem(cfg(tiny_model, slots=2)) as s:
        a = await s.complete(prompt=SYSTEM + own(1), n_predict=8, mind="ada", ignore_eos=True)
        u = await s.complete(prompt=SYSTEM + own(2), n_predict=8, ignore_eos=True)
        assert u.n_cached == len(SYSTEM) and u.slot != a.slot
        nxt = SYSTEM + own(1) + a.tokens + own(4)
        b = await s.complete(prompt=nxt, n_predict=4, mind="ada", ignore_eos=True)
        assert b.n_cached == len(SYSTEM) + 5 + 8 - 1  # her whole sequence, still hers


async def test_a_running_slot_shares_the_prefix_it_started_from(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        await s.complete(prompt=SYSTEM + own(1), n_predict=1, slot=0, ignore_eos=True)
        async with anyio.create_task_group() as tg:
            long = {}

            async def run_long():
                long["r"] = await s.complete(prompt=SYSTEM + own(1) + own(9, 3), n_predict=60, slot=0, ignore_eos=True)

            tg.start_soon(run_long)
            await eventually(lambda: s.slots[0].busy, "slot 0 runs the long request", every=0.001)
            r = await s.complete(prompt=SYSTEM + own(2), n_predict=8, slot=1, ignore_eos=True)
        assert r.n_cached == len(SYSTEM)
    off = await turns(tiny_model, False, [(None, 1, SYSTEM + own(2))])
    assert r.tokens == off[0][0]


async def test_shared_cells_are_charged_once_until_either_sequence_lets_go(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        await s.complete(prompt=SYSTEM + own(1), n_predict=4, slot=0, ignore_eos=True)
        await s.complete(prompt=SYSTEM + own(2), n_predict=4, slot=1, ignore_eos=True)
        core = s.scheduler.core
        held = core.held(0) + core.held(1)
        assert core.shared_cells() == len(SYSTEM)
        assert core.free_cells == s.scheduler.n_ctx - held + len(SYSTEM)
        assert core.shared_of(0) == core.shared_of(1) == len(SYSTEM) and core.shared_of(2) == 0
        await s.slot_erase(0)
        await eventually(lambda: core.shared_cells() == 0, "the erase's tell reaches the scheduler", every=0.01)
        assert core.shared_cells() == 0 and core.free_cells == s.scheduler.n_ctx - core.held(1)


async def test_a_cut_below_the_shared_point_ends_the_share(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        await s.complete(prompt=SYSTEM + own(1), n_predict=4, slot=0, ignore_eos=True)
        await s.complete(prompt=SYSTEM + own(2), n_predict=4, slot=1, ignore_eos=True)
        assert s.scheduler.core.shared_cells() == len(SYSTEM)
        # slot 0 goes on from 100 tokens in: its cells past 100 are new ones
        r = await s.complete(prompt=SYSTEM[:100] + own(5, 40), n_predict=4, slot=0, ignore_eos=True)
        assert r.n_cached == 100
        assert s.scheduler.core.shared_cells() == 0


async def test_no_share_under_other_genes(tiny_model, loras):
    async with ActorSystem(cfg(tiny_model)) as s:
        g = (await s.gene_load(loras[0])).id
        await s.complete(prompt=SYSTEM + own(1), n_predict=4, slot=0, ignore_eos=True, genes=[{"id": g, "scale": 1.0}])
        r = await s.complete(prompt=SYSTEM + own(2), n_predict=4, slot=1, ignore_eos=True)
        assert r.n_cached == 0
        r = await s.complete(prompt=SYSTEM + own(3), n_predict=4, slot=2, ignore_eos=True,
                             genes=[{"id": g, "scale": 1.0}])
        assert r.n_cached == len(SYSTEM)


async def test_recurrent_memory_shares_no_cells_and_answers_the_same(tiny_recurrent_model):
    async with ActorSystem(cfg(tiny_recurrent_model, ctx=512)) as s:
        await s.complete(prompt=SYSTEM[:120] + own(1), n_predict=8, slot=0, ignore_eos=True)
        r = await s.complete(prompt=SYSTEM[:120] + own(2), n_predict=8, slot=1, ignore_eos=True)
        assert not s.scheduler.core.links  # (a checkpoint of slot 0's may start it: below)
    off = await turns(tiny_recurrent_model, False, [(None, 1, SYSTEM[:120] + own(2))], ctx=512)
    assert r.tokens == off[0][0]


async def test_a_windowed_cache_shares_no_cells_and_a_full_one_only_what_its_window_still_holds(tiny_swa_model):
    prompts = [(None, 0, SYSTEM + own(1, 40)), (None, 1, SYSTEM + own(2))]
    # Windowed (swa_full off): libllama could not reuse shared cells the window has passed,
    # so the window's cells are never shared: at most a checkpoint starts it (its full
    # attention layers' cells below the checkpoint are shared, the window's are its own).
    async with ActorSystem(cfg(tiny_swa_model, swa_full="off", ctx=1024, batch=64)) as s:
        windowed = [await s.complete(prompt=p, n_predict=8, slot=k, ignore_eos=True) for _, k, p in prompts]
        assert windowed[1].n_cached < len(SYSTEM) or windowed[1].resumed_from_checkpoint
    off = await turns(tiny_swa_model, False, prompts, swa_full="off", ctx=1024, batch=64)
    assert [r.tokens for r in windowed] == [t for t, _ in off]
    # Full: shared by cells, unless the source came back by a page-in (a state is written
    # without the cells its window has passed: libllama 0.3.36), then from a checkpoint.
    full = await turns(tiny_swa_model, True, prompts, swa_full="on", ctx=1024)
    assert [t for t, _ in full] == [t for t, _ in off] and full[1][1] == len(SYSTEM)
    async with ActorSystem(cfg(tiny_swa_model, swa_full="on", ctx=1024)) as s:
        await s.complete(prompt=prompts[0][2], n_predict=8, slot=0, ignore_eos=True)
        await s.page_out(0, "a")
        await s.page_in(0, "a")
        r = await s.complete(prompt=prompts[1][2], n_predict=8, slot=1, ignore_eos=True)
        assert r.n_cached < len(SYSTEM)
    assert r.tokens == off[1][0]


@pytest.mark.parametrize("fixture", ["tiny_recurrent_model", "tiny_hybrid_model", "tiny_swa_model"])
async def test_memory_that_cannot_share_cells_starts_a_new_mind_from_the_checkpoint_at_the_shared_point(
        fixture, request):
    model = request.getfixturevalue(fixture)
    prefix = SYSTEM[:200]
    # The third mind finds the second's checkpoint where the two parted; all three answer
    # as they do with sharing off.
    prompts = [("ada", None, prefix + own(1)), ("bob", None, prefix + own(2)), ("cy", None, prefix + own(3))]
    kw = {"ctx": 1024, "slots": 2, "swa_full": "off", "ctx_checkpoints_bytes": 10**8}
    on = await turns(model, True, prompts, **kw)
    off = await turns(model, False, prompts, **kw)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert on[2][1] == len(prefix) and off[2][1] == 0


async def test_a_new_mind_starts_from_a_base_in_page_ram_when_no_slot_holds_the_prefix(tiny_model):
    alone = [1] + [5 + (i * 29) % 490 for i in range(120)]
    minds = [("a", SYSTEM + own(1)), ("b", SYSTEM + own(2)), ("c", SYSTEM + own(3)), ("z", alone), ("d", SYSTEM + own(4))]

    async def run(sharing: bool):
        async with ActorSystem(cfg(tiny_model, slots=1, prefix_sharing=sharing)) as s:
            out = [await s.complete(prompt=p, n_predict=8, mind=m, ignore_eos=True) for m, p in minds]
            return out, s.metrics.snapshot()

    on, metrics = await run(True)
    off, _ = await run(False)
    assert [r.tokens for r in on] == [r.tokens for r in off]
    # d's slot held z (nothing of the prefix); the base (made when c's page stood on it) did
    assert on[4].n_cached == len(SYSTEM) and off[4].n_cached == 0


async def _together(model: str, sharing: bool) -> list:
    async with ActorSystem(cfg(model, prefix_sharing=sharing)) as s:
        out: dict[str, object] = {}

        async def one(mind: str, k: int) -> None:
            out[mind] = await s.complete(prompt=SYSTEM + own(k), n_predict=8, mind=mind, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            for k, mind in enumerate(("ada", "bob", "cy")):
                tg.start_soon(one, mind, k)
        return [out[m] for m in ("ada", "bob", "cy")]


async def test_minds_that_arrive_together_with_one_prefix_prefill_it_once(tiny_model):
    on = await _together(tiny_model, True)
    off = await _together(tiny_model, False)
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert sum(r.n_prompt_processed for r in off) == 3 * len(SYSTEM + own(0))
    assert sum(r.n_prompt_processed for r in on) == len(SYSTEM) + 3 * len(own(0))
    assert sorted(r.n_cached for r in on) == [0, len(SYSTEM), len(SYSTEM)]
