"""KV cells held for a sequence that is about to arrive outside a step (a page-in, a
restore): asked of the scheduler with `MakeRoom`, given back with `ReleaseRoom` however the
move ended.

Why one helper: the cells must stay held from before the move until the slot's own count
says it holds them, on every path (done, refused, cancelled), or the steps in flight are
counted against cells the move takes (seed 1834 of the spec simulation: 257 of 256). The
dance was written out in four places; here it is one async context manager.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio

from actord.service.errors import ActordError
from actord.serving.kernel import Actor
from actord.serving.messages import MakeRoom, ReleaseRoom, Room, SchedulerInbox


@asynccontextmanager
async def holding_room(scheduler: Actor[SchedulerInbox], slot: int, cells: int, *, evict: bool = True,
                       release_timeout: float | None = None) -> AsyncIterator[Room]:
    """Hold `cells` KV cells for `slot` while the body runs; the `Room` says how many the
    scheduler could hold (fewer than asked: requests in flight hold the rest)."""
    room: Room = await scheduler.ask(MakeRoom(slot=slot, cells=cells, evict=evict))
    try:
        yield room
    finally:
        if room.token:  # answered once the count is the slot's own again
            with anyio.CancelScope(shield=True):
                scope: Any = anyio.move_on_after(release_timeout) if release_timeout is not None else None
                try:
                    if scope is None:
                        await scheduler.ask(ReleaseRoom(token=room.token))
                    else:
                        with scope:
                            await scheduler.ask(ReleaseRoom(token=room.token))
                except ActordError:
                    pass  # stopping
