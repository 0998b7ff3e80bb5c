"""GeneResidency: which genes hold device memory, decided in one place.

The engine moves bytes (GeneCatalog); this actor decides when. It mirrors the catalog
(resident, n_bytes, last two uses) and the slots' device footprint, and applies the pure
policy in `actord.policy.residency` under one budget (`--device-bytes`). A request applying
genes `Acquire`s them first: host-resident ones page in on the request's own path (a counted
miss), and from then until `Finish` they are in use, so no move can free them under a
decode. After each turn a coalesced `Reconcile` pages pinned host genes back in, off the
request path.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.actors.base import Actor, Dispatcher, Envelope
from actord.actors.messages import Msg, PageOutSlot
from actord.engine import jobs as J
from actord.errors import ActordError, DeviceBudgetExceeded, GeneInUse, GeneIsDefault, GeneNotFound, InvalidParams
from actord.log import get
from actord.metrics import Metrics
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
    slot: int
    genes: tuple[tuple[int, float], ...]


class Finish(Msg):
    slot: int
    n_bytes: int  # the slot's state size after the turn


class SlotFootprint(Msg):
    slot: int
    n_bytes: int


class Reconcile(Msg):
    pass


GeneInbox = LoadGene | UnloadGene | PageOutGene | PageInGene | ListGenes | Acquire | Finish | SlotFootprint | Reconcile


class GeneRecord(msgspec.Struct):
    id: int
    path: str
    n_bytes: int
    resident: bool
    default: bool = False
    uses: tuple[int, ...] = ()


class GeneResidency(Actor[GeneInbox]):
    def __init__(self, dispatcher: Dispatcher, engine: Any, slots: list[Actor[Any]], budget: int,
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

    # -- views for the policy ----------------------------------------------------------

    def pinned(self) -> set[int]:
        return {gid for gs in self.slot_genes.values() for gid, _ in gs} | {
            g.id for g in self.genes.values() if g.default
        }

    def in_use(self) -> set[int]:
        return {gid for gs in self.processing.values() for gid in gs}

    def views(self) -> tuple[list[GeneView], list[SlotView]]:
        gv = [GeneView(id=g.id, n_bytes=g.n_bytes, resident=g.resident, uses=g.uses) for g in self.genes.values()]
        sv = [SlotView(id=s, n_bytes=n, processing=s in self.processing, last_use=self.slot_use.get(s, 0))
              for s, n in self.slot_bytes.items()]
        return gv, sv

    def device_bytes(self) -> int:
        gv, sv = self.views()
        return sum(g.n_bytes for g in gv if g.resident) + sum(s.n_bytes for s in sv)

    # -- dispatch ----------------------------------------------------------------------

    async def handle(self, msg: GeneInbox, env: Envelope[GeneInbox]) -> None:
        out: Any = None
        match msg:
            case LoadGene(path=path, image=image, default=default):
                await self._make_room(len(image), protect=set())
                info: J.GeneInfo = await self.engine.run(J.GeneLoad(path=path, image=image))
                self.genes[info.id] = GeneRecord(id=info.id, path=path, n_bytes=info.n_bytes, resident=True, default=default)
                log.info("gene.loaded", id=info.id, path=path, n_bytes=info.n_bytes, t_ms=round(info.t_ms, 3))
                out = info
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
                await self._make_room(self.genes[gid].n_bytes, protect={gid}, skip_if_resident=gid)
                out = await self._page_in(gid, on_demand=False)
            case ListGenes():
                out = await self.engine.run(J.GeneList())
            case Acquire(slot=slot, genes=genes):
                out = await self._acquire(slot, genes)
            case Finish(slot=slot, n_bytes=n):
                self.processing.pop(slot, None)
                self.slot_bytes[slot] = n
                await self._shrink_to_budget()
                self._queue_reconcile()
            case SlotFootprint(slot=slot, n_bytes=n):
                self.slot_bytes[slot] = n
                if n == 0:
                    self.slot_genes.pop(slot, None)
            case Reconcile():
                self._reconcile_queued = False
                await self._reconcile()
            case _:
                raise InvalidParams(f"gene residency cannot handle {type(msg).__name__}")
        self._publish()
        if env.reply is not None:
            env.reply.send(out)

    def _get(self, gid: int) -> GeneRecord:
        g = self.genes.get(gid)
        if g is None:
            self.metrics.lora_page_failed_total.inc()
            log.warning("gene.refused", id=gid, reason="unknown")
            raise GeneNotFound(f"no gene {gid}", id=gid)
        return g

    def _refuse_busy(self, gid: int, verb: str) -> None:
        g = self._get(gid)
        if g.default:
            log.warning("gene.refused", id=gid, reason="default", verb=verb)
            raise GeneIsDefault(f"gene {gid} is active by default; cannot {verb}", id=gid)
        users = sorted(s for s, gs in self.processing.items() if gid in gs)
        if users:
            log.warning("gene.refused", id=gid, reason="in_use", verb=verb, slots=users)
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

    async def _make_room(self, need: int, protect: set[int], skip_if_resident: int | None = None) -> None:
        if skip_if_resident is not None and self.genes[skip_if_resident].resident:
            return
        gv, sv = self.views()
        plan = plan_room(need, self.budget, gv, sv, protected_genes=protect | self.in_use(), pinned=self.pinned() - protect)
        if not plan.fits:
            self.metrics.lora_page_failed_total.inc()
            log.warning("gene.no_room", need=need, budget=self.budget, used=self.device_bytes())
            raise DeviceBudgetExceeded(f"{need} more device bytes do not fit the budget", need=need, budget=self.budget)
        for gid in plan.genes:
            await self._page_out(gid)
        for sid in plan.slots:
            log.info("slot.evicted_for_room", slot=sid, n_bytes=self.slot_bytes.get(sid, 0))
            try:
                await self.slots[sid].ask(PageOutSlot(page=""))  # under the slot's mind name
            except ActordError as e:  # e.g. the page store is full: this room is not to be had
                self.metrics.lora_page_failed_total.inc()
                log.warning("gene.no_room", need=need, slot=sid, error=e.to_dict())
                raise DeviceBudgetExceeded(f"{need} more device bytes do not fit the budget",
                                           need=need, budget=self.budget) from None
            self.slot_bytes[sid] = 0
            self.slot_genes.pop(sid, None)

    async def _acquire(self, slot: int, genes: tuple[tuple[int, float], ...]) -> list[int]:
        for gid, _ in genes:
            self._get(gid)
        self.clock += 1
        ids = {gid for gid, _ in genes}
        self.processing[slot] = ids  # in use from now: nothing frees them until Finish
        self.slot_genes[slot] = genes
        self.slot_use[slot] = self.clock
        paged_in = []
        try:
            for gid in sorted(ids):
                g = self.genes[gid]
                g.uses = record_use(g.uses, self.clock)
                if not g.resident:
                    await self._make_room(g.n_bytes, protect=ids)
                    await self._page_in(gid, on_demand=True)
                    paged_in.append(gid)
        except BaseException:
            self.processing.pop(slot, None)
            raise
        return paged_in

    async def _shrink_to_budget(self) -> None:
        """Slots grew past the budget: cold unpinned genes make room (never a slot here)."""
        if not self.budget or self.device_bytes() <= self.budget:
            return
        gv, sv = self.views()
        plan = plan_room(0, self.budget, gv, sv, protected_genes=self.in_use(), pinned=self.pinned())
        over = self.device_bytes() - self.budget
        for gid in plan.genes:
            if over <= 0:
                break
            await self._page_out(gid)
            over -= self.genes[gid].n_bytes

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
