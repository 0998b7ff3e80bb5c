"""The requests in flight at the façade: their ids, the slot each is bound for, and when none is left.

Why a record of its own: three things read it. An unnamed request's placement and n
choices' forks pass over the slots a request in flight is bound for (actord/service/placement.py);
`shutdown` waits until it is empty and cancels what is left past the grace. Ids come from
one counter for requests and holds alike, so a trace's request ids do not depend on which
verb took one.
"""

from __future__ import annotations

import itertools
from typing import Awaitable, Callable

import anyio

from actord.vocabulary.log import get

log = get("actord.service.system")


class InFlight:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.slots: dict[int, int | None] = {}  # rid -> slot (None: placed by the mind placer)
        self._idle: anyio.Event | None = None

    def __len__(self) -> int:
        return len(self.slots)

    def open(self) -> int:
        rid = next(self._ids)
        self.slots[rid] = None
        return rid

    def bound(self) -> set[int]:
        """The slots a request in flight is bound for: no placement picks them meanwhile."""
        return {s for s in self.slots.values() if s is not None}

    def hold(self, slots: list[int]) -> list[int]:
        """Mark slots as bound for work about to come (no placement picks them); the ids to release."""
        rids = [next(self._ids) for _ in slots]
        self.slots.update(zip(rids, slots))
        return rids

    def release(self, rids: list[int]) -> None:
        for rid in rids:
            self.slots.pop(rid, None)
        if not self.slots and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.slots:
            self._idle = anyio.Event()
            await self._idle.wait()

    async def drain(self, grace_s: float, cancel: Callable[[int, int | None], Awaitable[None]]) -> dict[str, int]:
        """Wait up to `grace_s` for the requests in flight to end, then `cancel` the rest
        (and give them 5 s to answer); how many finished and how many were cancelled."""
        n0 = len(self.slots)
        log.info("system.shutting_down", in_flight=n0, grace_s=grace_s)
        with anyio.move_on_after(grace_s):
            await self.wait_idle()
        late = dict(self.slots)
        for rid, slot in late.items():
            await cancel(rid, slot)
        with anyio.move_on_after(5.0):
            await self.wait_idle()
        if late:
            log.warning("system.cancelled_at_shutdown", n=len(late), left=len(self.slots))
        return {"finished": n0 - len(late), "cancelled": len(late)}
