"""Parts of a sequence: a shared prefix by cells (SeqShare), a state of some positions only
(StateGet p0/p1), a sequence set from a base and the rest (StateSet base/base_seq).

What prefix sharing (serving/prefix_share.py, the page store's bases) stands on: a state
made of parts decodes exactly as the whole did, and a refused part changes nothing."""

from __future__ import annotations

import pytest

from actord.engine import jobs as J
from actord.vocabulary.config import Config
from actord.vocabulary.errors import PageDoesNotFit
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

PREFIX = [1] + [3 + (i * 37) % 500 for i in range(299)]
A = PREFIX + [7 + i for i in range(24)]
B = PREFIX + [90 + i for i in range(24)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def cfg(model: str) -> Config:
    return Config(model=model, slots=2, ctx=2048, batch=256, threads=1)


async def greedy(s: ActorSystem, prompt: list[int], slot: int) -> list[int]:
    r = await s.complete(prompt=prompt, n_predict=8, slot=slot, ignore_eos=True)
    return r.tokens


async def test_shared_prefix_cells_decode_as_a_fresh_prefill(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        want = await greedy(s, B, 0)
        await s.slot_erase(0)
        await greedy(s, A, 0)
        assert await s.engine.run(J.SeqShare(src=0, dst=1, n=len(PREFIX)))
        rng = await s.engine.run(J.MemoryRange(seq=1))
        assert (rng.pos_min, rng.pos_max) == (0, len(PREFIX) - 1)
        s.slots[1].memory.kv_tokens = list(PREFIX)  # what the slot's own share does (serving/prefix_share.py)
        r = await s.complete(prompt=B, n_predict=8, slot=1, ignore_eos=True)
        assert r.n_cached == len(PREFIX) and r.tokens == want


async def test_share_of_more_than_the_source_holds_is_refused_and_changes_nothing(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        await greedy(s, A, 0)
        await greedy(s, B[:40], 1)
        assert not await s.engine.run(J.SeqShare(src=0, dst=1, n=len(A) + 50))
        rng = await s.engine.run(J.MemoryRange(seq=1))
        assert rng.pos_max == 40 + 8 - 2  # its own sequence, untouched


async def test_a_sequence_set_from_a_base_and_its_rest_decodes_as_the_whole(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        await greedy(s, B, 1)
        held = list(s.slots[1].kv_tokens)
        whole = await s.engine.run(J.StateGet(seq=1))
        base = await s.engine.run(J.StateGet(seq=1, p1=len(PREFIX)))
        rest = await s.engine.run(J.StateGet(seq=1, p0=len(PREFIX)))
        assert base.n_bytes + rest.n_bytes < whole.n_bytes * 1.2 and rest.n_bytes < whole.n_bytes / 5
        base_b, rest_b = bytes(base.data), bytes(rest.data)
        nxt = held + [5, 6]
        want = await greedy(s, nxt, 1)

        async def from_parts(**base_kw) -> list[int]:
            await s.engine.run(J.SeqRm(seq=1, p0=-1, p1=-1))
            await s.engine.run(J.StateSet(seq=1, data=rest_b, n_base=len(PREFIX), n_tokens=len(held), **base_kw))
            s.slots[1].memory.kv_tokens = list(held)
            r = await s.complete(prompt=nxt, n_predict=8, slot=1, ignore_eos=True)
            assert r.n_cached == len(held)
            return r.tokens

        assert await from_parts(base=base_b) == want
        await s.engine.run(J.StateSet(seq=0, data=base_b))  # another sequence holds the base's cells
        assert await from_parts(base_seq=0) == want


async def test_a_base_and_rest_that_do_not_make_the_whole_leave_the_sequence_empty(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        await greedy(s, B, 1)
        n = (await s.engine.run(J.MemoryRange(seq=1))).pos_max + 1
        base = bytes((await s.engine.run(J.StateGet(seq=1, p1=len(PREFIX)))).data)
        rest = bytes((await s.engine.run(J.StateGet(seq=1, p0=len(PREFIX)))).data)
        with pytest.raises(PageDoesNotFit):
            await s.engine.run(J.StateSet(seq=1, data=rest, base=base, n_base=len(PREFIX), n_tokens=n + 1))
        assert (await s.engine.run(J.MemoryRange(seq=1))).pos_max == -1
        with pytest.raises(PageDoesNotFit):  # a base sequence that holds nothing
            await s.engine.run(J.StateSet(seq=1, data=rest, base_seq=0, n_base=len(PREFIX), n_tokens=n))
        assert (await s.engine.run(J.MemoryRange(seq=1))).pos_max == -1


async def test_recurrent_memory_shares_no_cells(tiny_recurrent_model):
    async with ActorSystem(cfg(tiny_recurrent_model)) as s:
        await greedy(s, A, 0)
        assert not await s.engine.run(J.SeqShare(src=0, dst=1, n=len(PREFIX)))


async def test_a_cut_whose_window_lost_cells_in_the_middle_is_refused_and_changes_nothing(tiny_swa_model):
    """libllama gives an idle sequence's cells that its window has passed to other
    sequences' tokens, and not lowest first (seed 313 x 60 steps: a slot resumed at 1 over a
    position 0 another slot's prefill had taken in the SWA layers). A cut a resume relies on
    counts every cell of its window, in the same engine call: a hole anywhere in it refuses
    the cut. (Here the hole is made by hand: cells 60-79 of a full SWA cache's sequence.)"""
    async with ActorSystem(Config(model=tiny_swa_model, slots=2, ctx=2048, batch=256, threads=1, swa_full="on")) as s:
        await greedy(s, A, 0)  # 324 tokens, all kept: a full SWA cache (window 32)
        assert await s.engine.run(J.SeqRm(seq=0, p0=60, p1=80))
        assert not await s.engine.run(J.SeqRm(seq=0, p0=100, p1=-1, window=True))  # its window [68, 100) has the hole
        rng = await s.engine.run(J.MemoryRange(seq=0))
        assert (rng.pos_min, rng.pos_max) == (0, len(A) + 8 - 2)  # nothing removed
        assert not await s.engine.run(J.SeqShare(src=0, dst=1, n=90))  # nor shared from there
        assert await s.engine.run(J.SeqRm(seq=0, p0=50, p1=-1, window=True))  # [18, 50) is whole


async def test_a_base_whose_window_lost_cells_is_no_state(tiny_swa_model):
    """A base of positions [0, n) cut from a longer sequence on a full SWA cache: where the
    window at n lost cells (libllama gave them to other sequences' tokens once the sequence
    moved past them), its state would resume wrong, so it is none (page_bases.py then keeps
    the page whole). Seeds 457 and 581 x 60 steps: a new mind took such a base and answered
    garbage from her first token. (The hole is made by hand here: cells 60-79.)"""
    async with ActorSystem(Config(model=tiny_swa_model, slots=2, ctx=2048, batch=256, threads=1, swa_full="on")) as s:
        await greedy(s, A, 0)
        assert await s.engine.run(J.SeqRm(seq=0, p0=60, p1=80))
        lost = await s.engine.run(J.StateGet(seq=0, p1=90))  # its window [58, 90) has the hole
        assert lost.n_bytes == 0
        whole = await s.engine.run(J.StateGet(seq=0, p1=50))  # [18, 50) is whole
        assert whole.n_bytes > 0
        rng = await s.engine.run(J.MemoryRange(seq=0))
        assert rng.pos_max == len(A) + 8 - 2  # the sequence itself untouched
