"""The behaviours that matter, over the four memory kinds.

llama: attention only (cut back anywhere); swa: gemma3-style sliding window without a full
cache (checkpoints); hybrid: Qwen3.5-style, Gated DeltaNet + one attention layer (a KV cell
per token and a fixed recurrent state; checkpoints); recurrent: Mamba-2 (a fixed state and
no cells; checkpoints). Every equality here compares greedy tokens with a slot that never
moved or a fresh one; the fixtures are scaled so a token 64+ back changes greedy output
(tests/engine/test_tiny_models.py), so the equalities mean something.

Asyncio only: the anyio backends are covered elsewhere, and this matrix is the costly part.
"""

from __future__ import annotations

import anyio
import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

KINDS = ["llama", "swa", "hybrid", "recurrent"]
FIXTURE = {"llama": "tiny_model", "swa": "tiny_swa_model", "hybrid": "tiny_hybrid_model",
           "recurrent": "tiny_recurrent_model"}
# Long enough that the SWA cache (at least 256 cells here) has let go of position 150.
LONG = [1] + [3 + (i * 37) % 500 for i in range(600)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def model(kind, request) -> str:
    return request.getfixturevalue(FIXTURE[kind])


def cfg(model: str, tmp_path, **kw) -> Config:
    base = dict(model=model, slots=2, ctx=2048, batch=64, checkpoint_every=64, ctx_checkpoints=4,
                ctx_checkpoints_bytes=10**8, page_dir=str(tmp_path), swa_full="off",
                prefix_sharing=False, threads=1)
    base.update(kw)
    return Config(**base)


async def turn(s, slot, prompt, n=8):
    return await s.complete(prompt=prompt, n_predict=n, slot=slot, ignore_eos=True)


async def test_the_fixtures_are_the_memory_kinds_they_claim(kind, model, tmp_path):
    async with ActorSystem(cfg(model, tmp_path)) as s:
        p = s.props
        assert (p.recurrent, p.hybrid) == {"recurrent": (True, False), "hybrid": (False, True)}.get(kind, (False, False))
        assert p.needs_checkpoints == (kind != "llama")
        assert (p.n_swa > 0) == (kind == "swa")
        # Cells are charged for attention layers only: none on Mamba-2.
        assert p.kv_cells == (0 if kind == "recurrent" else p.n_ctx)
        assert (p.kv_bytes_per_token == 0) == (kind == "recurrent")
        assert (p.recurrent_state_bytes > 0) == (kind in ("hybrid", "recurrent"))
        assert s.scheduler.n_ctx == p.kv_cells


async def test_prefix_reuse_decodes_only_the_suffix(kind, model, tmp_path):
    async with ActorSystem(cfg(model, tmp_path)) as s:
        first = await turn(s, 0, LONG)
        nxt = LONG + first.tokens + [5, 6]
        again = await turn(s, 0, nxt)
        assert again.n_prompt_processed == 3 and not again.resumed_from_checkpoint  # the last sampled + 2
        fresh = await turn(s, 1, nxt)
        assert fresh.n_cached == 0 and again.tokens == fresh.tokens


async def test_a_mid_prompt_divergence_resumes_at_a_checkpoint_with_a_fresh_slots_output(kind, model, tmp_path):
    async with ActorSystem(cfg(model, tmp_path)) as s:
        await turn(s, 0, LONG, n=4)
        diverged = LONG[:150] + [7, 8, 9, 10, 11]
        r = await turn(s, 0, diverged)
        if kind == "llama":  # attention memory is cut back right at the divergence
            assert r.n_cached == 150 and not r.resumed_from_checkpoint
        else:
            below = [p for p in (await s.slot_list())[0].checkpoint_positions if p <= 150]
            assert r.resumed_from_checkpoint and 0 < r.n_cached <= 150 and r.n_cached in below
        assert r.n_prompt_processed == len(diverged) - r.n_cached
        fresh = await turn(s, 1, diverged)
        assert fresh.n_cached == 0 and r.tokens == fresh.tokens


@pytest.mark.parametrize("move", ["page", "file"])
async def test_a_moved_slot_resumes_elsewhere_with_the_output_of_one_that_never_moved(kind, model, tmp_path, move):
    diverged = LONG[:150] + [7, 8, 9]
    async with ActorSystem(cfg(model, tmp_path)) as ref:  # the same history on slots that never moved
        first = await turn(ref, 0, LONG)
        nxt = LONG + first.tokens + [5, 6]
        never = await turn(ref, 0, nxt)
        fresh = await turn(ref, 1, diverged)

    async def check(s) -> None:
        moved = await turn(s, 1, nxt)
        assert moved.n_prompt_processed == 3 and moved.tokens == never.tokens
        # An early divergence after the move resumes from the checkpoints that came with it.
        early = await turn(s, 1, diverged)
        assert early.tokens == fresh.tokens and early.n_cached <= 150
        assert early.resumed_from_checkpoint == (kind != "llama") and early.n_cached > 0

    async with ActorSystem(cfg(model, tmp_path)) as s:
        assert (await turn(s, 0, LONG)).tokens == first.tokens
        if move == "page":
            await s.page_out(0, "m")
            await s.page_in(1, "m")
            await check(s)
        else:
            await s.slot_save(0, "m.page")
    if move == "file":
        async with ActorSystem(cfg(model, tmp_path)) as s:  # across a restart
            await s.slot_restore(1, "m.page")
            await check(s)


async def test_spill_restart_restore_resumes_with_the_never_spilled_output(kind, model, tmp_path):
    async with ActorSystem(cfg(model, tmp_path)) as ref:
        first = await turn(ref, 0, LONG)
        nxt = LONG + first.tokens + [5, 6]
        never = await turn(ref, 0, nxt)
    async with ActorSystem(cfg(model, tmp_path)) as s:
        r = await s.complete(prompt=LONG, n_predict=8, mind="ada", ignore_eos=True)
        assert r.tokens == first.tokens
        await s.page_out(r.slot, "ada")
        await s.page_spill("ada", "ada.page", drop=True)
        assert await s.page_list() == []
    async with ActorSystem(cfg(model, tmp_path)) as s:  # the mind comes back from its file
        back = await s.complete(prompt=nxt, n_predict=8, mind="ada", ignore_eos=True)
        assert back.n_prompt_processed == 3 and back.tokens == never.tokens
        assert s.metrics.snapshot().get("full_reprefills_total", 0) == 0


async def test_the_checkpoint_budget_holds_over_two_slots(kind, model, tmp_path):
    async with ActorSystem(cfg(model, tmp_path, checkpoint_policy="divergence")) as probe:
        await turn(probe, 0, LONG[:70], n=1)
        one = (await probe.checkpoint_stats()).used
    if kind == "llama":  # attention memory needs none
        assert one == 0
        return
    assert one > 0
    async with ActorSystem(cfg(model, tmp_path, checkpoint_policy="divergence",
                               ctx_checkpoints_bytes=int(one * 4.5))) as s:
        await turn(s, 0, LONG, n=1)
        await turn(s, 1, LONG[:200], n=1)
        st = await s.checkpoint_stats()
        assert st.used <= st.budget and st.evicted + st.skipped > 0
        assert st.per_slot[0] > 0 and st.per_slot[1] > 0
        # What the budget holds is still right: a divergence resumes from it.
        diverged = LONG[:140] + [7, 8, 9]
        r = await turn(s, 0, diverged)
        assert r.tokens == (await turn(s, 1, diverged)).tokens


async def test_kv_pressure_evicts_only_what_holds_cells(kind, model, tmp_path):
    """ctx 512: slot 0 holds 301 tokens, slot 1 wants 301 more. Attention memory (llama, SWA,
    hybrid) cannot hold both, so idle slot 0 gives its cells up; Mamba-2 has no cells and
    keeps both. And a Mamba-2 prompt longer than n_ctx runs (libllama does)."""
    async with ActorSystem(cfg(model, tmp_path, ctx=512)) as s:
        mine = LONG[:301]
        await turn(s, 0, mine, n=2)
        other = [1] + [5 + (i * 7) % 300 for i in range(300)]
        r = await turn(s, 1, other, n=4)
        assert r.stop_reason == "length" and len(r.tokens) == 4
        infos = await s.slot_list()
        held = s.metrics.snapshot().get("kv_evictions_total", 0)
        if kind == "recurrent":
            assert infos[0].n_tokens == len(mine) + 1 and held == 0
            long = mine + other + mine  # 903 tokens > n_ctx 512
            r = await turn(s, 0, long, n=4)
            assert r.n_prompt_tokens == len(long) and len(r.tokens) == 4
            again = await turn(s, 0, long + r.tokens + [9], n=4)
            assert again.n_prompt_processed == 2
        else:
            assert infos[0].n_tokens == 0 and held >= 1


async def test_two_clients_at_once_get_what_each_gets_alone(kind, model, tmp_path):
    prompts = [LONG[:120], [1] + [5 + (i * 11) % 400 for i in range(90)]]
    async with ActorSystem(cfg(model, tmp_path)) as s:
        alone = []
        for i, p in enumerate(prompts):
            alone.append((await turn(s, i, p, n=12)).tokens)
            await s.slot_erase(i)
        out: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            out[i] = (await turn(s, i, prompts[i], n=12)).tokens

        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(one, i)
        assert [out[0], out[1]] == alone


class _FailsAfterDecode:
    """An engine whose next resumed prompt piece is decoded, then reported failed: the
    sequence holds more than the slot knows, as after a decode that failed part-way."""

    armed = False

    @classmethod
    def make(cls, config: Config):
        from actord.engine.engine import Engine
        from actord.engine.step import Stepper
        from actord.vocabulary.errors import EngineError

        class S(Stepper):
            def _step(self, job):
                out = super()._step(job)
                if cls.armed and any(e.pos0 > 0 and len(e.tokens) > 1 for e in job.entries):
                    cls.armed = False
                    raise EngineError("injected: failed after the decode")
                return out

        return Engine(config, stepper=S)


async def test_after_a_step_failed_past_what_the_slot_knows_the_slot_serves_right(kind, model, tmp_path):
    """Attention memory is cut back to the tokens the slot knows; recurrent and hybrid memory
    refuse that cut, so the sequence is erased (never a token list that is not its state)."""
    from actord.vocabulary.errors import EngineError

    async with ActorSystem(cfg(model, tmp_path), engine_factory=_FailsAfterDecode.make) as s:
        first = await turn(s, 0, LONG[:200], n=4)
        nxt = LONG[:200] + first.tokens + LONG[200:300]
        _FailsAfterDecode.armed = True
        with pytest.raises(EngineError):
            await turn(s, 0, nxt)
        held = (await s.slot_list())[0].n_tokens
        assert held == (0 if kind in ("hybrid", "recurrent") else 200 + 3)
        again = await turn(s, 0, nxt)
        assert again.n_cached == held or (kind == "swa" and again.n_cached <= held)
        ref = await turn(s, 1, nxt)
        assert again.tokens == ref.tokens


@pytest.mark.parametrize("move", ["page", "file"])
async def test_a_full_swa_cache_moved_elsewhere_does_not_claim_positions_below_its_window(tiny_swa_model, tmp_path,
                                                                                          move):
    """libllama 0.3.36 writes a sequence's state without its SWA-masked cells even from a full
    SWA cache, so a moved sequence's SWA layers hold only the last window: a divergence below
    it must re-prefill (it used to cut back and decode from a state missing those cells)."""
    async with ActorSystem(cfg(tiny_swa_model, tmp_path, swa_full="on")) as s:
        assert s.props.swa_full and not s.props.needs_checkpoints
        await turn(s, 0, LONG, n=4)
        if move == "page":
            await s.page_out(0, "m")
            await s.page_in(1, "m")
        else:
            await s.slot_save(0, "m.page")
            await s.slot_erase(0)
            await s.slot_restore(1, "m.page")
        diverged = LONG[:150] + [7, 8, 9]
        r = await turn(s, 1, diverged)
        assert r.n_cached == 0
        assert r.tokens == (await turn(s, 0, diverged)).tokens
        # Near the end, inside the window the state holds, the cut is still served.
        near = LONG[:590] + [7, 8]
        await turn(s, 1, LONG, n=4)
        assert (await turn(s, 1, near)).n_cached == 590
