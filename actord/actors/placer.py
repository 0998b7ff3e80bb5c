"""MindPlacer: a request that names a mind (not a slot) is placed by the daemon.

A mind is a long-lived session identified by name. The placer keeps which slot holds which
mind and, when a mind is not in a slot, makes room and brings it in: the least recently
placed slot's mind is paged out under its own name (a memory copy), spilling the oldest
page to its page file when the page RAM ceiling refuses; the mind then comes back by
page_in from RAM, by restore from its spilled file, or fresh. The request itself is
forwarded to the slot from inside the placement, so no other placement can take that slot
between the two: the slot's mailbox keeps them in order.
"""

from __future__ import annotations

from typing import Any

from actord.actors.base import Actor, Dispatcher, Envelope
from actord.actors.messages import (
    CancelRequest, Complete, Erase, Info, MakeRoom, Msg, PageInSlot, PageOutSlot, RestoreSlot, SaveSlot,
)
from actord.actors.pages import ListPages
from actord.errors import InvalidParams, PageDoesNotFit, PageNotFound, PageRamExceeded
from actord.log import get
from actord.metrics import Metrics

log = get("actord.placer")


class PlaceMind(Msg):
    """Place `req.mind` in a slot and forward the completion there (reply comes from the slot)."""

    complete: Complete


class CancelPlaced(Msg):
    """The client of request `rid` is gone: pass the cancel on to the slots, after any
    placement of it this mailbox still holds (so the cancel never overtakes the request)."""

    rid: int


PlacerInbox = PlaceMind | CancelPlaced


def mind_file(mind: str) -> str:
    return f"{mind}.page"


class MindPlacer(Actor[PlacerInbox]):
    rank = 10

    def __init__(self, dispatcher: Dispatcher, slots: list[Actor[Any]], pages: Actor[Any], files: Any,
                 spill: Any, metrics: Metrics, capacity: int = 256) -> None:
        super().__init__(dispatcher, "placer", capacity)
        self.slots = slots
        self.pages = pages
        self.files = files
        self.spill = spill  # async (page, file, drop) -> dict: the system's spill
        self.metrics = metrics
        self.slot_mind: dict[int, str | None] = {i: None for i in range(len(slots))}
        self.last_use: dict[int, int] = {i: 0 for i in range(len(slots))}
        self.paged: list[str] = []  # minds paged out by the placer, oldest first
        self.clock = 0
        self.scheduler: Actor[Any] | None = None  # asked for KV cells before a page-in or restore

    async def handle(self, msg: PlacerInbox, env: Envelope[PlacerInbox]) -> None:
        match msg:
            case PlaceMind(complete=c):
                mind = c.req.mind
                if not mind:
                    raise InvalidParams("no mind to place")
                slot = await self.place(mind)
                await self.slots[slot].forward(Envelope(c, env.reply, env.stream))
            case CancelPlaced(rid=rid):
                for s in self.slots:
                    await s.tell(CancelRequest(rid=rid))
            case _:
                raise InvalidParams(f"placer cannot handle {type(msg).__name__}")

    async def place(self, mind: str) -> int:
        self.clock += 1
        for slot, held in self.slot_mind.items():
            if held == mind:
                # Another actor may have moved it (the residency evicts idle slots under
                # their mind's name): trust the slot, not our memory.
                if (await self.slots[slot].ask(Info())).mind == mind:
                    self.last_use[slot] = self.clock
                    return slot
                self.slot_mind[slot] = None
                self.paged.append(mind)
        # An idle slot first (a busy one would hold the placement until its request ends),
        # then a slot without a mind, then the least recently placed.
        busy = {i for i in self.slot_mind if (await self.slots[i].ask(Info())).state != "idle"}
        slot = min(self.slot_mind, key=lambda s: (s in busy, self.slot_mind[s] is not None, self.last_use[s], s))
        old = self.slot_mind[slot]
        clean = False  # an empty idle slot, not erased yet
        if old is not None and (await self.slots[slot].ask(Info())).mind == old:
            await self._page_out(slot, old)
        else:
            if old is not None:  # moved meanwhile (the residency pages idle slots out by name)
                self.paged.append(old)
            # An empty idle slot (its mind paged out, say) is not erased ahead of a page-in
            # or restore: libllama clears the sequence as it sets the state, and the erase's
            # engine job would wait for a step boundary of its own when other minds decode
            # (~one step of a busy turn's first-token time). A fresh start erases first.
            info = await self.slots[slot].ask(Info())
            if info.n_tokens or info.n_checkpoints or info.mind is not None or info.state != "idle":
                await self.slots[slot].ask(Erase())
            else:
                clean = True
        how = await self._bring_in(slot, mind, erase_if_fresh=clean)
        self.slot_mind[slot] = mind
        self.last_use[slot] = self.clock
        log.info("mind.placed", mind=mind, slot=slot, how=how, displaced=old)
        return slot

    async def _page_out(self, slot: int, mind: str) -> None:
        while True:
            try:
                await self.slots[slot].ask(PageOutSlot(page=mind))
                self.paged.append(mind)
                return
            except PageRamExceeded:
                live = {p.page for p in await self.pages.ask(ListPages())}
                victims = [m for m in self.paged if m in live]
                if not victims:  # nothing to spill: the slot goes straight to its file
                    await self.slots[slot].ask(SaveSlot(file=mind_file(mind)))
                    await self.slots[slot].ask(Erase())
                    return
                victim = victims[0]
                self.paged.remove(victim)
                await self.spill(victim, mind_file(victim), True)

    async def _room(self, slot: int, cells: int) -> bool:
        """Cells for a sequence about to move in; False when requests in flight hold them."""
        if self.scheduler is None:
            return True
        return await self.scheduler.ask(MakeRoom(slot=slot, cells=cells)) >= cells

    async def _bring_in(self, slot: int, mind: str, erase_if_fresh: bool = False) -> str:
        how = await self._bring_in_how(slot, mind)
        if how == "fresh" and erase_if_fresh:
            await self.slots[slot].ask(Erase())
        return how

    async def _bring_in_how(self, slot: int, mind: str) -> str:
        pages = {p.page: p for p in await self.pages.ask(ListPages())}
        if mind in pages and not await self._room(slot, pages[mind].n_tokens):
            # The page stays whole in the store for a later turn; this one starts fresh.
            log.info("placer.no_room_for_page", slot=slot, mind=mind, n_tokens=pages[mind].n_tokens)
            return "fresh"
        try:
            await self.slots[slot].ask(PageInSlot(page=mind, evict_first=True))
            if mind in self.paged:
                self.paged.remove(mind)
            return "page_in"
        except PageNotFound:
            pass
        if await self.files.exists(mind_file(mind)):
            try:
                await self.slots[slot].ask(RestoreSlot(file=mind_file(mind)))
            except PageDoesNotFit:  # its size is known only once read: free the whole cache, once
                await self._room(slot, 1 << 30)
                await self.slots[slot].ask(RestoreSlot(file=mind_file(mind)))
            return "restore"
        return "fresh"
