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

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import anyio

from actord.serving.kernel import Actor, Dispatcher, Envelope
from actord.serving.messages import (
    CancelRequest, Complete, Erase, Info, Msg, PageInSlot, PageOutSlot, RestoreSlot, Room, SaveSlot, SchedulerInbox,
)
from actord.serving.room import holding_room
from actord.serving.page_store import ListPages
from actord.service.errors import (
    ActordError, Cancelled, CorruptPageFile, InvalidParams, PageDoesNotFit, PageNotFound, PageRamExceeded, SlotEmpty,
)
from actord.service.log import get
from actord.service.metrics import Metrics
from actord.storage.files import PageFiles
from actord.storage.paths import MIND_FILE_SUFFIX

log = get("actord.placer")

# The system's spill of a page to its file: (page, file, drop) -> its report.
Spill = Callable[[str, str, bool], Awaitable[dict[str, Any]]]


class PlaceMind(Msg):
    """Place `req.mind` in a slot and forward the completion there (reply comes from the slot)."""

    complete: Complete


class CancelPlaced(Msg):
    """The client of request `rid` is gone: pass the cancel on to the slots, after any
    placement of it this mailbox still holds (so the cancel never overtakes the request)."""

    rid: int


class SlotIdle(Msg):
    """From a slot: its request ended and nothing waits in it; a placement parked for want
    of an idle slot may go now."""

    slot: int


PlacerInbox = PlaceMind | CancelPlaced | SlotIdle


@dataclass
class _Parked:
    complete: Complete
    env: Envelope[Any]


@asynccontextmanager
async def _no_room() -> AsyncIterator[Room]:
    yield Room(token=0, cells=0)


def mind_file(mind: str) -> str:
    return f"{mind}{MIND_FILE_SUFFIX}"


class MindPlacer(Actor[PlacerInbox]):
    rank = 10

    def __init__(self, dispatcher: Dispatcher, slots: Sequence[Actor[Any]], pages: Actor[Any], files: PageFiles,
                 spill: Spill, metrics: Metrics, scheduler: Actor[SchedulerInbox], *, kv_cells: int = 0,
                 n_slots: int | None = None, capacity: int = 256) -> None:
        super().__init__(dispatcher, "placer", capacity)
        self.slots = slots
        self.pages = pages
        self.files = files
        self.spill = spill
        self.metrics = metrics
        n = len(slots) if n_slots is None else n_slots
        self.slot_mind: dict[int, str | None] = {i: None for i in range(n)}
        self.last_use: dict[int, int] = {i: 0 for i in range(n)}
        self.paged: list[str] = []  # minds paged out by the placer, oldest first
        self.kv_cells = kv_cells  # the shared KV cache's cells (0: not charged)
        self.clock = 0
        self.scheduler = scheduler  # asked for KV cells before a page-in or restore
        # Minds whose page file was refused (corrupt, another model), with the file's
        # signature: a file published since is tried again.
        self.unreadable: dict[str, tuple[int, int, int]] = {}
        self.parked: list[_Parked] = []  # placements waiting for an idle slot, oldest first

    async def handle(self, msg: PlacerInbox, env: Envelope[PlacerInbox]) -> None:
        match msg:
            case PlaceMind(complete=c):
                if not c.req.mind:
                    raise InvalidParams("no mind to place")
                self.parked.append(_Parked(c, env))
                await self._serve_parked()
            case SlotIdle():
                if self.parked:
                    await self._serve_parked()
            case CancelPlaced(rid=rid):
                for p in [p for p in self.parked if p.complete.rid == rid]:
                    self.parked.remove(p)
                    self.metrics.requests_total.labels(outcome="cancelled").inc()
                    if p.env.reply is not None:
                        p.env.reply.fail(Cancelled("request cancelled before it was placed", rid=rid))
                for s in self.slots:
                    await s.tell(CancelRequest(rid=rid))
            case _:
                raise InvalidParams(f"placer cannot handle {type(msg).__name__}")

    async def _serve_parked(self) -> None:
        """Place what can be placed now, oldest first. A placement that would have to wait
        for a busy slot stays parked (the slot tells `SlotIdle` when its request ends), so
        one long request never holds up the minds behind it; one mind's requests keep
        their order."""
        i = 0
        held_back: set[str] = set()
        while i < len(self.parked):
            p = self.parked[i]
            mind = p.complete.req.mind
            assert mind is not None
            if mind in held_back:
                i += 1
                continue
            try:
                slot = await self.place(mind)
            except ActordError as e:
                self.parked.remove(p)
                if p.env.reply is not None:
                    p.env.reply.fail(e)
                continue
            if slot is None:
                held_back.add(mind)
                i += 1
                continue
            self.parked.remove(p)
            await self.slots[slot].forward(Envelope(p.complete, p.env.reply, p.env.stream))

    def on_crash(self, error: BaseException) -> None:
        for p in self.parked:
            if p.env.reply is not None:
                p.env.reply.fail(error)
        self.parked.clear()

    def deferred_count(self) -> int:
        return len(self.parked)

    async def place(self, mind: str) -> int | None:
        """The slot `mind` is in, after bringing it there; None if that has to wait for a
        busy slot."""
        self.clock += 1
        for slot, held in self.slot_mind.items():
            if held == mind:
                # Another actor may have moved it (the residency evicts idle slots under
                # their mind's name; a client's page moves): trust the slot, not our memory.
                if (await self.slots[slot].ask(Info())).mind == mind:
                    self.last_use[slot] = self.clock
                    return slot
                self.slot_mind[slot] = None
                self._note_paged(mind)
        # An idle slot, one without a mind first, then the least recently placed. With
        # every slot busy the placement waits (parked), rather than hold this mailbox.
        infos = {i: await self.slots[i].ask(Info()) for i in self.slot_mind}
        idle = [i for i, info in infos.items() if info.state == "idle" and not info.deferred]
        if not idle:
            return None
        slot = min(idle, key=lambda s: (self.slot_mind[s] is not None, self.last_use[s], s))
        old = self.slot_mind[slot]
        held_mind = infos[slot].mind
        clean = False  # an empty idle slot, not erased yet
        if held_mind is not None and infos[slot].n_tokens:
            # Whoever's it is (ours, or one a client paged in by name): it goes to its page
            # or file, never erased.
            await self._page_out(slot, held_mind)
        else:
            # An empty idle slot (its mind paged out, say) is not erased ahead of a page-in
            # or restore: libllama clears the sequence as it sets the state, and the erase's
            # engine job would wait for a step boundary of its own when other minds decode
            # (~one step of a busy turn's first-token time). A fresh start erases first.
            info = infos[slot]
            if info.n_tokens or info.n_checkpoints or info.mind is not None or info.state != "idle":
                await self.slots[slot].ask(Erase())
            else:
                clean = True
        if old is not None and old != held_mind:  # moved meanwhile (the residency pages idle slots out by name)
            self._note_paged(old)
        self.slot_mind[slot] = None
        how = await self._bring_in(slot, mind, erase_if_fresh=clean)
        self.slot_mind[slot] = mind
        self.last_use[slot] = self.clock
        log.info("mind.placed", mind=mind, slot=slot, how=how, displaced=held_mind or old)
        return slot

    async def _page_out(self, slot: int, mind: str) -> None:
        """Move `mind` out of `slot`: to its page, else (page RAM full) spill the oldest page
        this placer made to its file and try again, else save the slot to the mind's file.

        Nothing is dropped without a durable copy: a spill drops its page only once the file
        is durable, and the slot is erased only after its own save succeeded. When the disk
        refuses (full, read-only, EIO) the error goes to the request being placed and every
        mind stays where it was."""
        while True:
            try:
                await self.slots[slot].ask(PageOutSlot(page=mind))
                self._note_paged(mind)
                return
            except SlotEmpty:  # moved meanwhile (the residency evicts idle slots by name)
                self._note_paged(mind)
                return
            except PageRamExceeded:
                live = {p.page for p in await self.pages.ask(ListPages())}
                victims = [m for m in self.paged if m in live and m != mind]
                if not victims:  # nothing to spill: the slot goes straight to its file
                    await self.slots[slot].ask(SaveSlot(file=mind_file(mind)))
                    await self.slots[slot].ask(Erase())
                    self._note_paged(mind)
                    return
                victim = victims[0]
                try:
                    await self.spill(victim, mind_file(victim), True)
                except PageNotFound:  # paged in (or dropped) meanwhile: not ours to spill
                    pass
                except ActordError as e:
                    log.warning("mind.spill_failed", mind=victim, placing_for=mind, kept=True, error=e.to_dict())
                    raise
                if victim in self.paged:
                    self.paged.remove(victim)

    def _note_paged(self, mind: str) -> None:
        """`mind` was paged out (or moved by someone else) just now: the newest victim. Once
        per mind, so the list stays as long as the minds are many."""
        if mind in self.paged:
            self.paged.remove(mind)
        self.paged.append(mind)

    async def _bring_in(self, slot: int, mind: str, erase_if_fresh: bool = False) -> str:
        how = await self._bring_in_how(slot, mind)
        if how == "fresh" and erase_if_fresh:
            await self.slots[slot].ask(Erase())
        return how

    async def _bring_in_how(self, slot: int, mind: str) -> str:
        pages = {p.page: p for p in await self.pages.ask(ListPages())}
        n = pages[mind].n_tokens if mind in pages else 0
        # Asked even when the page is not listed: the slot first makes way for whatever
        # landed in it meanwhile (evict_first), whether or not the page is there.
        async with holding_room(self.scheduler, slot, n) if n else _no_room() as room:
            if room.cells < n:
                # The page stays whole in the store for a later turn; this one starts fresh
                # rather than over-commit the cache the steps in flight are counted against.
                log.info("placer.no_room_for_page", slot=slot, mind=mind, n_tokens=n)
                return "fresh"
            try:
                await self.slots[slot].ask(PageInSlot(page=mind, evict_first=True))
                if mind in self.paged:
                    self.paged.remove(mind)
                return "page_in"
            except PageNotFound:
                pass
        sig = await self.files.signature(mind_file(mind))
        if sig is not None and self.unreadable.get(mind) != sig:
            try:
                try:
                    # The file's cells held first (its header says how many), as for a page-in.
                    n = await self.files.n_tokens(mind_file(mind))
                    if n and self.kv_cells and n > self.kv_cells:
                        n = None  # larger than the whole cache: the restore refuses it, typed
                    if not n:
                        await self.slots[slot].ask(RestoreSlot(file=mind_file(mind)))
                    else:
                        async with holding_room(self.scheduler, slot, n) as room:
                            if room.cells < n:
                                log.info("placer.no_room_for_file", slot=slot, mind=mind, n_tokens=n)
                                return "fresh"
                            await self.slots[slot].ask(RestoreSlot(file=mind_file(mind)))
                except PageDoesNotFit as e:
                    if "saved" in e.data:  # another model's file: no room makes it fit
                        raise
                    # Its size is known only once read: free the whole cache, once.
                    async with holding_room(self.scheduler, slot, 1 << 30):
                        await self.slots[slot].ask(RestoreSlot(file=mind_file(mind)))
            except (CorruptPageFile, PageDoesNotFit) as e:
                if isinstance(e, PageDoesNotFit) and "saved" not in e.data:
                    raise  # whole but larger than this context: the request is refused, the file kept
                # A file that can never be restored is refused once: the mind starts fresh
                # (its next spill or save writes a new generation over it, which is tried
                # again) instead of failing every request from now on.
                self.unreadable[mind] = sig
                self.metrics.mind_files_refused_total.inc()
                log.warning("mind.file_refused", mind=mind, file=mind_file(mind), starts="fresh", error=e.to_dict())
                return "fresh"
            return "restore"
        return "fresh"
