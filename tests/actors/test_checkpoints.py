"""Context checkpoints on a sliding-window model whose memory cannot be cut back."""

from __future__ import annotations

import pytest

from actord.config import Config
from actord.system import ActorSystem

pytestmark = pytest.mark.anyio

LONG = [1] + [3 + (i * 37) % 500 for i in range(420)]  # well past the 32-token window


def cfg(model: str, tmp_path, **kw) -> Config:
    base = dict(model=model, slots=2, ctx=2048, batch=32, checkpoint_every=64, ctx_checkpoints=4,
                ctx_checkpoints_bytes=10**8, page_dir=str(tmp_path))
    base.update(kw)
    return Config(**base)


async def _diverging_turn(s, slot):
    diverged = LONG[:150] + [7, 8, 9, 10, 11]
    return diverged, await s.complete(prompt=diverged, n_predict=8, slot=slot, ignore_eos=True)


async def test_early_divergence_resumes_from_a_checkpoint_below_it(tiny_swa_model, tmp_path):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path)) as s:
        assert s.props.needs_checkpoints and s.props.n_swa == 32
        await s.complete(prompt=LONG, n_predict=4, slot=0, ignore_eos=True)
        info = (await s.slot_list())[0]
        assert info.n_checkpoints >= 4
        diverged, r = await _diverging_turn(s, 0)
        assert r.resumed_from_checkpoint and r.n_cached == 128  # newest checkpoint <= raw lcp 150
        assert r.n_prompt_processed == len(diverged) - 128
        assert (await s.slot_list())[0].resume_raw_lcp == 150
        fresh = await s.complete(prompt=diverged, n_predict=8, slot=1, ignore_eos=True)
        assert fresh.n_cached == 0 and r.tokens == fresh.tokens
        assert s.metrics.snapshot()["ctx_checkpoint_restores_total"] == 1


async def test_without_a_usable_checkpoint_it_re_prefills_and_counts_it(tiny_swa_model, tmp_path):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints_bytes=0)) as s:
        await s.complete(prompt=LONG, n_predict=4, slot=0, ignore_eos=True)
        diverged, r = await _diverging_turn(s, 0)
        assert r.n_cached == 0 and r.n_prompt_processed == len(diverged)
        m = s.metrics.snapshot()
        assert m["full_reprefills_total"] == 1 and m["ctx_checkpoints_skipped_budget_total"] > 0


@pytest.mark.parametrize("move", ["page", "file"])
async def test_checkpoints_come_back_with_the_page_and_the_file(tiny_swa_model, tmp_path, move):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path)) as s:
        await s.complete(prompt=LONG, n_predict=4, slot=0, ignore_eos=True)
        # A request that diverged at 150 sets resume_raw_lcp: the page keeps the ones under it.
        await s.complete(prompt=LONG[:150] + [5], n_predict=1, slot=0, ignore_eos=True)
        await s.complete(prompt=LONG, n_predict=4, slot=0, ignore_eos=True)
        if move == "page":
            out = await s.page_out(0, "m")
            await s.page_in(1, "m")
        else:
            out = await s.slot_save(0, "m.page")
            await s.slot_erase(0)
            await s.slot_erase(1)
            await s.slot_restore(1, "m.page")
        assert out["n_checkpoints"] >= 2
        info = (await s.slot_list())[1]
        assert info.n_checkpoints == out["n_checkpoints"] and info.resume_raw_lcp is None
        diverged, r = await _diverging_turn(s, 1)
        assert r.resumed_from_checkpoint and r.n_cached <= 150 and r.n_prompt_processed < len(diverged)
        fresh = await s.complete(prompt=diverged, n_predict=8, slot=0, ignore_eos=True)
        assert r.tokens == fresh.tokens


async def test_resume_raw_lcp_is_reset_per_request_on_page_in_restore_and_erase(tiny_swa_model, tmp_path):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path)) as s:
        await s.complete(prompt=LONG[:100], n_predict=2, slot=0, ignore_eos=True)
        await s.complete(prompt=LONG[:40] + [9, 9], n_predict=2, slot=0, ignore_eos=True)
        assert (await s.slot_list())[0].resume_raw_lcp == 40
        await s.complete(prompt=[1, 2, 3], n_predict=2, slot=0, ignore_eos=True)
        assert (await s.slot_list())[0].resume_raw_lcp == 1  # a new request sets its own
        await s.slot_save(0, "x.page")
        await s.page_out(0, "x")
        await s.page_in(0, "x")
        assert (await s.slot_list())[0].resume_raw_lcp is None
        await s.complete(prompt=[1, 2, 3, 4], n_predict=1, slot=0, ignore_eos=True)
        await s.slot_restore(0, "x.page")
        assert (await s.slot_list())[0].resume_raw_lcp is None
        await s.complete(prompt=[1, 2, 3, 4], n_predict=1, slot=0, ignore_eos=True)
        await s.slot_erase(0)
        assert (await s.slot_list())[0].resume_raw_lcp is None


async def test_the_fuller_slot_gives_up_checkpoints_to_fit_the_budget(tiny_swa_model, tmp_path):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints_bytes=10**8)) as probe:
        await probe.complete(prompt=LONG[:70], n_predict=1, slot=0, ignore_eos=True)
        one = (await probe.checkpoint_stats()).used
    assert one > 0
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints_bytes=int(one * 7.5))) as s:
        await s.complete(prompt=LONG, n_predict=1, slot=0, ignore_eos=True)  # ~7 checkpoints
        await s.complete(prompt=LONG[:200], n_predict=1, slot=1, ignore_eos=True)
        st = await s.checkpoint_stats()
        assert st.used <= st.budget and st.evicted > 0
        assert st.per_slot[1] > 0
