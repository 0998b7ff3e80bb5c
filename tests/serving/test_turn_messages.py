"""A mind's turn costs a handful of messages (issue 24), counted from a recorded trace:
every delivery besides the steps (a recorded run delivers each step as a message too)."""

from __future__ import annotations

import collections

import pytest

from actord.service.config import Config
from actord.service.system import ActorSystem
from actord.service.trace import Deliver
from tests.waits import eventually

pytestmark = pytest.mark.anyio


async def test_a_resident_turn_takes_five_deliveries_and_a_switch_twelve(tiny_model, tmp_path):
    events: list = []
    cfg = Config(model=tiny_model, slots=1, ctx=1024, page_dir=str(tmp_path), seed=1)
    prompt = list(range(10, 60))

    def since(i: int) -> list[str]:
        return [f"{e.actor}:{e.msg}" for e in events[i:] if isinstance(e, Deliver) and e.msg != "RunStep"]

    async with ActorSystem(cfg, trace=events) as s:
        async def turn(mind: str, extra: list[int]) -> tuple[object, list[str]]:
            i = len(events)
            r = await s.complete(prompt=prompt + extra, mind=mind, n_predict=4, temperature=0.0)
            # The answer goes out before the slot's last tell (SlotState): count the turn's tail.
            await eventually(lambda: not s.placer.busy[0], "the placer hears the slot is idle")
            return r, since(i)

        await turn("ada", [1])
        r, resident = await turn("ada", [2, 3])
        await turn("bob", [4])
        back, switch = await turn("ada", [5])
    assert r.n_cached > 0 and back.n_cached > 0  # both turns really reused her state
    assert collections.Counter(resident) == collections.Counter(
        ["placer:PlaceMind", "slot0:Complete", "scheduler:Enroll", "slot0:Ended", "placer:SlotState"])
    assert len(switch) <= 12, switch
    assert "slot0:Info" not in switch and "scheduler:ReleaseRoom" not in switch
