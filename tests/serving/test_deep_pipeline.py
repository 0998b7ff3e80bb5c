"""A deeper pipeline (`pipeline_depth` 3 and 4): a request that ends by its sample has up
to depth-1 tokens fed after its end, and the slot's record of its KV must keep them.

Why this pins it: the core used to drop a sample taken after the end even when a step in
flight had already fed it (depth >= 3), so the slot believed its sequence one token shorter
than the cache held, and the next turn on it decoded at a position the cache already had.
"""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("depth", [3, 4])
async def test_a_stop_ended_turn_at_depth_leaves_a_kv_record_the_next_turn_can_extend(tiny_model, depth):
    cfg = Config(model=tiny_model, slots=2, ctx=2048, batch=64, threads=1, pipeline_depth=depth)
    async with ActorSystem(cfg) as s:
        prompt = [1, 17, 29, 33, 41]
        full = await s.complete(prompt=prompt, n_predict=40, ignore_eos=True, slot=1)
        stop = full.content[12:16]
        assert stop and full.content.index(stop) == 12  # an early cut: steps were in flight past it
        await s.slot_erase(1)

        cut = await s.complete(prompt=prompt, n_predict=40, ignore_eos=True, slot=0, stop=[stop])
        assert cut.stop_reason == "stop" and cut.content == full.content[:12]
        [info] = [i for i in await s.slot_list() if i.id == 0]
        # What the KV holds: the prompt, the output and the tokens fed after the stop.
        assert info.n_tokens > len(prompt) + len(cut.tokens)

        # The next turn extends it: the cached prefix is reused, and greedy decoding gives
        # what a fresh slot gives for the same tokens.
        turn2 = prompt + cut.tokens + [3, 5]
        warm = await s.complete(prompt=turn2, n_predict=12, ignore_eos=True, slot=0)
        cold = await s.complete(prompt=turn2, n_predict=12, ignore_eos=True, slot=1)
        assert warm.n_cached >= len(prompt) + len(cut.tokens) - 1
        assert warm.tokens == cold.tokens


@pytest.mark.parametrize("depth", [2, 3, 4])
async def test_an_eog_ended_turn_leaves_the_kv_at_the_eog_token_at_any_depth(tiny_model, depth):
    """The engine does not decode what was sampled after an end-of-generation token that
    ends the request (steps planned blind at depth >= 3): the KV ends at that token, as at
    depth 2, which a chat template's next turn repeats."""
    cfg = Config(model=tiny_model, slots=2, ctx=2048, batch=64, threads=1, pipeline_depth=depth)
    async with ActorSystem(cfg) as s:
        eos = s.props.eos
        prompt = [1, 17, 29, 33, 41]
        # Free tokens first, then the end: a bias on eos from the start would end at once.
        free = await s.complete(prompt=prompt, n_predict=6, ignore_eos=True, slot=0)
        r = await s.complete(prompt=prompt + free.tokens, n_predict=20, slot=0, logit_bias=[(eos, 100.0)])
        assert r.stop_reason == "eos" and r.tokens == []
        [info] = [i for i in await s.slot_list() if i.id == 0]
        assert info.n_tokens == len(prompt) + len(free.tokens) + 1  # the prompt and the eog token
        # An ignore_eos request feeds on past it, as it asked.
        r2 = await s.complete(prompt=prompt, n_predict=5, slot=1, ignore_eos=True, logit_bias=[(eos, 100.0)])
        assert r2.tokens == [eos] * 5 and r2.stop_reason == "length"


@pytest.mark.parametrize("kind", ["hybrid", "recurrent"])
async def test_at_depth_4_a_recurrent_state_ended_at_eog_is_extended_exactly_by_the_next_turn(
        kind, tiny_hybrid_model, tiny_recurrent_model):
    """What the skip is for: a recurrent state cannot be cut back, so a turn that left tokens
    past its end would make the next turn resume from a checkpoint; ended at the eog token,
    the next turn (which repeats it, as a chat template does) extends the state as it is."""
    model = tiny_hybrid_model if kind == "hybrid" else tiny_recurrent_model
    cfg = Config(model=model, slots=1, ctx=1024, batch=64, threads=1, pipeline_depth=4)
    async with ActorSystem(cfg) as s:
        eos = s.props.eos
        prompt = [1, 17, 29, 33, 41, 57, 61]
        free = await s.complete(prompt=prompt, n_predict=5, ignore_eos=True)
        first = prompt + free.tokens
        r = await s.complete(prompt=first, n_predict=20, logit_bias=[(eos, 100.0)])
        assert r.stop_reason == "eos"
        turn2 = first + [eos, 3, 5, 7]
        nxt = await s.complete(prompt=turn2, n_predict=4, ignore_eos=True)
        assert nxt.n_cached == len(first) + 1  # everything the state holds, the eog token included
        assert not nxt.resumed_from_checkpoint


async def test_at_depth_4_a_stop_token_ended_turn_leaves_the_kv_at_that_token(tiny_model):
    cfg = Config(model=tiny_model, slots=1, ctx=1024, batch=64, threads=1, pipeline_depth=4)
    async with ActorSystem(cfg) as s:
        prompt = [1, 17, 29, 33, 41]
        full = await s.complete(prompt=prompt, n_predict=12, ignore_eos=True)
        stop = full.tokens[4]
        first = full.tokens.index(stop)
        await s.slot_erase(0)
        r = await s.complete(prompt=prompt, n_predict=12, ignore_eos=True, stop_tokens=[stop])
        assert r.stop_reason == "stop" and r.tokens == full.tokens[:first]
        [info] = await s.slot_list()
        assert info.n_tokens == len(prompt) + first + 1  # the output, then the stop token itself
