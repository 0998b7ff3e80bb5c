"""GeneResidency: which genes hold device memory, decided in one place.

The engine moves bytes (GeneCatalog); this actor decides when. It mirrors the catalog
(resident, n_bytes, last two uses) and the slots' device footprint, and applies the pure
policy in `actord.policy.residency` under one budget (`--device-bytes`). A request applying
genes `Acquire`s them first: host-resident ones page in on the request's own path (a counted
miss), and from then until `Finish` they are in use, so no move can free them under a
decode. After each turn a coalesced `Reconcile` pages pinned host genes back in, off the
request path.

Its place in the ask order (serving/kernel/) is below the slots, so it never awaits one: an
acquisition is told, not asked, and answered by telling the slot `GenesGranted` or
`GenesRefused`. When room needs an idle slot's state, the residency tells that slot to
`Evict` and keeps the acquisition (or the gene load, or page-in) pending; the slot tells
back `EvictDone` and the pending work is planned again. Work that cannot fit now waits
while something can still change (an eviction under way, a running request that will end
and become evictable); otherwise it is refused with `DeviceBudgetExceeded`, and so is work
that could not fit even with every other slot evicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from actord.serving.kernel import Actor, Dispatcher, Envelope
from actord.serving.messages import Evict, GenesGranted, GenesRefused, Msg
from actord.engine import jobs as J
from actord.vocabulary.errors import ActordError, DeviceBudgetExceeded, GeneInUse, GeneIsDefault, GeneNotFound, InvalidParams
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics
from actord.policy.residency import GeneView, SlotView, plan_room, record_use

log = get("actord.genes")


class LoadGene(Msg):
    path: str
    image: bytes
    default: bool = False


class UnloadGene(Msg):
    id: int


class PageOutGene(Msg):
    id: int


class PageInGene(Msg):
    id: int


class ListGenes(Msg):
    pass


class Acquire(Msg):
    """A slot's request applies `genes`: answered by telling the slot GenesGranted/Refused."""

    slot: int
    genes: tuple[tuple[int, float], ...]
    ticket: int = 0


class Finish(Msg):
    slot: int
    n_bytes: int  # the slot's state size after the turn


class SlotFootprint(Msg):
    slot: int
    n_bytes: int


class Reconcile(Msg):
    pass


class EvictDone(Msg):
    """A slot told to Evict is done (freed) or refused (it had work meanwhile)."""

    slot: int
    freed: bool
    kept: bool = False  # refused because the state had no durable place to go (not: busy)


GeneInbox = (
    LoadGene | UnloadGene | PageOutGene | PageInGene | ListGenes | Acquire | Finish | SlotFootprint | Reconcile
    | EvictDone
)


@dataclass
class _WaitingForRoom:
    """Work waiting for device room: an acquisition, a gene load or a gene page-in."""

    kind: str  # "acquire" | "load" | "page_in"
    protect: set[int]  # genes this work needs on device (never paged out for it)
    slot: int | None = None
    ticket: int = 0
    env: Envelope[Any] | None = None
    msg: Any = None


_DEFERRED = object()  # a handler's reply will be sent later, by the pending work


class GeneRecord(msgspec.Struct):
    id: int
    path: str
    n_bytes: int
    resident: bool
    default: bool = False
    uses: tuple[int, ...] = ()
    digest: str = ""  # its file's content digest (J.GeneInfo.digest)


class GeneResidency(Actor[GeneInbox]):
    rank = 40

    def __init__(self, dispatcher: Dispatcher, engine: Any, slots: Sequence[Actor[Any]], budget: int,
                 metrics: Metrics, capacity: int = 256) -> None:
        super().__init__(dispatcher, "genes", capacity)
        self.engine = engine
        self.slots = slots
        self.budget = budget
        self.metrics = metrics
        self.genes: dict[int, GeneRecord] = {}
        self.slot_genes: dict[int, tuple[tuple[int, float], ...]] = {}  # current set per slot
        self.processing: dict[int, set[int]] = {}  # slot -> genes in use
        self.slot_bytes: dict[int, int] = {}
        self.slot_use: dict[int, int] = {}
        self.clock = 0
        self._reconcile_queued = False
        self.pending: list[_WaitingForRoom] = []
        self.running: set[int] = set()  # slots granted their genes, until Finish
        self.evicting: set[int] = set()  # slots told to Evict, until EvictDone
        # Slots that refused an eviction (a mind whose state had no durable place to go):
        # not asked again until their state changes (a turn ends, a page move) or new work
        # arrives (the disk may be back), or room would be planned on them again and again.
        self.kept: set[int] = set()

    # -- views for the policy ----------------------------------------------------------

    def pinned(self, waiting: set[int] | frozenset[int] = frozenset()) -> set[int]:
        """Genes in some slot's current set, and default genes. The sets of slots still
        `waiting` for an acquisition do not pin: their genes are not in use yet, and two
        waiting acquisitions must not hold each other's room."""
        return {gid for s, gs in self.slot_genes.items() if s not in waiting for gid, _ in gs} | {
            g.id for g in self.genes.values() if g.default
        }

    def in_use(self) -> set[int]:
        """Genes a running (granted) request applies: never paged out under it."""
        return {gid for s in self.running for gid in self.processing.get(s, ())}

    def waiting_slots(self, but: "_WaitingForRoom | None" = None) -> set[int]:
        return {q.slot for q in self.pending if q.kind == "acquire" and q is not but}  # type: ignore[misc]

    def views(self, for_slot: int | None = None) -> tuple[list[GeneView], list[SlotView]]:
        """The policy's view. Only running slots (and the one being served) are untouchable:
        a slot still waiting for its genes has a quiet sequence, which it can give up."""
        gv = [GeneView(id=g.id, n_bytes=g.n_bytes, resident=g.resident, uses=g.uses) for g in self.genes.values()]
        sv = [SlotView(id=s, n_bytes=n, processing=s in self.running or s == for_slot or s in self.kept,
                       last_use=self.slot_use.get(s, 0))
              for s, n in self.slot_bytes.items()]
        return gv, sv

    def device_bytes(self) -> int:
        gv, sv = self.views()
        return sum(g.n_bytes for g in gv if g.resident) + sum(s.n_bytes for s in sv)

    # -- dispatch ----------------------------------------------------------------------

    async def handle(self, msg: GeneInbox, env: Envelope[GeneInbox]) -> None:
        out: Any = None
        # New work may find the disk back: slots that refused an eviction may be asked again.
        retry_kept = bool(self.kept) and isinstance(msg, (LoadGene, PageInGene, Acquire))
        if retry_kept:
            self.kept.clear()
        match msg:
            case LoadGene():
                self.pending.append(_WaitingForRoom("load", protect=set(), env=env, msg=msg))
                out = _DEFERRED
            case UnloadGene(id=gid):
                self._refuse_busy(gid, "unload")
                out = await self.engine.run(J.GeneUnload(id=gid))
                del self.genes[gid]
                log.info("gene.unloaded", id=gid)
            case PageOutGene(id=gid):
                self._refuse_busy(gid, "page out")
                out = await self._page_out(gid)
            case PageInGene(id=gid):
                self._get(gid)
                self.pending.append(_WaitingForRoom("page_in", protect={gid}, env=env, msg=msg))
                out = _DEFERRED
            case ListGenes():
                out = await self.engine.run(J.GeneList())
            case Acquire(slot=slot, genes=genes, ticket=ticket):
                await self._acquire(slot, genes, ticket)
            case Finish(slot=slot, n_bytes=n):
                self.kept.discard(slot)
                self.processing.pop(slot, None)
                self.running.discard(slot)
                # An acquisition still pending for this slot was withdrawn (cancelled).
                self.pending = [p for p in self.pending if not (p.kind == "acquire" and p.slot == slot)]
                self.slot_bytes[slot] = n
                await self._shrink_to_budget()
                self._queue_reconcile()
            case SlotFootprint(slot=slot, n_bytes=n):
                self.kept.discard(slot)
                grew = n > self.slot_bytes.get(slot, 0)
                self.slot_bytes[slot] = n
                if n == 0:
                    self.slot_genes.pop(slot, None)
                elif grew:  # a page-in or restore: the newest state, and it may need room
                    self.clock += 1
                    self.slot_use[slot] = self.clock
                    await self._shrink_to_budget()
            case EvictDone(slot=slot, freed=freed, kept=kept):
                self.evicting.discard(slot)
                if kept:
                    self.kept.add(slot)
                # Still over (a growth the eviction did not cover)? Go on, but only once the
                # slot's state is gone from our view, or the slot refused to go (it is kept
                # now, so the next plan passes it over): never tell one slot again and again.
                if (freed and not self.slot_bytes.get(slot, 0)) or kept:
                    await self._shrink_to_budget()
            case Reconcile():
                self._reconcile_queued = False
                await self._reconcile()
            case _:
                raise InvalidParams(f"gene residency cannot handle {type(msg).__name__}")
        await self._serve()
        if retry_kept and not self.evicting:
            await self._shrink_to_budget()  # what the kept slots held still counts
        self._publish()
        if env.reply is not None and out is not _DEFERRED:
            env.reply.send(out)

    def _get(self, gid: int) -> GeneRecord:
        g = self.genes.get(gid)
        if g is None:
            self.metrics.lora_page_failed_total.inc()
            log.debug("gene.refused", id=gid, reason="unknown")
            raise GeneNotFound(f"no gene {gid}", id=gid)
        return g

    def _refuse_busy(self, gid: int, verb: str) -> None:
        g = self._get(gid)
        if g.default:
            log.debug("gene.refused", id=gid, reason="default", verb=verb)
            raise GeneIsDefault(f"gene {gid} is active by default; cannot {verb}", id=gid)
        users = sorted(s for s, gs in self.processing.items() if gid in gs)
        if users:
            log.debug("gene.refused", id=gid, reason="in_use", verb=verb, slots=users)
            raise GeneInUse(f"gene {gid} is applied by processing slot(s) {users}", id=gid, slots=users)

    async def _page_out(self, gid: int) -> J.GeneInfo:
        g = self.genes[gid]
        info: J.GeneInfo = await self.engine.run(J.GenePageOut(id=gid))
        if g.resident:
            self.metrics.lora_page_out_total.inc()
            log.info("gene.page_out", id=gid, n_bytes=g.n_bytes, t_ms=round(info.t_ms, 3))
        g.resident = False
        return info

    async def _page_in(self, gid: int, *, on_demand: bool) -> J.GeneInfo:
        g = self.genes[gid]
        try:
            info: J.GeneInfo = await self.engine.run(J.GenePageIn(id=gid))
        except Exception:
            self.metrics.lora_page_failed_total.inc()
            raise
        if not g.resident:
            self.metrics.lora_page_in_total.inc()
            if on_demand:
                self.metrics.lora_page_in_on_demand_total.inc()
            log.info("gene.page_in", id=gid, n_bytes=g.n_bytes, t_ms=round(info.t_ms, 3), on_demand=on_demand)
        g.resident = True
        return info

    # -- pending work: plan, evict by telling, grant or refuse ---------------------------

    async def _acquire(self, slot: int, genes: tuple[tuple[int, float], ...], ticket: int) -> None:
        missing = [gid for gid, _ in genes if gid not in self.genes]
        if missing:
            self.metrics.lora_page_failed_total.inc()
            log.debug("gene.refused", ids=missing, reason="unknown", slot=slot)
            await self.slots[slot].tell(GenesRefused(ticket=ticket, error_type="GeneNotFound",
                                                     message=f"no gene {missing[0]}"))
            return
        self.clock += 1
        ids = {gid for gid, _ in genes}
        self.processing[slot] = ids  # in use from now: nothing frees them until Finish
        self.slot_genes[slot] = genes
        self.slot_use[slot] = self.clock
        for gid in sorted(ids):
            self.genes[gid].uses = record_use(self.genes[gid].uses, self.clock)
        self.pending.append(_WaitingForRoom("acquire", protect=ids, slot=slot, ticket=ticket))

    def _need(self, p: _WaitingForRoom) -> int:
        if p.kind == "load":
            return len(p.msg.image)
        return sum(self.genes[g].n_bytes for g in p.protect if g in self.genes and not self.genes[g].resident)

    async def _serve(self) -> None:
        """Plan every pending work item again until none makes progress."""
        progress = True
        while progress and self.pending:
            progress = False
            for p in list(self.pending):
                if p in self.pending and await self._try(p):
                    self.pending.remove(p)
                    progress = True

    async def _try(self, p: _WaitingForRoom) -> bool:
        """True when `p` is answered (granted, done or refused); False while it waits."""
        if p.kind == "page_in" and (p.msg.id not in self.genes):
            await self._refuse(p, GeneNotFound(f"no gene {p.msg.id}", id=p.msg.id))
            return True
        if p.kind == "acquire" and any(g not in self.genes for g in p.protect):
            gone = sorted(g for g in p.protect if g not in self.genes)
            await self._refuse(p, GeneNotFound(f"no gene {gone[0]}", id=gone[0]))
            return True
        need = self._need(p)
        plan = self._plan(p, need, evict_waiting=False)
        if not plan.fits and not (self.evicting or self.running - {p.slot}):
            # Nothing will end or move by itself: slots still waiting for their genes give
            # up their quiet sequences (coldest first), and idle slots' genes their pins,
            # rather than hold each other's room.
            plan = self._plan(p, need, evict_waiting=True)
        if plan.fits and not plan.slots:
            for gid in plan.genes:
                await self._page_out(gid)
            try:
                await self._complete(p)
            except ActordError as e:
                await self._refuse(p, e, counted=True)
            return True
        if plan.fits:
            await self._tell_evict(plan.slots, need)
            return False
        if self.evicting or self.running - {p.slot}:
            return False  # an eviction under way or a running request's end can make the room
        await self._refuse(p, DeviceBudgetExceeded(f"{need} more device bytes do not fit the budget",
                                                   need=need, budget=self.budget, used=self.device_bytes()))
        return True

    def _plan(self, p: _WaitingForRoom, need: int, evict_waiting: bool) -> Any:
        gv, sv = self.views(for_slot=p.slot)
        waiting = self.waiting_slots(but=p)
        if not evict_waiting:
            sv = [msgspec.structs.replace(v, processing=True) if v.id in waiting else v for v in sv]
            unpinned = waiting
        else:
            # The last resort, or the work is refused: only running requests pin. An idle
            # mind's gene pages back in on its next turn; a refusal costs a request.
            unpinned = set(self.slot_genes) - self.running
        return plan_room(need, self.budget, gv, sv, protected_genes=p.protect | self.in_use(),
                         pinned=self.pinned(unpinned) - p.protect)

    async def _complete(self, p: _WaitingForRoom) -> None:
        if p.kind == "acquire":
            paged_in = []
            for gid in sorted(p.protect):
                if not self.genes[gid].resident:
                    await self._page_in(gid, on_demand=True)
                    paged_in.append(gid)
            self.running.add(p.slot)  # type: ignore[arg-type]
            digests = {gid: self.genes[gid].digest for gid in p.protect if gid in self.genes}
            await self.slots[p.slot].tell(GenesGranted(ticket=p.ticket, paged_in=paged_in,  # type: ignore[index]
                                                       digests=digests))
            return
        if p.kind == "load":
            m: LoadGene = p.msg
            info: J.GeneInfo = await self.engine.run(J.GeneLoad(path=m.path, image=m.image))
            self.genes[info.id] = GeneRecord(id=info.id, path=m.path, n_bytes=info.n_bytes, resident=True,
                                             default=m.default, digest=info.digest)
            log.info("gene.loaded", id=info.id, path=m.path, n_bytes=info.n_bytes, t_ms=round(info.t_ms, 3))
            out: Any = info
        else:
            out = await self._page_in(p.msg.id, on_demand=False)
        if p.env is not None and p.env.reply is not None:
            p.env.reply.send(out)

    async def _refuse(self, p: _WaitingForRoom, error: ActordError, counted: bool = False) -> None:
        if not counted:
            self.metrics.lora_page_failed_total.inc()
        log.warning("gene.no_room" if isinstance(error, DeviceBudgetExceeded) else "gene.refused",
                    kind=p.kind, slot=p.slot, error=error.to_dict())
        if p.kind == "acquire":
            self.processing.pop(p.slot, None)  # type: ignore[arg-type]
            await self.slots[p.slot].tell(GenesRefused(ticket=p.ticket, error_type=error.type,  # type: ignore[index]
                                                       message=error.message))
        elif p.env is not None and p.env.reply is not None:
            p.env.reply.fail(error)

    def on_crash(self, error: BaseException) -> None:
        """Nothing waits for us in vain: pending replies fail, waiting slots are refused."""
        for p in self.pending:
            if p.env is not None and p.env.reply is not None:
                p.env.reply.fail(error)
            elif p.kind == "acquire":
                try:
                    self.slots[p.slot].tell_nowait(GenesRefused(  # type: ignore[index]
                        ticket=p.ticket, error_type="ActorFailed", message=str(error)))
                except Exception:  # noqa: BLE001 - a stopped or full slot: it is failing too
                    pass
        self.pending.clear()

    async def _shrink_to_budget(self) -> None:
        """Slots grew past the budget during a turn: cold unpinned genes go first, then idle
        slots (coldest first) are told to evict."""
        if not self.budget or self.device_bytes() <= self.budget:
            return
        gv, sv = self.views()
        plan = plan_room(0, self.budget, gv, sv, protected_genes=self.in_use(),
                         pinned=self.pinned(self.waiting_slots()))
        for gid in plan.genes:
            await self._page_out(gid)
        await self._tell_evict(plan.slots, 0)

    async def _tell_evict(self, sids: list[int], need: int) -> None:
        """Tell idle slots to give up their state; each once, until it answers EvictDone."""
        for sid in sids:
            if sid not in self.evicting:
                self.evicting.add(sid)
                log.info("slot.evict_for_room", slot=sid, n_bytes=self.slot_bytes.get(sid, 0), need=need)
                await self.slots[sid].tell(Evict(reason="device"))

    def _queue_reconcile(self) -> None:
        if not self._reconcile_queued:
            self._reconcile_queued = True
            self.tell_nowait(Reconcile())

    async def _reconcile(self) -> None:
        """Page pinned host genes back in while they fit without evicting anything."""
        for gid in sorted(self.pinned()):
            g = self.genes.get(gid)
            if g is None or g.resident:
                continue
            if self.budget and self.device_bytes() + g.n_bytes > self.budget:
                continue
            await self._page_in(gid, on_demand=False)

    def _publish(self) -> None:
        self.metrics.lora_device_bytes.set(sum(g.n_bytes for g in self.genes.values() if g.resident))
        self.metrics.lora_host_bytes.set(sum(g.n_bytes for g in self.genes.values()))
