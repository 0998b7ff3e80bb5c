"""Context checkpoints on a sliding-window model whose memory cannot be cut back."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

LONG = [1] + [3 + (i * 37) % 500 for i in range(420)]  # well past the 32-token window


def cfg(model: str, tmp_path, **kw) -> Config:
    base = dict(model=model, slots=2, ctx=2048, batch=32, checkpoint_every=64, ctx_checkpoints=4,
                ctx_checkpoints_bytes=10**8, page_dir=str(tmp_path), swa_full="off",
                prefix_sharing=False)
    base.update(kw)
    return Config(**base)


async def _diverging_turn(s, slot):
    diverged = LONG[:150] + [7, 8, 9, 10, 11]
    return diverged, await s.complete(prompt=diverged, n_predict=8, slot=slot, ignore_eos=True)


@pytest.mark.parametrize("policy", ["placement", "divergence"])
async def test_early_divergence_resumes_from_a_checkpoint_below_it(tiny_swa_model, tmp_path, policy):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, checkpoint_policy=policy)) as s:
        assert s.props.needs_checkpoints and s.props.n_swa == 32
        await s.complete(prompt=LONG, n_predict=4, slot=0, ignore_eos=True)
        info = (await s.slot_list())[0]
        assert info.n_checkpoints >= 4 and info.checkpoint_positions[-1] == len(LONG) - 1  # the end
        diverged, r = await _diverging_turn(s, 0)
        below = max(p for p in info.checkpoint_positions if p <= 150)  # the newest at or below raw lcp 150
        assert r.resumed_from_checkpoint and r.n_cached == below and below > 0
        if policy == "divergence":
            assert below == 128  # a checkpoint every 64 tokens
        assert r.n_prompt_processed == len(diverged) - below
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
    """The original C++ server's rule (--checkpoint-policy divergence): the fullest holder
    gives up its victim."""
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints_bytes=10**8,
                               checkpoint_policy="divergence")) as probe:
        await probe.complete(prompt=LONG[:70], n_predict=1, slot=0, ignore_eos=True)
        one = (await probe.checkpoint_stats()).used
    assert one > 0
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints_bytes=int(one * 7.5),
                               checkpoint_policy="divergence")) as s:
        await s.complete(prompt=LONG, n_predict=1, slot=0, ignore_eos=True)  # ~7 checkpoints
        await s.complete(prompt=LONG[:200], n_predict=1, slot=1, ignore_eos=True)
        st = await s.checkpoint_stats()
        assert st.used <= st.budget and st.evicted > 0
        assert st.per_slot[1] > 0


# ---- placement (the default policy) -------------------------------------------------------


def budget_mirror(s) -> dict[int, list[int]]:
    return {k: [m.pos for m in v] for k, v in s.ckpt_budget.lists.items()}


async def test_placement_learns_where_a_mind_diverges_and_resumes_right_under_it(tiny_swa_model, tmp_path):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints=2)) as s:
        await s.complete(prompt=LONG, n_predict=2, slot=0, ignore_eos=True)
        first = (await s.slot_list())[0]
        assert first.checkpoint_plan[-1] == len(LONG) - 1 and len(first.checkpoint_plan) <= 3
        cached = []
        for tail in ([7, 8], [9, 10], [11, 12], [13, 14]):  # every turn rewrites what follows token 100
            r = await s.complete(prompt=LONG[:100] + tail + LONG[102:], n_predict=2, slot=0, ignore_eos=True)
            cached.append(r.n_cached)
        assert cached[0] < 100 - 16  # nothing known yet: evenly spaced, far under the break
        assert cached[-1] >= 100 - 8  # learned: a checkpoint right under it
        info = (await s.slot_list())[0]
        assert info.n_checkpoints <= 3  # the safety cap, 1 + ctx_checkpoints
        assert s.slots[0].ckpt.history and all(d.lcp == 100 for d in s.slots[0].ckpt.history[1:])


async def test_the_budget_mirror_matches_every_slot_under_pressure(tiny_swa_model, tmp_path):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints_bytes=10**8)) as probe:
        await probe.complete(prompt=LONG[:70], n_predict=1, slot=0, ignore_eos=True)
        st = await probe.checkpoint_stats()
        one = st.used // len(probe.slots[0].checkpoints)
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints_bytes=int(one * 4.5))) as s:
        for i, (slot, cut) in enumerate([(0, 400), (1, 300), (0, 150), (1, 120), (0, 160), (1, 410)]):
            await s.complete(prompt=LONG[:cut] + [5 + i], n_predict=1, slot=slot, ignore_eos=True)
            st = await s.checkpoint_stats()
            assert st.used <= st.budget
            held = {k: [c.pos for c in sl.checkpoints] for k, sl in enumerate(s.slots)}
            assert budget_mirror(s) == held
        assert st.evicted + st.skipped > 0 and set(st.expected) <= {0, 1}


async def test_with_no_budget_placement_stops_planning_once_it_knows_the_size(tiny_swa_model, tmp_path):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints_bytes=0)) as s:
        await s.complete(prompt=LONG, n_predict=1, slot=0, ignore_eos=True)
        skipped = s.metrics.snapshot()["ctx_checkpoints_skipped_budget_total"]
        assert skipped > 0  # the first prompt learns a checkpoint's size the hard way
        await s.complete(prompt=LONG[:200] + [5], n_predict=1, slot=0, ignore_eos=True)
        assert (await s.slot_list())[0].checkpoint_plan == []  # no prompt split for nothing
        assert s.metrics.snapshot()["ctx_checkpoints_skipped_budget_total"] == skipped


async def test_a_divergence_the_memory_served_gets_a_snapshot_right_there(tiny_swa_model, tmp_path):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, ctx_checkpoints=2)) as s:
        await s.complete(prompt=LONG, n_predict=2, slot=0, ignore_eos=True)
        assert 200 not in (await s.slot_list())[0].checkpoint_positions
        r = await s.complete(prompt=LONG[:200] + [7, 8], n_predict=2, slot=0, ignore_eos=True)
        assert r.n_cached == 200 and not r.resumed_from_checkpoint  # the window's cells still held it
        assert 200 in (await s.slot_list())[0].checkpoint_positions  # taken before decoding on
        await s.complete(prompt=LONG, n_predict=2, slot=0, ignore_eos=True)
        r = await s.complete(prompt=LONG[:200] + [9, 10], n_predict=2, slot=0, ignore_eos=True)
        assert r.n_cached == 200


@pytest.mark.parametrize("move", ["page", "file"])
async def test_the_divergence_history_travels_with_the_mind(tiny_swa_model, tmp_path, move):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path)) as s:
        await s.complete(prompt=LONG, n_predict=2, slot=0, ignore_eos=True)
        await s.complete(prompt=LONG[:150] + [5, 6], n_predict=2, slot=0, ignore_eos=True)
        await s.complete(prompt=LONG[:140] + [7, 8], n_predict=2, slot=0, ignore_eos=True)
        want = list(s.slots[0].ckpt.history)
        end = s.slots[0].ckpt.prompt_end
        assert [d.lcp for d in want] == [150, 140] and end == 142
        if move == "page":
            await s.page_out(0, "m")
            assert s.slots[0].ckpt.history == []  # the slot's mind left with its page
            await s.page_in(1, "m")
        else:
            await s.slot_save(0, "m.page")
            await s.slot_erase(0)
            assert s.slots[0].ckpt.history == []  # erased: nothing known
            await s.slot_restore(1, "m.page")
        assert s.slots[1].ckpt.history == want and s.slots[1].ckpt.prompt_end == end


async def test_auto_gives_a_small_swa_model_a_full_cache_and_no_checkpoints(tiny_swa_model, tmp_path):
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, swa_full="auto")) as s:
        props = await s.props_dict()
        assert props["swa_full"] and not props["needs_checkpoints"]
        assert props["swa_full_reason"].startswith("auto: a full SWA cache fits") and props["kv_bytes_per_token"] > 0
        await s.complete(prompt=LONG, n_predict=2, slot=0, ignore_eos=True)
        r = await s.complete(prompt=LONG[:150] + [5], n_predict=2, slot=0, ignore_eos=True)
        assert r.n_cached == 150 and (await s.slot_list())[0].n_checkpoints == 0  # the floor, for free
    tight = cfg(tiny_swa_model, tmp_path, swa_full="auto", device_bytes=props["kv_bytes_per_token"] * 2048)
    async with ActorSystem(tight) as s:  # a full cache would take all of the budget, not a quarter
        props = await s.props_dict()
        assert not props["swa_full"] and props["needs_checkpoints"] and "does not fit" in props["swa_full_reason"]
