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

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import msgspec

from actord.serving.kernel import Actor, Dispatcher, Envelope
from actord.serving.messages import (
    CancelRequest, Complete, Erase, FromBase, Msg, PageInSlot, RestoreSlot, SaveSlot, SchedulerInbox, Waiting,
)
from actord.serving.kv_index import MIN_SHARE, KvIndex
from actord.serving.start_plan import MindFound, plan_mind_step
from actord.serving.room import holding_room, no_room
from actord.serving.page_store import SpillVictim
from actord.vocabulary.errors import (
    ActordError, Cancelled, ContextFull, CorruptPageFile, FileNotFound, GenesMissing, InvalidParams, NotARegularFile,
    PageDoesNotFit, PageNotFound, PageRamExceeded,
)
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics
from actord.vocabulary.types import CompletionRequest
from actord.storage.files import PageFiles
from actord.vocabulary.names import MIND_FILE_SUFFIX, is_cache_mind

log = get("actord.placer")

VICTIM_WINDOW = 64  # the oldest pages of ours the page store chooses a spill victim among

# The system's spill of a page to its file: (page, file, drop) -> its report.
Spill = Callable[[str, str, bool], Awaitable[dict[str, Any]]]


class PlaceMind(Msg):
    """Place `req.mind` in a slot and forward the completion there (reply comes from the slot)."""

    complete: Complete


class CancelPlaced(Msg):
    """The client of request `rid` is gone: pass the cancel on to the slots, after any
    placement of it this mailbox still holds (so the cancel never overtakes the request)."""

    rid: int


class SlotState(Msg):
    """From a slot: what it is now (busy: a request runs or waits in it; the mind it
    holds), told whenever that changed in a way the placer did not make itself. `placed`
    counts the placer's forwards the slot has taken: a state sent before the newest forward
    arrived does not overrule what the placer knows since."""

    slot: int
    busy: bool
    mind: str | None
    placed: int


class Misplaced(Msg):
    """From a slot: a request forwarded as its mind's resident slot found the mind gone
    (the slot's tell of the move crossed the forward), or a fresh start found the slot busy
    with a request the placer did not place (`busy`: a slot-addressed one that arrived
    together with it); place it again."""

    slot: int
    complete: Complete
    busy: bool = False


PlacerInbox = PlaceMind | CancelPlaced | SlotState | Misplaced


@dataclass
class _Parked:
    complete: Complete
    env: Envelope[Any]


def mind_file(mind: str) -> str:
    return f"{mind}{MIND_FILE_SUFFIX}"


class MindPlacer(Actor[PlacerInbox]):
    rank = 10

    def __init__(self, dispatcher: Dispatcher, slots: Sequence[Actor[Any]], pages: Actor[Any], files: PageFiles,
                 spill: Spill, metrics: Metrics, scheduler: Actor[SchedulerInbox], index: KvIndex, *,
                 kv_cells: int = 0, n_slots: int | None = None, capacity: int = 256, share_bases: bool = False) -> None:
        super().__init__(dispatcher, "placer", capacity)
        self.slots = slots
        self.pages = pages
        self.files = files
        self.index = index  # where minds' pages and bases are, as the page store published them
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
        # The table placements read, kept by the slots' tells (SlotState) and our own moves:
        # which slots are busy, how many forwards each has taken. Where minds are (pages and
        # bases) is the index's (serving/kv_index.py): a page-in sized by a record the page
        # store replaced since is refused, typed, and sized again.
        self.busy: dict[int, bool] = {i: False for i in range(n)}
        self.forwarded: dict[int, int] = {i: 0 for i in range(n)}
        self.taken: dict[int, int] = {i: 0 for i in range(n)}
        self.share_bases = share_bases  # a new mind may start from a shared prefix's base (FromBase)
        self.fresh_start = False  # the mind just placed starts fresh, and her slot makes way as it takes her request
        self.told_waiting = 0  # the parked placements as the scheduler last heard (Waiting)

    async def handle(self, msg: PlacerInbox, env: Envelope[PlacerInbox]) -> None:
        match msg:
            case PlaceMind(complete=c):
                if not c.req.mind:
                    raise InvalidParams("no mind to place")
                self.parked.append(_Parked(c, env))
                await self._serve_parked()
            case SlotState(slot=s, busy=busy, mind=mind, placed=placed):
                self.taken[s] = placed
                if placed >= self.forwarded[s]:  # nothing of ours is on its way there
                    self.busy[s] = busy
                    if self.slot_mind[s] is not None and self.slot_mind[s] != mind:
                        self._note_paged(self.slot_mind[s])  # moved by someone else (to its page, by name)
                    self.slot_mind[s] = mind
                if self.parked and not self._busy(s):
                    await self._serve_parked()
            case Misplaced(slot=s, complete=c, busy=busy):
                self.forwarded[s] -= 1
                if busy:  # until its state says otherwise: the placement goes elsewhere
                    self.busy[s] = True
                if self.slot_mind[s] == c.req.mind:
                    self.slot_mind[s] = None
                self.parked.insert(0, _Parked(c, env))
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
        if len(self.parked) != self.told_waiting:
            # The scheduler's cue for a long generation to give its slot up (policy/yielding.py).
            self.told_waiting = len(self.parked)
            try:
                await self.scheduler.tell(Waiting(n=self.told_waiting))
            except ActordError as e:  # a cue, not an ask: a scheduler stopping misses nothing
                log.info("placer.waiting_untold", error=e.to_dict())

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
            if mind in held_back or (p.complete.yielded and held_back - {mind}):
                # (The rest of a generation that gave its slot up goes after the minds it gave way to.)
                i += 1
                continue
            try:
                placed = await self.place(mind, p.complete.req)
            except ActordError as e:
                self.parked.remove(p)
                if p.env.reply is not None:
                    p.env.reply.fail(e)
                continue
            if placed is None:
                held_back.add(mind)
                i += 1
                continue
            self.parked.remove(p)
            slot, resident = placed
            self.forwarded[slot] += 1
            self.busy[slot] = True
            c = msgspec.structs.replace(p.complete, resident=resident, fresh=not resident and self.fresh_start)
            await self.slots[slot].forward(Envelope(c, p.env.reply, p.env.stream))

    def on_crash(self, error: BaseException) -> None:
        for p in self.parked:
            if p.env.reply is not None:
                p.env.reply.fail(error)
        self.parked.clear()

    def deferred_count(self) -> int:
        return len(self.parked)

    def _busy(self, slot: int) -> bool:
        return self.busy[slot] or self.taken[slot] < self.forwarded[slot]

    async def place(self, mind: str, req: CompletionRequest | None = None) -> tuple[int, bool] | None:
        """(The slot `mind` is in, after bringing it there; whether she was there already),
        or None if that has to wait for a busy slot. Read from the table, with no ask: a
        slot that lost her meanwhile hands a resident forward back (`Misplaced`)."""
        self.clock += 1
        for slot, held in self.slot_mind.items():
            if held == mind:
                self.last_use[slot] = self.clock
                return slot, True
        # An idle slot, one without a mind first, then the least recently placed. With
        # every slot busy the placement waits (parked), rather than hold this mailbox.
        idle = [s for s in self.slot_mind if not self._busy(s)]
        if not idle:
            return None
        slot = min(idle, key=lambda s: (self.slot_mind[s] is not None, self.last_use[s], s))
        old = self.slot_mind[slot]
        self.slot_mind[slot] = None
        try:
            how = await self._bring_in(slot, mind, req, slot_mind=old is not None)
        except BaseException:
            # What the slot holds now is its to say: a move that got under way tells it
            # (SlotState, after this handler); one refused before anything moved does not.
            self.slot_mind[slot] = old
            raise
        self.slot_mind[slot] = mind
        self.last_use[slot] = self.clock
        log.info("mind.placed", mind=mind, slot=slot, how=how, displaced=old)
        return slot, False

    async def _page_room(self, slot: int, held: str | None) -> None:
        """The page RAM refused `held`'s page-out from `slot`: spill the oldest page this
        placer made to its file, else (none) save the slot to `held`'s file and erase it.

        Nothing is dropped without a durable copy: a spill drops its page only once the file
        is durable, and the slot is erased only after its own save succeeded. When the disk
        refuses (full, read-only, EIO) the error goes to the request being placed and every
        mind stays where it was."""
        # Oldest first, but a page on a base other pages share comes last: its spill frees
        # only its own part (the base stays for them), so the ceiling is met by spilling
        # fewer minds, and the prefix many minds share stays in RAM (SGLang keeps a radix
        # node's shared blocks while any leaf below uses them). The store chooses among the
        # oldest VICTIM_WINDOW at a time, so a placement costs the same at 10,000 minds as
        # at 1,000; minds of ours no longer paged are forgotten as they are met.
        victim = None
        while victim is None:
            # The prompt cache's minds first: they are the daemon's, kept for speed alone.
            window = sorted((m for m in self.paged[:VICTIM_WINDOW] if m != held), key=lambda m: not is_cache_mind(m))
            if not window:
                break
            victim = await self.pages.ask(SpillVictim(candidates=window))
            if victim is None:
                gone = set(window)
                self.paged = [m for m in self.paged if m not in gone]
        if victim is None:  # nothing to spill: the slot goes straight to its file
            if held is not None:
                await self.slots[slot].ask(SaveSlot(file=mind_file(held)))
                self._note_paged(held)
            await self.slots[slot].ask(Erase())
            return
        try:
            await self.spill(victim, mind_file(victim), True)
        except PageNotFound:  # paged in (or dropped) meanwhile: not ours to spill
            pass
        except ActordError as e:
            log.warning("mind.spill_failed", mind=victim, placing_for=held, kept=True, error=e.to_dict())
            raise
        if victim in self.paged:
            self.paged.remove(victim)

    def _note_paged(self, mind: str) -> None:
        """`mind` was paged out (or moved by someone else) just now: the newest victim. Once
        per mind, so the list stays as long as the minds are many."""
        if mind in self.paged:
            self.paged.remove(mind)
        self.paged.append(mind)

    async def _bring_in(self, slot: int, mind: str, req: CompletionRequest | None, *, slot_mind: bool) -> str:
        """Bring `mind` into `slot` by the start plan (serving/start_plan.py `plan_mind_step`):
        each step carried out, and what it taught (a page gone, no room for it, a file
        refused, a base made by the slot's own page-out) planned over again. How she came."""
        self.fresh_start = False
        found = await self._find(mind, req, slot_mind=slot_mind)
        while True:
            step = plan_mind_step(found)
            match step.how:
                case "page_in":
                    after = await self._page_in(slot, mind, found, req)
                    if after is None:
                        return "page_in"
                    found = after
                case "make_way":
                    n_base = await self._make_way(slot)
                    found = msgspec.structs.replace(found, made_way=True,
                                                    base=max(found.base, n_base if self._bases_for(req) else 0))
                case "restore":
                    if await self._restore(slot, mind):
                        return "restore"
                    found = msgspec.structs.replace(found, file=False)
                case "base":
                    assert req is not None  # a base is found only for a prompt
                    if await self._from_base(slot, req):
                        return "base"
                    found = msgspec.structs.replace(found, base=0)
                case "fresh":
                    self.fresh_start = step.slot_clears  # else the slot made way: it is empty
                    return "fresh"

    def _bases_for(self, req: CompletionRequest | None) -> list[int] | None:
        """The prompt a base may begin (its tokens), or None: bases off, or no token prompt."""
        ok = self.share_bases and req is not None and isinstance(req.prompt, list) and len(req.prompt) > MIN_SHARE
        return req.prompt if ok else None  # type: ignore[union-attr, return-value]

    async def _find(self, mind: str, req: CompletionRequest | None, *, slot_mind: bool = True,
                    made_way: bool = False) -> MindFound:
        """What the places that may hold her say, from the index (serving/kv_index.py: her
        page's size, a base in page RAM or a base file that begins her prompt), with no
        delivery; whether her page file is there, from one look on a disk worker."""
        prompt = self._bases_for(req)
        n_page = self.index.page_tokens(mind)
        base = 0
        if n_page is None and prompt is not None and req is not None:
            scope = req.kv_scope()
            base = self.index.base_for(prompt, scope)
            if base < MIN_SHARE:
                on_file = self.index.base_file_for(prompt, scope)
                base = on_file[1] if on_file is not None else 0
        file = False
        if n_page is None:
            sig = await self.files.signature(mind_file(mind))
            file = sig is not None and self.unreadable.get(mind) != sig
        return MindFound(page=n_page, file=file, base=base, slot_mind=slot_mind, made_way=made_way)

    async def _from_base(self, slot: int, req: CompletionRequest) -> int:
        """A new mind whose prompt (tokens) begins with a shared prefix that page RAM holds
        as a base starts from it (FromBase), with the cells held for it first, out of what
        is free now (no mind is evicted for it: the prompt's own prefill would take them
        anyway). The tokens it starts from; 0 when it prefills (or shares a slot's cells)."""
        prompt = req.prompt
        if not self.share_bases or not isinstance(prompt, list) or len(prompt) <= MIN_SHARE:
            return 0
        n = len(prompt)
        try:
            async with holding_room(self.scheduler, slot, n, evict=False) as room:
                if room.cells < n:
                    return 0
                took: int = await self.slots[slot].ask(FromBase(req=req, room=room.token))
                room.handed_over = True
                return took
        except ActordError as e:  # the mind starts as any new one does
            log.info("placer.from_base_failed", slot=slot, error=e.to_dict())
            return 0

    async def _page_in(self, slot: int, mind: str, found: MindFound, req: CompletionRequest | None) -> MindFound | None:
        """Page `mind` in (`found.page` tokens), the slot's own mind paged out first in the
        same message: None once she is in, else what is known now. The cells are held by
        `holding_room` and handed back by the slot's one Cells tell at the end of the move.
        A refusal after the slot's page-out leaves the slot empty (`made_way`)."""
        n, resized = found.page or 0, False
        while True:
            async with holding_room(self.scheduler, slot, n) if n else no_room() as room:
                if room.cells < n:
                    # The page stays whole in the store for a later turn; this one does
                    # without it rather than over-commit the cache the steps in flight are
                    # counted against.
                    log.info("placer.no_room_for_page", slot=slot, mind=mind, n_tokens=n)
                    return msgspec.structs.replace(found, page=None)
                try:
                    out = await self.slots[slot].ask(PageInSlot(
                        page=mind, evict_first=True, room=room.token, room_cells=n if n else -1))
                    room.handed_over = True
                    self._evicted(out.get("evicted"))
                    if mind in self.paged:
                        self.paged.remove(mind)
                    return None
                except PageNotFound as e:  # paged in or dropped meanwhile: where else is she?
                    room.handed_over = True
                    n_base = self._evicted(e.data.get("evicted"))
                    after = await self._find(mind, req, slot_mind=found.slot_mind, made_way=True)
                    return msgspec.structs.replace(after, base=max(after.base, n_base if self._bases_for(req) else 0))
                except PageRamExceeded as e:  # nothing moved: make page RAM and ask again
                    room.handed_over = True
                    await self._page_room(slot, e.data.get("mind"))
                except ContextFull as e:
                    room.handed_over = True
                    self._evicted(e.data.get("evicted"))
                    if "held" not in e.data or resized:
                        raise
                    resized = True  # sized by an older page of hers: size it again
                    found = await self._find(mind, req, slot_mind=found.slot_mind, made_way=True)
                    if found.page is None:
                        return found
                    n = found.page

    async def _make_way(self, slot: int) -> int:
        """The slot's mind goes to her page (its sequence, with no mind, is dropped): the
        tokens of a base her page stands on (0: none, or no mind)."""
        while True:
            try:
                out = await self.slots[slot].ask(PageInSlot(page="", evict_first=True))
            except PageRamExceeded as e:
                await self._page_room(slot, e.data.get("mind"))
                continue
            return self._evicted(out.get("evicted"))

    def _evicted(self, ev: dict[str, Any] | None) -> int:
        """Note the mind the slot paged out (if any); the tokens of the base her page stands on."""
        if not ev:
            return 0
        self._note_paged(ev["mind"])
        return int(ev.get("n_base", 0))

    async def _file_cells(self, file: str) -> int | None:
        """The cells page file `file` needs, from its header (None: no header to read); one
        larger than the whole cache is refused here, typed, and kept."""
        n = await self.files.n_tokens(file)
        if n and self.kv_cells and n > self.kv_cells:
            raise PageDoesNotFit(f"page file {file} holds {n} tokens, more than this context's {self.kv_cells} "
                                 "cells", file=file, n_tokens=n, n_cells=self.kv_cells)
        return n

    async def _restore(self, slot: int, mind: str) -> bool:
        """Restore `mind` from her page file: False where the file can never be restored
        (corrupt, another model's, not a file): refused once, so she starts another way."""
        file = mind_file(mind)
        try:
            try:
                for again in (False, True):
                    # The file's cells held first (its header says how many), as for a page-in.
                    n = await self._file_cells(file)
                    try:
                        if not n:
                            # No header to size it by: a file that turns out to hold cells
                            # (written since) is refused before anything moves, and sized again.
                            await self.slots[slot].ask(RestoreSlot(file=file, room_cells=0))
                            break
                        async with holding_room(self.scheduler, slot, n) as room:
                            if room.cells < n:
                                log.info("placer.no_room_for_file", slot=slot, mind=mind, n_tokens=n)
                                return False
                            await self.slots[slot].ask(RestoreSlot(file=file, room_cells=n))
                            break
                    except ContextFull as e:
                        if "held" not in e.data or again:
                            raise
            except PageDoesNotFit as e:
                if "saved" in e.data or "n_cells" in e.data:  # another model's, or larger than the cache
                    raise
                # Its size is known only once read: free the whole cache, once.
                async with holding_room(self.scheduler, slot, 1 << 30):
                    await self.slots[slot].ask(RestoreSlot(file=file))
        except FileNotFound:
            # Gone since it was looked at: the disk budget may evict it to make room for the
            # very page-out that made way for her. She starts another way.
            log.info("mind.file_gone", mind=mind, file=file)
            return False
        except GenesMissing as e:
            # Her state was computed under a gene not loaded now: no request this daemon can
            # serve now shares that lineage (each request's genes are loaded), so she starts
            # another way; her file stays, for when that gene is loaded again.
            log.info("mind.file_genes_missing", mind=mind, file=file, starts="another way", error=e.to_dict())
            return False
        except (CorruptPageFile, PageDoesNotFit, NotARegularFile) as e:
            if isinstance(e, PageDoesNotFit) and "saved" not in e.data:
                raise  # whole but larger than this context: the request is refused, the file kept
            # A file that can never be restored is refused once: the mind starts another way
            # (her next spill or save writes a new generation over it, which is tried again)
            # instead of failing every request from now on.
            sig = await self.files.signature(file)
            if sig is not None:
                self.unreadable[mind] = sig
            self.metrics.mind_files_refused_total.inc()
            log.warning("mind.file_refused", mind=mind, file=file, starts="another way", error=e.to_dict())
            return False
        return True
