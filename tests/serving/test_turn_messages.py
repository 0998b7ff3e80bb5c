"""A mind's turn costs a handful of messages (issue 24), counted from a recorded trace:
every delivery besides the steps (a recorded run delivers each step as a message too)."""

from __future__ import annotations

import collections
import contextlib

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem
from actord.vocabulary.trace import Deliver
from tests.waits import eventually

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def counted_turns(tiny_model: str, tmp_path, heads: dict[str, list[int]]):
    """A one-slot system recording its trace, and `turn(mind, extra)`: the mind's turn on
    heads[mind] + extra, with the deliveries it took (steps aside), its tail included."""
    events: list = []
    cfg = Config(model=tiny_model, slots=1, ctx=1024, page_dir=str(tmp_path), seed=1)
    async with ActorSystem(cfg, trace=events) as s:
        async def turn(mind: str, extra: list[int]) -> tuple[object, list[str]]:
            i = len(events)
            r = await s.complete(prompt=heads[mind] + extra, mind=mind, n_predict=4, temperature=0.0)
            # The answer goes out before the slot's last tell (SlotState): count the turn's tail.
            await eventually(lambda: not s.placer.busy[0], "the placer hears the slot is idle")
            return r, [f"{e.actor}:{e.msg}" for e in events[i:] if isinstance(e, Deliver) and e.msg != "RunStep"]

        yield s, turn


async def test_a_new_mind_takes_five_deliveries_a_resident_turn_five_and_a_switch_twelve(tiny_model, tmp_path):
    """Issue 32's acceptance, from a recorded trace (before its work: 14 for a new mind)."""
    prompt = list(range(10, 60))
    # Minds that share no prefix (sharing one adds the page store's base asks: below).
    async with counted_turns(tiny_model, tmp_path, {"ada": prompt, "bob": [t + 100 for t in prompt]}) as (_, turn):
        new, first = await turn("ada", [1])
        r, resident = await turn("ada", [2, 3])
        _, displacing = await turn("bob", [4])
        back, switch = await turn("ada", [5])
    assert new.n_cached == 0
    assert r.n_cached > 0 and back.n_cached > 0  # both turns really reused her state
    # No page, no file, no base: the index says so with no delivery (the page store published
    # its pages there), and the slot makes way as it takes the request (Complete.fresh).
    assert collections.Counter(first) == collections.Counter(
        ["placer:PlaceMind", "slot0:Complete", "scheduler:Enroll", "slot0:Ended", "placer:SlotState"]), first
    assert collections.Counter(resident) == collections.Counter(
        ["placer:PlaceMind", "slot0:Complete", "scheduler:Enroll", "slot0:Ended", "placer:SlotState"])
    # A new mind whose slot holds another: the six, plus that mind's page-out (the move,
    # its base's find, the commit, the cells handed back); 18 before issue 32's work.
    assert len(displacing) <= 10, displacing
    assert len(switch) <= 12, switch
    assert "slot0:Info" not in switch and "scheduler:ReleaseRoom" not in switch


async def test_a_switch_between_minds_that_share_a_prefix_costs_three_asks_more_once_then_one(tiny_model, tmp_path):
    """The first page-out on a shared prefix makes its base (FindBase, AdmitBase, Commit);
    later ones find it (FindBase instead of the whole page's admission, plus the rest's)."""
    prompt = list(range(10, 110))
    async with counted_turns(tiny_model, tmp_path, {"ada": prompt, "bob": prompt}) as (s, turn):
        await turn("ada", [1])
        await turn("bob", [4])  # ada's page: whole (nothing shared yet)
        r1, first = await turn("ada", [5])  # bob's page: the base, then his own part
        r2, again = await turn("bob", [6])  # ada's page: on the base
        assert (await s.page_stats()).bases == 1
    assert r1.n_cached > 0 and r2.n_cached > 0
    assert first.count("pagestore:AdmitBase") == 1 and len(first) <= 15, first
    assert "pagestore:AdmitBase" not in again and len(again) <= 13, again

