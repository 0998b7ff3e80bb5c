"""KV cells held for a sequence that is about to arrive outside a step (a page-in, a
restore): asked of the scheduler with `MakeRoom`, given back with `ReleaseRoom` however the
move ended.

Why one helper: the cells must stay held from before the move until the slot's own count
says it holds them, on every path (done, refused, cancelled), or the steps in flight are
counted against cells the move takes (seed 1834 of the spec simulation: 257 of 256). The
dance was written out in four places; here it is one async context manager.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import anyio

from actord.vocabulary.errors import ActordError
from actord.serving.kernel import Actor
from actord.serving.messages import MakeRoom, ReleaseRoom, Room, SchedulerInbox


@dataclass
class Held:
    """Cells held for a move: `cells` of what was asked (fewer: requests in flight hold
    the rest). `handed_over`: the slot took the token with the move and gives it back in its
    Cells tell, so the holder need not."""

    token: int
    cells: int
    handed_over: bool = False


@asynccontextmanager
async def holding_room(scheduler: Actor[SchedulerInbox], slot: int, cells: int, *, evict: bool = True,
                       release_timeout: float | None = None) -> AsyncIterator[Held]:
    """Hold `cells` KV cells for `slot` while the body runs."""
    room: Room = await scheduler.ask(MakeRoom(slot=slot, cells=cells, evict=evict))
    held = Held(token=room.token, cells=room.cells)
    try:
        yield held
    finally:
        if held.token and not held.handed_over:  # answered once the count is the slot's own again
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(release_timeout if release_timeout is not None else math.inf):
                    try:
                        await scheduler.ask(ReleaseRoom(token=held.token))
                    except ActordError:
                        pass  # stopping


@asynccontextmanager
async def no_room() -> AsyncIterator[Held]:
    """Nothing to hold (a move of no cells), in the same shape."""
    yield Held(token=0, cells=0)
