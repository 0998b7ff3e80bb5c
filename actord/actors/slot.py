"""A Slot actor: one llama sequence id, its request lifecycle and what its memory holds.

The slot owns `kv_tokens` (exactly the tokens whose KV sit in its sequence, in order),
`resume_raw_lcp` (the raw longest common prefix its current request found, before any
fallback; reset per request, on page-in/restore and on erase) and, for models that need
them, its context checkpoints. It never touches libllama: it sends jobs to the engine and
enrols prompt work with the Scheduler, which feeds its step results back as messages.

A request for a busy slot is deferred (kept in order, counted) and started when the slot is
idle again; so are page and file operations, which need a quiet sequence.

Its place in the ask order (actors/base.py): below the placer and the scheduler, above the
page store, the checkpoint budget and the gene residency. So a request's genes are not
asked for: the slot tells `Acquire` and carries on reading its mailbox; the residency
answers with `GenesGranted` (or `GenesRefused`) when the genes are on device, after
telling idle slots to `Evict` if it needed their room. A slot waiting for its genes is
busy: it defers page moves and requests, refuses evictions and handles a cancel at once.
"""

from __future__ import annotations

import codecs
import collections
import time

import anyio
from dataclasses import dataclass, field
from typing import Any, Callable

from actord.actors.base import Actor, Dispatcher, Envelope, Reply
from actord.actors.messages import (
    CancelRequest, Cells, Complete, DropCheckpoint, Enroll, Erase, Evict, GenesGranted, GenesRefused, Info,
    NoRoom, PageInSlot, PageOutSlot, RestoreSlot, SaveSlot, SlotInbox, SlotNext, StepFailed, StepResult,
)
from actord.api import CompletionRequest, CompletionResult, GeneRef, SlotInfo, Timings
from actord.engine import jobs as J
from actord.actors.checkpoints import AdmitCheckpoint, Decision, SlotCheckpoints
from actord.actors.genes import Acquire as GeneAcquire, EvictDone, Finish as GeneFinish, SlotFootprint
from actord.actors.pages import (
    Admit, CancelReservation, Commit, Page, PageCheckpoint, Release, Return, Take,
)
from actord.errors import (
    ActordError, Cancelled, ContextFull, EngineError, InvalidParams, PageDoesNotFit, PageRamExceeded, PromptTooLong,
    SlotBusy, SlotEmpty, from_dict,
)
from actord.log import get
from actord.metrics import Metrics
from actord.actors.ckpt_plan import CheckpointPlan
from actord.policy.checkpoints import CheckpointMeta
from actord.policy.placement import Divergence
from actord.storage.pagefile import PageImage, StoredCheckpoint, StoredGene

log = get("actord.slot")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class SlotCheckpoint:
    pos: int
    data: bytearray

    @property
    def n_bytes(self) -> int:
        return len(self.data)


@dataclass
class _Active:
    rid: int
    req: CompletionRequest
    prompt: list[int]
    reply: Reply | None
    stream: Callable[[Any], Any] | None
    n_cached: int
    t_start: float
    resumed_from_checkpoint: bool = False
    t_first: float = 0.0
    out_tokens: list[int] = field(default_factory=list)
    text: bytearray = field(default_factory=bytearray)
    streamed: int = 0  # characters of decoded text already streamed
    cancelled: bool = False
    genes: tuple[tuple[int, float], ...] = ()
    ticket: int = 0  # the gene acquisition this request waits for (0: none)
    running: bool = False  # past gene acquisition: enrolled with the scheduler
    evicted_mind: str | None = None  # the mind this slot paged out while the request waited
    # Per-token stop scan and streaming touch only the new tail (bounded work per token):
    stop_scan: int = 0  # bytes of `text` already searched for stop strings
    stop_bytes: list[bytes] | None = None  # the stop strings, UTF-8, non-empty ones
    decoder: Any = None  # incremental UTF-8 decoder of `text` for streaming
    decoded: int = 0  # bytes of `text` fed to `decoder`
    pending: str = ""  # decoded text not streamed yet (may still become part of a stop string)


class Slot(Actor[SlotInbox]):
    rank = 30

    def __init__(
        self, dispatcher: Dispatcher, slot_id: int, engine: Any, props: J.ModelProps,
        metrics: Metrics, default_seed: int = 0, capacity: int = 64,
    ) -> None:
        super().__init__(dispatcher, f"slot{slot_id}", capacity)
        self.id = slot_id
        self.seq = slot_id
        self.engine = engine
        self.props = props
        self.metrics = metrics
        self.default_seed = default_seed
        self.scheduler: Actor[Any] | None = None
        self.pages: Actor[Any] | None = None
        self.residency: Actor[Any] | None = None
        self.ckpt_budget: Actor[Any] | None = None
        self.files: Any = None  # storage.files.PageFiles
        self.ckpt = CheckpointPlan()  # the mind's divergence history and the checkpoint policy
        self.default_genes: list[int] = []
        self.track_footprint = False
        self._acquired = False
        self.kv_tokens: list[int] = []
        self.resume_raw_lcp: int | None = None
        self.checkpoints: list[SlotCheckpoint] = []
        self.genes: tuple[tuple[int, float], ...] = ()
        self.mind: str | None = None
        self.active: _Active | None = None
        self.deferred: collections.deque[Envelope[SlotInbox]] = collections.deque()
        self._tickets = 0

    # -- dispatch ----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.active is not None

    async def handle(self, msg: SlotInbox, env: Envelope[SlotInbox]) -> None:
        match msg:
            case StepResult():
                env.reply.send(await self._on_step(msg))  # type: ignore[union-attr]
                if self.active is None:
                    await self._drain_deferred()
            case StepFailed():
                await self._on_step_failed(msg)
                env.reply.send(None)  # type: ignore[union-attr]
                await self._drain_deferred()
            case Info():
                env.reply.send(self.info())  # type: ignore[union-attr]
            case CancelRequest(rid=rid):
                if self.active is not None and self.active.rid == rid:
                    self.active.cancelled = True
                    if not self.active.running:  # still waiting for genes: end it now
                        await self._finish("cancelled")
                        await self._drain_deferred()
                self._drop_deferred(rid)
            case DropCheckpoint(pos=pos):
                self.checkpoints = [c for c in self.checkpoints if c.pos != pos]
                # Re-send the list: a mirror update of ours may have crossed this drop.
                await self._sync_budget(self.checkpoints)
            case GenesGranted(ticket=ticket):
                await self._on_genes_granted(ticket)
                if self.active is None:
                    await self._drain_deferred()
            case GenesRefused(ticket=ticket):
                a = self.active
                if a is not None and a.ticket == ticket and not a.running:
                    self._acquired = False  # the residency already let go of this acquisition
                    await self._abort(from_dict({"type": msg.error_type, "message": msg.message}))
                    await self._drain_deferred()
            case Evict(reason=reason):
                await self._on_evict(reason, env)
            case NoRoom():
                await self._on_no_room()
                if env.reply is not None:
                    env.reply.send(None)
                await self._drain_deferred()
            case _ if self.busy:
                self.deferred.append(env)
                self.metrics.requests_deferred_total.inc()
                log.debug("slot.deferred", slot=self.id, msg=type(msg).__name__, queued=len(self.deferred))
            case Complete():
                await self._start(msg, env)
            case Erase():
                await self.erase()
                env.reply.send({"slot": self.id, "erased": True})  # type: ignore[union-attr]
            case PageOutSlot() | PageInSlot() | SaveSlot() | RestoreSlot():
                await self.handle_page_op(msg, env)
            case _:
                raise InvalidParams(f"slot cannot handle {type(msg).__name__}")

    async def handle_page_op(self, msg: SlotInbox, env: Envelope[SlotInbox]) -> None:
        match msg:
            case PageOutSlot(page=name):
                out = await self.page_out(name)
            case PageInSlot(page=name, evict_first=evict_first):
                if evict_first and self.kv_tokens:
                    await self.evict("placer")
                out = await self.page_in(name)
            case SaveSlot(file=file):
                out = await self.save(file)
            case RestoreSlot(file=file):
                out = await self.restore(file)
            case _:
                raise InvalidParams(f"not a page operation: {type(msg).__name__}")
        if env.reply is not None:
            env.reply.send(out)

    # -- pages -------------------------------------------------------------------------

    def page_checkpoints(self) -> list[SlotCheckpoint]:
        """What a page or file keeps: the policy's choice (placement: the best subset for
        the mind's forecast; divergence/oldest: the seed's count rule)."""
        idx = self.ckpt.keep_indices(self.checkpoints, self.resume_raw_lcp, len(self.kv_tokens))
        return [self.checkpoints[i] for i in idx]

    def selection_lcp(self) -> int | None:
        """The raw lcp the seed's selection may use; 'oldest' ignores it on purpose."""
        return self.resume_raw_lcp if self.ckpt.policy == "divergence" else None

    async def _capture(self) -> tuple[J.StateData, list[SlotCheckpoint]]:
        if not self.kv_tokens:
            raise SlotEmpty(f"slot {self.id} holds no sequence", slot=self.id)
        return await self.engine.run(J.StateGet(seq=self.seq)), self.page_checkpoints()

    async def page_out(self, name: str) -> dict[str, Any]:
        if self.pages is None:
            raise InvalidParams("no page store on this system")
        name = name or self.mind or f"evicted-slot{self.id}"
        if not self.kv_tokens:
            raise SlotEmpty(f"slot {self.id} holds no sequence", slot=self.id)
        t0 = time.perf_counter()
        ckpts = self.page_checkpoints()
        n_state = await self.engine.run(J.StateSize(seq=self.seq))
        n_bytes = n_state + 4 * len(self.kv_tokens) + sum(c.n_bytes for c in ckpts)
        reservation = await self.pages.ask(Admit(name=name, n_bytes=n_bytes))
        try:
            st = await self.engine.run(J.StateGet(seq=self.seq))
            if st.n_bytes != n_state:
                raise EngineError("sequence state changed size between admission and copy", slot=self.id)
            page = Page(
                gen=reservation, name=name, n_bytes=n_bytes, state=st.data, tokens=list(self.kv_tokens),
                checkpoints=[PageCheckpoint(pos=c.pos, data=c.data) for c in ckpts], genes=self.genes,
                divergences=list(self.ckpt.history), prompt_end=self.ckpt.prompt_end,
            )
            info = await self.pages.ask(Commit(reservation=reservation, page=page))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.pages.tell(CancelReservation(reservation=reservation))
            self.metrics.page_failed_total.inc()
            raise
        # The page is whole in the store; only now is the slot freed.
        await self.engine.run(J.SeqRm(seq=self.seq, p0=-1, p1=-1))
        n_tokens = len(self.kv_tokens)
        self.kv_tokens, self.resume_raw_lcp, self.mind = [], None, None
        self.ckpt.reset()
        await self.release_checkpoints(self.checkpoints)
        self.checkpoints = []
        t_ms = (time.perf_counter() - t0) * 1e3
        self.metrics.page_out_total.inc()
        await self.footprint_changed()
        await self._tell_cells()
        log.info("page.out", slot=self.id, page=name, n_bytes=n_bytes, n_tokens=n_tokens, t_ms=round(t_ms, 3),
                 copy_ms=round(st.t_ms, 3))
        return {"slot": self.id, "page": name, "n_bytes": n_bytes, "n_tokens": n_tokens,
                "n_checkpoints": info.n_checkpoints, "t_ms": t_ms, "copy_ms": st.t_ms}

    async def page_in(self, name: str) -> dict[str, Any]:
        if self.pages is None:
            raise InvalidParams("no page store on this system")
        if self.kv_tokens:
            raise SlotBusy(f"slot {self.id} holds a sequence: page it out or erase it first", slot=self.id)
        t0 = time.perf_counter()
        page: Page = await self.pages.ask(Take(name=name))
        try:
            st = await self.engine.run(J.StateSet(seq=self.seq, data=page.state))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.pages.tell(Return(gen=page.gen))
                await self._tell_cells()
            self.metrics.page_failed_total.inc()
            log.warning("page.in_failed", slot=self.id, page=name)
            raise
        self.kv_tokens = list(page.tokens)
        self.genes = page.genes
        self.resume_raw_lcp = None
        self.mind = name
        self.ckpt.adopt(page.divergences, page.prompt_end, len(page.tokens))
        await self.adopt_checkpoints([SlotCheckpoint(pos=c.pos, data=c.data) for c in page.checkpoints])
        await self.pages.tell(Release(gen=page.gen))
        t_ms = (time.perf_counter() - t0) * 1e3
        self.metrics.page_in_total.inc()
        await self.footprint_changed()
        await self._tell_cells()
        log.info("page.in", slot=self.id, page=name, n_bytes=page.n_bytes, n_tokens=len(page.tokens),
                 t_ms=round(t_ms, 3), copy_ms=round(st.t_ms, 3))
        return {"slot": self.id, "page": name, "n_bytes": page.n_bytes, "n_tokens": len(page.tokens),
                "n_checkpoints": len(self.checkpoints), "t_ms": t_ms, "copy_ms": st.t_ms}

    async def adopt_checkpoints(self, ckpts: list[SlotCheckpoint]) -> None:
        """Checkpoints arriving with a page or file enter the budget one by one, oldest first."""
        self.checkpoints = []
        await self._sync_budget([])
        if self.ckpt_budget is None:
            return
        for ck in ckpts:
            await self.on_checkpoint(ck.pos, ck.data)

    async def save(self, file: str) -> dict[str, Any]:
        if self.files is None:
            raise InvalidParams("no page folder on this system")
        self.files.check(file)
        t0 = time.perf_counter()
        st, ckpts = await self._capture()
        stats = await self.files.publish(file, page_image(self.props, st.data, ckpts, self.kv_tokens, self.genes,
                                                          self.ckpt.history, self.ckpt.prompt_end))
        t_ms = (time.perf_counter() - t0) * 1e3
        log.info("slot.saved", slot=self.id, file=file, n_bytes=stats.n_bytes, t_ms=round(t_ms, 3))
        return {"slot": self.id, "file": file, "n_bytes": stats.n_bytes, "n_tokens": len(self.kv_tokens),
                "n_checkpoints": len(ckpts), "t_ms": t_ms, "copy_ms": st.t_ms}

    async def restore(self, file: str) -> dict[str, Any]:
        if self.files is None:
            raise InvalidParams("no page folder on this system")
        t0 = time.perf_counter()
        image = await self.files.read(file)
        check_fingerprint(image, self.props, file)
        # The slot's old content goes; a failed restore leaves the slot empty and usable.
        self.kv_tokens, self.resume_raw_lcp, self.mind = [], None, None
        await self.release_checkpoints(self.checkpoints)
        self.checkpoints = []
        try:
            st = await self.engine.run(J.StateSet(seq=self.seq, data=image.state))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.footprint_changed()
                await self._tell_cells()
            raise
        self.kv_tokens = list(image.tokens)
        self.genes = tuple((g.id, g.scale) for g in image.genes)
        self.mind = file[: -len(".page")] if file.endswith(".page") else file
        self.ckpt.adopt([Divergence(lcp=a, end=b) for a, b in image.divergences], image.prompt_end, len(image.tokens))
        await self.adopt_checkpoints([SlotCheckpoint(pos=c.pos, data=bytearray(c.data)) for c in image.checkpoints])
        await self.footprint_changed()
        await self._tell_cells()
        t_ms = (time.perf_counter() - t0) * 1e3
        log.info("slot.restored", slot=self.id, file=file, n_tokens=len(self.kv_tokens), t_ms=round(t_ms, 3),
                 draft="cold" if image.draft is None else "warm")
        return {"slot": self.id, "file": file, "n_bytes": st.n_bytes, "n_tokens": len(self.kv_tokens),
                "n_checkpoints": len(self.checkpoints), "t_ms": t_ms, "copy_ms": st.t_ms}



    async def _drain_deferred(self) -> None:
        while self.deferred and not self.busy:
            env = self.deferred.popleft()
            try:
                await self.handle(env.msg, env)
            except ActordError as e:
                if env.reply is not None:
                    env.reply.fail(e)

    def _drop_deferred(self, rid: int) -> None:
        for env in list(self.deferred):
            if isinstance(env.msg, Complete) and env.msg.rid == rid:
                self.deferred.remove(env)
                self.metrics.requests_total.labels(outcome="cancelled").inc()
                if env.reply is not None:
                    env.reply.fail(Cancelled("request cancelled before it started", rid=rid))

    def deferred_count(self) -> int:
        return len(self.deferred)

    def on_crash(self, error: BaseException) -> None:
        if self.active is not None and self.active.reply is not None:
            self.active.reply.fail(error)
        for env in self.deferred:
            if env.reply is not None:
                env.reply.fail(error)
        self.deferred.clear()

    def info(self) -> SlotInfo:
        return SlotInfo(
            id=self.id, state="processing" if self.busy else "idle", n_tokens=len(self.kv_tokens),
            resume_raw_lcp=self.resume_raw_lcp, n_checkpoints=len(self.checkpoints),
            checkpoint_bytes=sum(c.n_bytes for c in self.checkpoints),
            genes=[GeneRef(id=g, scale=s) for g, s in self.genes], deferred=len(self.deferred),
            mind=self.mind, checkpoint_positions=[c.pos for c in self.checkpoints], checkpoint_plan=list(self.ckpt.last),
        )

    # -- memory ------------------------------------------------------------------------

    async def erase(self) -> None:
        await self.engine.run(J.SeqRm(seq=self.seq, p0=-1, p1=-1))
        self.kv_tokens = []
        self.resume_raw_lcp = None
        self.mind = None
        self.ckpt.reset()
        await self.release_checkpoints(self.checkpoints)
        self.checkpoints = []
        await self.footprint_changed()
        await self._tell_cells()

    async def _tell_cells(self) -> None:
        """The scheduler charges KV cells per slot; tell it after a change outside a step."""
        if self.scheduler is not None:
            await self.scheduler.tell(Cells(slot=self.id, n=len(self.kv_tokens)))

    async def _on_evict(self, reason: str, env: Envelope[SlotInbox]) -> None:
        try:
            freed = await self.evict(reason)
        except ActordError as e:
            if reason == "device" and self.residency is not None:
                await self.residency.tell(EvictDone(slot=self.id, freed=False))
            if env.reply is not None:
                env.reply.fail(e)
            return
        if reason == "device" and self.residency is not None:
            await self.residency.tell(EvictDone(slot=self.id, freed=True))
        if env.reply is not None:
            env.reply.send(freed)

    async def evict(self, reason: str) -> int:
        """Give up an idle sequence: to the mind's page, else its file, else dropped.

        Returns the cells freed. A slot with a running request refuses: eviction never
        touches work in flight. A request still waiting for its genes has a quiet sequence;
        if that goes to the mind's page, it comes back when the genes are granted.
        """
        a = self.active
        if a is not None and a.running:
            raise SlotBusy(f"slot {self.id} has work in flight", slot=self.id)
        n = len(self.kv_tokens)
        if n == 0:
            await self.footprint_changed()  # whoever asked may hold a stale size: correct it
            return 0
        how = "dropped"
        mind = self.mind
        if mind is not None and self.pages is not None:
            try:
                await self.page_out(mind)
                how = "paged_out"
            except PageRamExceeded:
                if self.files is not None:
                    from actord.actors.placer import mind_file

                    try:
                        await self.save(mind_file(mind))
                        how = "spilled"
                    except ActordError as e:
                        log.warning("slot.evict_spill_failed", slot=self.id, mind=mind, error=e.to_dict())
        if how != "paged_out":
            await self.erase()
        elif a is not None:
            a.evicted_mind = mind
        self.metrics.slot_evictions_total.labels(reason=reason, how=how).inc()
        (log.warning if how == "dropped" else log.info)(
            "slot.evicted", slot=self.id, mind=mind, reason=reason, how=how, n_tokens=n)
        return n

    async def _on_no_room(self) -> None:
        """No KV cell for the next step: generation stops with "context", a prompt fails."""
        a = self.active
        if a is None or not a.running:
            return
        if a.out_tokens:
            await self._finish("context")
            return
        await self._cut_back_after_failure()
        await self._abort(ContextFull(
            f"no KV cells for slot {self.id}'s prompt: the shared cache (n_ctx {self.props.n_ctx}) is held by "
            "requests in flight", slot=self.id, n_ctx=self.props.n_ctx, n_prompt_tokens=len(a.prompt)))

    # -- checkpoints -------------------------------------------------------------------

    async def release_checkpoints(self, dropped: list[SlotCheckpoint]) -> None:
        """The list is being emptied (erase, page_out): tell the budget."""
        await self._sync_budget([])

    async def _sync_budget(self, ckpts: list[SlotCheckpoint]) -> None:
        if self.ckpt_budget is not None:
            history, n, population = self.ckpt.view(len(self.kv_tokens))
            await self.ckpt_budget.tell(SlotCheckpoints(
                slot=self.id, metas=[CheckpointMeta(pos=c.pos, n_bytes=c.n_bytes) for c in ckpts],
                raw_lcp=self.selection_lcp(), history=history, n_tokens=n, population=population,
            ))

    async def cut_to(self, n: int) -> tuple[int, bool]:
        """Make the sequence hold exactly kv_tokens[:m] for the largest usable m <= n.

        Returns (m, resumed_from_checkpoint). Memory that can be cut back at n is cut there.
        Memory that cannot (SWA without a full cache whose window has moved past n,
        recurrent, hybrid) resumes from the newest checkpoint at or below n, else from zero.
        Checkpoints past the resume point are invalidated.
        """
        held = len(self.kv_tokens)
        m, from_ckpt = await self._cut(n)
        if any(c.pos > m for c in self.checkpoints):
            self.checkpoints = [c for c in self.checkpoints if c.pos <= m]
        self.ckpt.observe(self.resume_raw_lcp or 0)
        await self._sync_budget(self.checkpoints)
        if (m < held and not from_ckpt and self.props.needs_checkpoints and self.ckpt_budget is not None
                and self.ckpt.wants_at_resume(m, [c.pos for c in self.checkpoints])):
            # The memory served this divergence; the next one is likely here again.
            st = await self.engine.run(J.StateGet(seq=self.seq, partial=True))
            await self.on_checkpoint(m, st.data)
        return m, from_ckpt

    async def _cut(self, n: int) -> tuple[int, bool]:
        if n >= len(self.kv_tokens):
            return len(self.kv_tokens), False
        p = self.props
        if not p.needs_checkpoints or await self._memory_holds(n):
            if await self.engine.run(J.SeqRm(seq=self.seq, p0=n, p1=-1)):
                self.kv_tokens = self.kv_tokens[:n]
                return n, False
        for ck in reversed(self.checkpoints):
            if ck.pos > n:
                continue
            try:
                await self.engine.run(J.StateSet(seq=self.seq, data=ck.data, partial=True))
                ok = await self.engine.run(J.SeqRm(seq=self.seq, p0=ck.pos, p1=-1))
            except ActordError as e:
                log.warning("slot.checkpoint_restore_failed", slot=self.id, pos=ck.pos, error=e.to_dict())
                break
            if ok:
                self.kv_tokens = self.kv_tokens[:ck.pos]
                self.metrics.ctx_checkpoint_restores_total.inc()
                log.info("slot.checkpoint_restored", slot=self.id, pos=ck.pos, raw_lcp=self.resume_raw_lcp)
                return ck.pos, True
            break
        await self.engine.run(J.SeqRm(seq=self.seq, p0=-1, p1=-1))
        self.kv_tokens = []
        return 0, False

    async def _memory_holds(self, n: int) -> bool:
        """Can the memory itself serve a resume at n (without a checkpoint)?"""
        p = self.props
        if p.recurrent or p.hybrid:
            return False
        rng: J.SeqRange = await self.engine.run(J.MemoryRange(seq=self.seq))
        # The window attending from position n needs positions down to n - n_swa.
        return rng.pos_min <= max(0, n - p.n_swa)

    def checkpoint_positions(self, pos0: int, n_prompt: int) -> list[int]:
        """Plan where to snapshot the prompt, decoded from pos0 (its divergence was noted
        by `cut_to`): as few pieces as the plan needs."""
        self.ckpt.started(n_prompt)
        if not self.props.needs_checkpoints or self.ckpt_budget is None:
            return []
        out = self.ckpt.positions(pos0, n_prompt, [c.pos for c in self.checkpoints])
        if out:
            log.debug("slot.checkpoint_plan", slot=self.id, pos0=pos0, n_prompt=n_prompt, at=out,
                      policy=self.ckpt.policy, history=len(self.ckpt.history))
        return out

    async def on_checkpoint(self, pos: int, data: bytearray) -> None:
        assert self.ckpt_budget is not None
        self.ckpt.ckpt_bytes = len(data)
        history, n, population = self.ckpt.view(len(self.kv_tokens))
        d: Decision = await self.ckpt_budget.ask(AdmitCheckpoint(
            slot=self.id, pos=pos, n_bytes=len(data), raw_lcp=self.selection_lcp(), history=history, n_tokens=n,
            population=population,
        ))
        if d.drop_own:
            self.checkpoints = [c for c in self.checkpoints if c.pos not in d.drop_own]
        if d.admit:
            self.checkpoints.append(SlotCheckpoint(pos=pos, data=data))

    # -- a request ---------------------------------------------------------------------

    async def _tokens_of(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return await self.engine.run(J.Tokenize(text=req.prompt))
        n_vocab = self.props.n_vocab
        bad = [t for t in req.prompt if not 0 <= t < n_vocab]
        if bad:
            raise InvalidParams(f"token ids out of range [0, {n_vocab})", bad=bad[:8])
        return list(req.prompt)

    async def _start(self, msg: Complete, env: Envelope[SlotInbox]) -> None:
        req = msg.req
        t_start = time.perf_counter()
        prompt = await self._tokens_of(req)
        if len(prompt) + 1 > self.props.n_ctx:
            raise PromptTooLong(
                f"prompt of {len(prompt)} tokens does not fit n_ctx {self.props.n_ctx}",
                n_prompt_tokens=len(prompt), n_ctx=self.props.n_ctx,
            )
        genes = self.gene_set(req)
        self.active = _Active(rid=msg.rid, req=req, prompt=prompt, reply=env.reply, stream=env.stream,
                              n_cached=0, t_start=t_start, genes=genes)
        self.metrics.requests_in_flight.inc()
        if self.residency is not None and (genes or self.genes or self.track_footprint):
            # An empty set is announced too when it replaces a non-empty one (it unpins) and
            # under a device budget (the residency must know which slots run).
            self._tickets += 1
            self.active.ticket = self._tickets
            self._acquired = True
            await self.residency.tell(GeneAcquire(slot=self.id, genes=genes, ticket=self._tickets))
            return  # continued by GenesGranted / GenesRefused
        await self._run_active()

    async def _on_genes_granted(self, ticket: int) -> None:
        a = self.active
        if a is None or a.ticket != ticket or a.running:
            return  # a grant for a request that already ended (cancelled): its Finish went out
        if a.cancelled:
            await self._finish("cancelled")
            return
        await self._run_active()

    async def _run_active(self) -> None:
        a = self.active
        assert a is not None
        a.running = True
        try:
            if a.evicted_mind is not None and not self.kv_tokens:
                try:  # evicted while waiting for genes: the mind comes back from its page
                    await self.page_in(a.evicted_mind)
                except ActordError as e:
                    log.info("slot.evicted_mind_not_back", slot=self.id, mind=a.evicted_mind, error=e.to_dict())
            await self._begin(a)
        except ActordError as e:
            await self._abort(e)

    async def _abort(self, error: ActordError) -> None:
        """The active request ends with `error`; what the slot holds stays consistent."""
        a = self.active
        if a is None:
            return
        self.active = None
        self.metrics.requests_in_flight.dec()
        self.metrics.requests_total.labels(outcome="error").inc()
        with anyio.CancelScope(shield=True):
            await self.finish_genes()
            await self._tell_cells()
        if a.reply is not None:
            a.reply.fail(error)

    async def _begin(self, a: _Active) -> None:
        req, prompt, genes = a.req, a.prompt, a.genes
        raw = common_prefix(self.kv_tokens, prompt)
        self.resume_raw_lcp = raw
        usable, from_ckpt = await self.cut_to(min(raw, len(prompt) - 1))
        if usable == 0 and raw > 0:
            self.metrics.full_reprefills_total.inc()
            log.info("slot.full_reprefill", slot=self.id, raw_lcp=raw, n_prompt=len(prompt))
        seed = req.seed if req.seed is not None else self.default_seed
        await self.engine.run(J.SetSampler(seq=self.seq, params=J.SamplingParams(
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed,
        )))
        self.genes = genes
        if req.mind is not None:
            self.mind = req.mind
        a.n_cached, a.resumed_from_checkpoint = usable, from_ckpt
        self.metrics.prompt_tokens_total.inc(len(prompt))
        self.metrics.prompt_tokens_processed_total.inc(len(prompt) - usable)
        if req.n_predict == 0 and usable == len(prompt):
            await self._finish("length")
            return
        if a.cancelled:
            await self._finish("cancelled")
            return
        assert self.scheduler is not None
        await self.scheduler.tell(Enroll(
            slot=self.id, seq=self.seq, tokens=prompt[usable:], pos0=usable, genes=self.genes,
            checkpoint_at=self.checkpoint_positions(usable, len(prompt)),
        ))

    def gene_set(self, req: CompletionRequest) -> tuple[tuple[int, float], ...]:
        """Default genes at scale 1 unless the request names them, plus the request's genes."""
        scales = {gid: 1.0 for gid in self.default_genes}
        scales.update({g.id: float(g.scale) for g in req.genes})
        return tuple(sorted(scales.items()))

    async def finish_genes(self) -> None:
        if self.residency is None or not (self._acquired or self.track_footprint):
            return
        self._acquired = False
        n = await self.engine.run(J.StateSize(seq=self.seq)) if self.track_footprint and self.kv_tokens else 0
        await self.residency.tell(GeneFinish(slot=self.id, n_bytes=n))

    async def footprint_changed(self) -> None:
        if self.residency is not None and self.track_footprint:
            n = await self.engine.run(J.StateSize(seq=self.seq)) if self.kv_tokens else 0
            await self.residency.tell(SlotFootprint(slot=self.id, n_bytes=n))

    async def _on_step(self, r: StepResult) -> SlotNext:
        a = self.active
        if a is None:  # a step for a request that already ended: stop feeding
            return SlotNext(action="done")
        self.kv_tokens.extend(r.fed)
        if r.checkpoint is not None:
            await self.on_checkpoint(r.checkpoint_pos, r.checkpoint)
        if r.token < 0:
            if a.cancelled:
                await self._finish("cancelled")
                return SlotNext(action="done")
            return SlotNext(action="continue")
        if not a.out_tokens and a.t_first == 0.0:
            a.t_first = time.perf_counter()
        req = a.req
        if a.cancelled:
            await self._finish("cancelled")
            return SlotNext(action="done")
        if (r.eog and not req.ignore_eos) or r.token in req.stop_tokens:
            await self._finish("eos" if r.eog else "stop")
            return SlotNext(action="done")
        a.out_tokens.append(r.token)
        a.text += r.piece
        stop_at = self._find_stop(a)
        if stop_at is not None:
            await self._finish("stop", stop_at)
            return SlotNext(action="done")
        self._stream_safe(a)
        if len(a.out_tokens) >= req.n_predict:
            await self._finish("length")
            return SlotNext(action="done")
        if len(self.kv_tokens) + 1 >= self.props.n_ctx:
            await self._finish("context")
            return SlotNext(action="done")
        return SlotNext(action="feed", token=r.token)

    def _find_stop(self, a: _Active) -> int | None:
        """The character offset of the first stop string in the text, or None.

        Only the new tail is searched (a match wholly inside text searched before would
        have ended the request then), so a step costs O(piece + longest stop) per stop
        string, not O(all text x all stops)."""
        if not a.req.stop:
            return None
        if a.stop_bytes is None:
            a.stop_bytes = [s.encode() for s in a.req.stop if s]
        longest = max(map(len, a.stop_bytes), default=0)
        start = max(0, a.stop_scan - longest + 1)
        a.stop_scan = len(a.text)
        hits = [i for i in (a.text.find(sb, start) for sb in a.stop_bytes) if i >= 0]
        if not hits:
            return None
        return len(bytes(a.text[:min(hits)]).decode(errors="replace"))

    def _stream_safe(self, a: _Active) -> None:
        """Stream decoded text that can no longer become part of a stop string."""
        if a.stream is None:
            return
        if a.decoder is None:
            a.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        a.pending += a.decoder.decode(bytes(a.text[a.decoded:]), final=False)
        a.decoded = len(a.text)
        hold = max(0, max((len(s) for s in a.req.stop), default=1) - 1)
        safe = len(a.pending) - hold
        if safe > 0:
            a.stream({"slot": self.id, "content": a.pending[:safe], "tokens": a.out_tokens[-1:]})
            a.streamed += safe
            a.pending = a.pending[safe:]

    async def _finish(self, reason: str, stop_at: int | None = None) -> None:
        a = self.active
        assert a is not None
        self.active = None
        self.metrics.requests_in_flight.dec()
        self.metrics.predicted_tokens_total.inc(len(a.out_tokens))
        self.metrics.requests_total.labels(outcome=reason).inc()
        text = a.text.decode(errors="replace")
        if stop_at is not None:
            text = text[:stop_at]
        if a.stream is not None and len(text) > a.streamed:
            a.stream({"slot": self.id, "content": text[a.streamed:], "tokens": []})
        now = time.perf_counter()
        t_first = a.t_first or now
        prompt_ms = (t_first - a.t_start) * 1e3
        predicted_ms = (now - t_first) * 1e3
        n_proc = len(a.prompt) - a.n_cached
        result = CompletionResult(
            content=text, tokens=a.out_tokens, n_prompt_tokens=len(a.prompt),
            n_prompt_processed=n_proc, n_cached=a.n_cached, slot=self.id, stop_reason=reason,
            resumed_from_checkpoint=a.resumed_from_checkpoint,
            timings=Timings(
                prompt_ms=prompt_ms, predicted_ms=predicted_ms,
                prompt_per_second=n_proc / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
                predicted_per_second=len(a.out_tokens) / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            ),
        )
        await self.finish_genes()
        await self._tell_cells()
        if a.reply is not None:
            a.reply.send(result)

    async def _cut_back_after_failure(self) -> None:
        # A failed decode may have left cells past what we know: cut back to kv_tokens.
        try:
            await self.engine.run(J.SeqRm(seq=self.seq, p0=len(self.kv_tokens), p1=-1))
        except ActordError:
            self.kv_tokens = []

    async def _on_step_failed(self, msg: StepFailed) -> None:
        await self._cut_back_after_failure()
        if self.active is None:
            await self._tell_cells()
            return
        await self._abort(from_dict({"type": msg.error_type, "message": msg.message}))


def page_image(props: J.ModelProps, state: Any, ckpts: list[Any], tokens: list[int],
               genes: tuple[tuple[int, float], ...], divergences: list[Divergence] | None = None,
               prompt_end: int = 0) -> PageImage:
    """A slot or a page as one page-file generation (the state bytes are not copied)."""
    return PageImage(
        tokens=list(tokens), state=state,
        checkpoints=[StoredCheckpoint(pos=c.pos, data=c.data) for c in ckpts],
        genes=[StoredGene(path="", scale=sc, id=g) for g, sc in genes],
        meta=model_fingerprint(props),
        divergences=[(d.lcp, d.end) for d in divergences or ()], prompt_end=prompt_end,
    )


def model_fingerprint(props: J.ModelProps) -> dict[str, Any]:
    return {"model": props.desc, "n_vocab": props.n_vocab, "n_ctx_train": props.n_ctx_train, "n_swa": props.n_swa}


def check_fingerprint(image: PageImage, props: J.ModelProps, file: str) -> None:
    want = model_fingerprint(props)
    got = {k: image.meta.get(k) for k in want}
    if got != want:
        raise PageDoesNotFit(f"{file} was saved from another model", file=file, saved=got, model=want)
