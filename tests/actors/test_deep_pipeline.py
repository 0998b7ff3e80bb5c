"""A deeper pipeline (`pipeline_depth` 3 and 4): a request that ends by its sample has up
to depth-1 tokens fed after its end, and the slot's record of its KV must keep them.

Why this pins it: the core used to drop a sample taken after the end even when a step in
flight had already fed it (depth >= 3), so the slot believed its sequence one token shorter
than the cache held, and the next turn on it decoded at a position the cache already had.
"""

from __future__ import annotations

import pytest

from actord.config import Config
from actord.system import ActorSystem

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
