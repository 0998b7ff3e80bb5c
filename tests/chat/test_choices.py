"""n choices of one prompt (actord/chat/choices.py): one prefill forked into idle slots, each
choice its own seeded sample, the same answer as n separate seeded requests, on attention
and recurrent memory; fewer slots than choices; a mind continues from choice 0; a failure or
a cancel ends all n, and every slot is idle afterwards."""

from __future__ import annotations

import anyio
import pytest

from actord.vocabulary.types import CompletionRequest
from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams
from actord.service.system import ActorSystem
from tests.waits import eventually

pytestmark = pytest.mark.anyio

PROMPT = [1] + list(range(20, 60))


def cfg(model: str, **kw) -> Config:
    return Config(model=model, slots=kw.pop("slots", 4), ctx=kw.pop("ctx", 1024), batch=kw.pop("batch", 64), **kw)


def req(**kw) -> CompletionRequest:
    return CompletionRequest(**{"prompt": PROMPT, "n_predict": 10, "temperature": 1.0, "seed": 7,
                                "ignore_eos": True, **kw})


async def _solo(model: str, seeds: list[int]) -> list[list[int]]:
    async with ActorSystem(cfg(model, slots=1)) as s:
        out = []
        for seed in seeds:
            out.append((await s.complete(req(seed=seed, slot=0))).tokens)
            await s.slot_erase(0)
        return out


async def _idle(s: ActorSystem) -> list:
    async def idle() -> list | None:
        infos = await s.slot_list()
        return infos if all(i.state == "idle" and not i.deferred for i in infos) else None

    return await eventually(idle, "every slot idle, nothing deferred", every=0.01)


@pytest.mark.parametrize("kind", ["tiny_model", "tiny_recurrent_model", "tiny_swa_model", "tiny_hybrid_model"])
async def test_three_choices_prefill_once_and_equal_three_seeded_requests(kind, request):
    model = request.getfixturevalue(kind)
    async with ActorSystem(cfg(model)) as s:
        rs = await s.complete_n(req(), 3)
        m = s.metrics.snapshot()
        infos = await _idle(s)
    assert [r.tokens for r in rs] == await _solo(model, [7, 8, 9])
    assert len({tuple(r.tokens) for r in rs}) == 3  # independent samples
    assert len({r.slot for r in rs}) == 3  # forked: side by side on three slots
    # The prompt but its last token once (the prefill, which choice 0's result carries), then
    # one token per choice.
    assert (rs[0].n_prompt_processed, rs[0].n_cached) == (len(PROMPT), 0)
    assert all(r.n_prompt_processed == 1 and r.n_cached == len(PROMPT) - 1 for r in rs[1:])
    assert m["prompt_tokens_processed_total"] == len(PROMPT) - 1 + 3
    assert sum(i.n_tokens for i in infos) == 3 * (len(PROMPT) + 9)


@pytest.mark.parametrize("kind", ["tiny_model", "tiny_recurrent_model", "tiny_swa_model"])
async def test_more_choices_than_slots_queue_on_the_prefix_and_choice_0_ends_the_slot(kind, request):
    tiny_model = request.getfixturevalue(kind)
    async with ActorSystem(cfg(tiny_model, slots=2)) as s:
        rs = await s.complete_n(req(), 5)
        infos = await _idle(s)
        source = rs[0].slot
        assert s.slots[source].kv_tokens == PROMPT + rs[0].tokens[:-1]  # choice 0 ran last there
    assert [r.tokens for r in rs] == await _solo(tiny_model, [7, 8, 9, 10, 11])
    assert all(i.state == "idle" for i in infos)


async def test_greedy_choices_and_a_text_prompt(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        rs = await s.complete_n(req(prompt="hello there, how are you", temperature=0.0), 3)
        one = await s.complete(req(prompt="hello there, how are you", temperature=0.0))
    assert [r.content for r in rs] == [one.content] * 3
    assert rs[0].n_prompt_tokens == one.n_prompt_tokens


async def test_a_mind_continues_from_choice_0(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        rs = await s.complete_n(req(mind="m1"), 3)
        await _idle(s)
        held = [sl for sl in s.slots if sl.mind == "m1"]
        assert len(held) == 1 and held[0].kv_tokens == PROMPT + rs[0].tokens[:-1]
        nxt = await s.complete(req(prompt=PROMPT + rs[0].tokens + [5], mind="m1"))
        assert nxt.n_cached == len(PROMPT) + len(rs[0].tokens) - 1


async def test_a_fork_pages_out_the_mind_it_displaces(tiny_model):
    async with ActorSystem(cfg(tiny_model, slots=2)) as s:
        other = await s.complete(req(prompt=[1, 9, 9, 9, 9], mind="keep"))
        assert other.slot == 0
        rs = await s.complete_n(req(slot=1), 2)  # the only other slot holds "keep": it is paged out first
        assert [r.slot for r in rs] == [1, 0]
        assert "keep" in {p.page for p in await s.page_list()}
        back = await s.complete(req(prompt=[1, 9, 9, 9, 9] + other.tokens + [3], mind="keep"))
        assert back.n_cached == 4 + len(other.tokens)


async def test_n_over_the_bound_is_refused_and_changes_nothing(tiny_model):
    async with ActorSystem(cfg(tiny_model, max_n=4)) as s:
        for n in (0, 5, True, 2.0):
            with pytest.raises(InvalidParams) as e:
                await s.complete_n(req(), n)
            assert e.value.data["param"] == "n"
        assert all(i.n_tokens == 0 for i in await s.slot_list())
        assert s.metrics.snapshot()["prompt_tokens_total"] == 0


async def test_a_cancelled_caller_cancels_every_choice(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        seen: set[int] = set()
        with anyio.CancelScope() as scope:
            def on_token(chunk: dict) -> None:
                seen.add(chunk["index"])
                if len(seen) == 3:
                    scope.cancel()

            await s.complete_n(req(n_predict=4000, stream=True), 3, on_token=on_token)
        assert scope.cancelled_caught and seen == {0, 1, 2}
        await _idle(s)
        m = s.metrics.snapshot()
        assert m["requests_total{outcome=cancelled}"] == 3 and m["predicted_tokens_total"] < 3000
        assert len((await s.complete(req(n_predict=4))).tokens) == 4


async def test_a_failing_choice_fails_the_request_once(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        with pytest.raises(InvalidParams):  # every choice's sampler refuses the grammar
            await s.complete_n(req(grammar="root ::= nope"), 3)
        await _idle(s)
        assert len((await s.complete_n(req(n_predict=3), 2))[1].tokens) == 3


async def test_a_fork_evicts_nobody_for_cells_the_choice_queues_instead(tiny_model):
    # 256 cells (libllama's least): a mind holds 178 of them, the prefill 40; a fork would
    # need 40 more (the scheduler charges forked cells as if copied), and only 38 are free.
    async with ActorSystem(cfg(tiny_model, slots=3, ctx=256)) as s:
        assert s.props.kv_cells == 256
        await s.complete(req(prompt=[1] + list(range(100, 270)), n_predict=9, mind="keep", temperature=0.0))
        held = next(sl for sl in s.slots if sl.mind == "keep")
        before = list(held.kv_tokens)
        rs = await s.complete_n(req(slot=next(sl.id for sl in s.slots if sl is not held and not sl.kv_tokens)), 2)
        await _idle(s)
        assert rs[0].slot == rs[1].slot != held.id  # choice 1 ran on the prefix's slot, before choice 0
        assert held.mind == "keep" and held.kv_tokens == before
        assert not any(k.startswith("slot_evictions_total") and v for k, v in s.metrics.snapshot().items())
    assert [r.tokens for r in rs] == await _solo(tiny_model, [7, 8])


async def test_choices_under_speculative_decoding_equal_the_plain_ones(tiny_model, models_dir):
    from actord.testing.models import write_tiny_llama

    draft = str(write_tiny_llama(models_dir / "tiny-llama-s2.gguf", seed=2))
    want = {}
    async with ActorSystem(cfg(tiny_model)) as plain:
        for temperature in (0.0, 1.0):
            want[temperature] = [r.tokens for r in await plain.complete_n(req(temperature=temperature, n_predict=24), 3)]
            for sl in range(4):
                await plain.slot_erase(sl)
    async with ActorSystem(cfg(tiny_model, spec_draft_model=draft)) as s:
        assert s.props.spec == "draft"
        for temperature in (0.0, 1.0):
            got = [r.tokens for r in await s.complete_n(req(temperature=temperature, n_predict=24), 3)]
            assert got == want[temperature]
            await _idle(s)
            for sl in range(4):
                await s.slot_erase(sl)
        assert s.metrics.snapshot()["spec_decode_num_draft_tokens_total"] > 0


async def test_choices_drafted_by_the_models_own_mtp_head_equal_the_plain_ones(tiny_hybrid_mtp_model):
    """Forked slots of a hybrid model speculating with its MTP head: the head's carried row
    is the source's, or cold; either way greedy choices are what plain decoding gives."""
    async with ActorSystem(cfg(tiny_hybrid_mtp_model)) as plain:
        want = [r.tokens for r in await plain.complete_n(req(temperature=0.0, n_predict=16), 3)]
    async with ActorSystem(cfg(tiny_hybrid_mtp_model, spec="mtp")) as s:
        assert s.props.spec == "mtp"
        got = [r.tokens for r in await s.complete_n(req(temperature=0.0, n_predict=16), 3)]
        assert got == want
        assert s.metrics.snapshot()["spec_decode_num_draft_tokens_total"] > 0


@pytest.mark.parametrize("kind", ["hybrid", "recurrent"])
async def test_choices_on_recurrent_memory_under_a_draft_model_equal_the_plain_ones(
        kind, tiny_hybrid_model, tiny_recurrent_model, models_dir):
    """A hybrid target rolls rejected drafts back with libllama's snapshots (no forks: the
    choices share the source slot), a recurrent one by a state copy and a replay (forks).
    The draft is a tiny llama of other weights: most of its drafts are rejected."""
    from actord.testing.models import write_tiny_llama

    model = tiny_hybrid_model if kind == "hybrid" else tiny_recurrent_model
    draft = str(write_tiny_llama(models_dir / "tiny-llama-s2.gguf", seed=2))
    async with ActorSystem(cfg(model)) as plain:
        want = [r.tokens for r in await plain.complete_n(req(temperature=0.0, n_predict=16), 3)]
    async with ActorSystem(cfg(model, spec_draft_model=draft)) as s:
        assert s.props.spec == "draft"
        got = [r.tokens for r in await s.complete_n(req(temperature=0.0, n_predict=16), 3)]
        assert got == want
        assert s.metrics.snapshot()["spec_decode_num_draft_tokens_total"] > 0
