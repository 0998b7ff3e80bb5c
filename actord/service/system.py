"""The embedded API: `async with ActorSystem(config) as system: await system.complete(...)`.

The system starts the engine thread, builds the actors, binds them to one dispatcher and
runs them in a task group; its methods are typed async calls that send messages and await
replies. It works the same from an asyncio (or uvloop) host and from a trio host, because
it only uses anyio.

The system is a client of its actors (above them all in the ask order): it may ask any of
them, always within a bound (`request_timeout_s` for a completion, `ask_timeout_s` for the
rest). Stopping is bounded too: `shutdown(grace)` refuses new work, lets requests in flight
finish within the grace, cancels the rest, and leaving the context closes every mailbox and
gives the actors a bounded time to drain before they are cancelled.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable

import anyio
import msgspec

from actord.serving.kernel import Actor, Dispatcher
from actord.serving.checkpoint_budget import BudgetStats, CheckpointBudget
from actord.serving.checkpoint_plan import CheckpointPlan
from actord.serving.gene_residency import GeneResidency, ListGenes, LoadGene, PageInGene, PageOutGene, UnloadGene
from actord.serving.messages import (
    SlotLost, CancelRequest, Complete, Erase, Info, MakeRoom, PageInSlot, PageOutSlot, ReleaseRoom, RestoreSlot,
    SaveSlot,
)
from actord.serving.page_store import DropPage, ListPages, PageStore, SpillBegin, SpillEnd, StoreStats
from actord.serving.placer import CancelPlaced, MindPlacer, PlaceMind
from actord.serving.scheduler import Scheduler
from actord.serving.slot import Slot, common_prefix, page_image
from actord.service.types import CompletionRequest, CompletionResult, SlotInfo
from actord.service.config import Config
from actord.engine import jobs as J
from actord.engine.engine import Engine, run_job
from actord.engine.thread import EngineThread
from actord.service.errors import (
    ActordError, AskTimeout, ContextFull, InvalidParams, NoFreeSlot, ShuttingDown, SlotNotFound,
)
from actord.service.log import get
from actord.service.metrics import Metrics
from actord.policy.pipeline import pipeline_depth
from actord.storage.clientfiles import ByteBudget, ClientFiles
from actord.storage.files import PageFiles

log = get("actord.service.system")

PROPS_VERSION = {"slot_page_version": 1, "lora_page_version": 1}


class ActorSystem:
    # The mind placer's class: a host may give a subclass with more verbs (the cluster's
    # node daemon does, actord/cluster/placer.py); it is built and wired as this one.
    placer_class: type[MindPlacer] = MindPlacer

    def __init__(self, config: Config, *, engine_factory: Callable[[Config], Any] | None = None,
                 dispatcher: Dispatcher | None = None, trace: Any = None) -> None:
        self.config = config.validate()
        self.metrics = Metrics()
        self.dispatcher = dispatcher or Dispatcher()
        self.dispatcher.ask_bound_s = self.config.ask_timeout_s
        self._engine_factory = engine_factory or Engine
        self.engine = EngineThread(lambda: self._engine_factory(self.config), run_job, lambda e: e.close(),
                                   defer_s=self.config.announce_within_ms / 1e3, cpus=self._engine_cpus())
        self.engine.on_done = self.dispatcher.engine_done
        if hasattr(self.dispatcher, "engine"):
            self.dispatcher.engine = self.engine  # a deterministic dispatcher waits for its jobs
        self.recorder: Any = None
        trace = trace if trace is not None else self.config.trace
        if trace is not None and trace != "":
            from actord.service.hooks import open_recorder

            self.recorder = open_recorder(trace, self.config)
            # A replay delivers every step as a message: record the run the same way.
            self.dispatcher.loop_in_handler = False
            self.recorder.attach(self.dispatcher)
        self.props: J.ModelProps | None = None
        self.slots: list[Slot] = []
        self.scheduler: Scheduler | None = None
        self.pages: PageStore | None = None
        self.residency: GeneResidency | None = None
        self.ckpt_budget: CheckpointBudget | None = None
        self.files: Any = None
        self.placer: MindPlacer | None = None
        self._rids = itertools.count(1)
        self._limits = self.config.request_limits()
        c = self.config
        # Thread work that is no event of its own (a gene file read, a client's chat template)
        # goes through a deterministic dispatcher's run_sync: it must know the work is in
        # flight to tell when the system is quiet. The plain dispatcher has no such seam.
        self._run_sync: Callable[..., Any] = getattr(self.dispatcher, "run_sync", anyio.to_thread.run_sync)
        # Gene files being read or loaded hold at most max_gene_read_bytes in all, whoever
        # named them; a file must be a GGUF to be read at all.
        self.gene_read_budget = ByteBudget(c.max_gene_read_bytes)
        self.client_files = ClientFiles(root=c.gene_dir, max_bytes=c.max_gene_bytes, timeout=c.client_file_timeout,
                                        threads=c.client_file_threads, run_sync=self._run_sync,
                                        budget=self.gene_read_budget, magic=b"GGUF")
        self.operator_files = ClientFiles(max_bytes=c.max_gene_bytes, timeout=c.client_file_timeout,
                                          threads=c.client_file_threads, run_sync=self._run_sync,
                                          budget=self.gene_read_budget, magic=b"GGUF")
        self._tg: Any = None
        self._started = time.time()
        self.closing = False
        self._inflight: dict[int, int | None] = {}  # rid -> slot (None: placed by the placer)
        self._idle: anyio.Event | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> "ActorSystem":
        await self.engine.start()
        try:
            self.props = await self.engine.run(J.ModelInfo())
            if not self.props.kv_cells:  # pure recurrent: a prompt is not bounded by n_ctx
                self._limits = msgspec.structs.replace(self._limits, max_prompt_tokens=self._limits.max_prompt_bytes)
            self._build_actors()
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            await self.engine.stop()
            raise
        try:
            self.dispatcher.bind(self._tg)
            for actor in self.actors():
                actor.on_failure = self._on_actor_failure
                self.dispatcher.spawn(actor)
            for path in self.config.gene:
                info = await self.gene_load(path, default=True)
                for s in self.slots:
                    s.default_genes.append(info.id)
        except BaseException:
            # A failed start leaves nothing running: actors stopped, engine thread joined.
            # (Not inside a shielding scope of ours: the task group's own scope must be the
            # current one when it exits; the engine's stop is shielded in __aexit__.)
            await self.__aexit__(None, None, None)
            raise
        dev = self.props.device
        log.info("system.device", backend=dev.backend, device=dev.device, n_gpu_layers=dev.n_gpu_layers,
                 flash_attn=dev.flash_attn, flash_attn_used=dev.flash_attn_used, free_bytes=dev.free_bytes,
                 device_budget=dev.budget_bytes, device_budget_reason=dev.budget_reason)
        log.info("system.started", model=self.config.model, slots=self.config.slots, ctx=self.props.n_ctx,
                 swa_full=self.props.swa_full, swa_full_reason=self.props.swa_full_reason,
                 needs_checkpoints=self.props.needs_checkpoints, checkpoint_policy=self.config.checkpoint_policy)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.closing = True
        for actor in self.actors():
            actor.close()
        close_gates = getattr(self.dispatcher, "close_actors", None)
        if close_gates is not None:
            close_gates()
        # Closed mailboxes drain and end their loops; whatever is still stuck past the bound
        # (a handler awaiting something that will not come) is cancelled.
        self._tg.cancel_scope.deadline = anyio.current_time() + self.config.shutdown_grace_s + 5.0
        try:
            await self._tg.__aexit__(*exc)
        finally:
            with anyio.CancelScope(shield=True):
                await self.engine.stop()
            if self.recorder is not None:
                self.recorder.close(self.final_state())
            log.info("system.stopped")

    async def shutdown(self, grace_s: float | None = None) -> dict[str, int]:
        """Refuse new work; requests in flight get `grace_s` to finish, then are cancelled.

        Returns how many finished within the grace and how many were cancelled. Leaving the
        context afterwards stops the actors and the engine thread.
        """
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.closing = True
        n0 = len(self._inflight)
        log.info("system.shutting_down", in_flight=n0, grace_s=grace)
        with anyio.move_on_after(grace):
            await self._wait_idle()
        late = dict(self._inflight)
        for rid, slot in late.items():
            await self._cancel(rid, slot)
        with anyio.move_on_after(5.0):
            await self._wait_idle()
        if late:
            log.warning("system.cancelled_at_shutdown", n=len(late), left=len(self._inflight))
        return {"finished": n0 - len(late), "cancelled": len(late)}

    async def _wait_idle(self) -> None:
        while self._inflight:
            self._idle = anyio.Event()
            await self._idle.wait()

    def _engine_cpus(self) -> frozenset[int] | None:
        """Where the engine thread runs (actord/policy/cpus.py); decided here, on the thread
        that starts it, whose mask it inherits."""
        import os

        from actord.service.config import engine_threads
        from actord.policy.cpus import choose_engine_cpus

        choice = choose_engine_cpus(self.config.engine_cpus, os.sched_getaffinity(0),
                                    engine_threads(self.config.threads))
        log.info("engine.cpus", cpus=sorted(choice.cpus) if choice.cpus else None, reason=choice.reason)
        return choice.cpus

    def _check_open(self) -> None:
        if self.closing:
            raise ShuttingDown("the daemon is shutting down")

    def abort(self) -> None:
        """Cancel every actor now (a replay that diverged, a simulated crash)."""
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def _build_actors(self) -> None:
        assert self.props is not None
        cap = self.config.mailbox_capacity
        self.slots = [
            self.make_slot(i) for i in range(self.config.slots)
        ]
        depth = pipeline_depth(self.config.pipeline_depth, self.props.device.backend)
        log.info("scheduler.pipeline_depth", depth=depth, asked=self.config.pipeline_depth,
                 backend=self.props.device.backend)
        self.scheduler = Scheduler(
            self.dispatcher, self.engine, self.slots, self.props.n_batch, self.metrics,
            capacity=max(cap, 256, 8 * self.config.slots), n_ctx=self.props.kv_cells,  # 0: cells not charged
            piece_tile=self.config.piece_tile, depth=depth,
        )
        self.pages = PageStore(self.dispatcher, self.config.page_ram_bytes, self.metrics, capacity=max(cap, 256))
        # --device-bytes as the engine resolved it (0 on a GPU: its free memory less a margin).
        device_budget = self.props.device.budget_bytes
        self.residency = GeneResidency(self.dispatcher, self.engine, self.slots, device_budget,
                                       self.metrics, capacity=max(cap, 256))
        self.ckpt_budget = CheckpointBudget(self.dispatcher, self.config.ctx_checkpoints_bytes, self.slots,
                                            self.metrics, capacity=max(cap, 256),
                                            policy=self.config.checkpoint_policy, cap=1 + self.config.ctx_checkpoints)
        self.files = PageFiles(self.config.page_dir, threads=self.config.disk_threads,
                               offload=self.dispatcher.offload)
        self.placer = self.placer_class(self.dispatcher, self.slots, self.pages, self.files, self._spill,
                                        self.metrics, capacity=max(cap, 256))
        self.placer.scheduler = self.scheduler
        self.placer.kv_cells = self.scheduler.n_ctx if self.scheduler is not None else 0
        for s in self.slots:
            s.placer = self.placer
            s.files = self.files
            s.ckpt_budget = self.ckpt_budget
            s.ckpt = CheckpointPlan(
                policy=self.config.checkpoint_policy, keep=self.config.ctx_checkpoints,
                every=self.config.checkpoint_every, align=self.props.n_batch, tile=self.config.piece_tile,
                share_bytes=self.config.ctx_checkpoints_bytes // max(1, self.config.slots),
            )
            s.scheduler = self.scheduler
            s.peers = self.slots
            s.pages = self.pages
            s.residency = self.residency
            s.track_footprint = device_budget > 0

    def make_slot(self, i: int) -> Slot:
        assert self.props is not None
        return Slot(self.dispatcher, i, self.engine, self.props, self.metrics,
                    default_seed=self.config.seed, capacity=self.config.mailbox_capacity)

    def actors(self) -> list[Actor[Any]]:
        extra = [a for a in (self.scheduler, self.pages, self.residency, self.ckpt_budget, self.placer) if a is not None]
        return [*self.slots, *extra]

    def _on_actor_failure(self, actor: Actor[Any], error: BaseException) -> None:
        self.metrics.actor_failures_total.labels(actor=actor.name).inc()
        if isinstance(actor, Slot) and self.scheduler is not None and not self.scheduler.failed:
            try:  # its cells must not stay charged for good
                self.scheduler.tell_nowait(SlotLost(slot=actor.id))
            except ActordError:
                pass

    # -- completions -------------------------------------------------------------------

    def _slot(self, slot: int) -> Slot:
        if not isinstance(slot, int) or not 0 <= slot < len(self.slots):
            raise SlotNotFound(f"no slot {slot}", slot=slot, n_slots=len(self.slots))
        return self.slots[slot]

    async def complete(
        self, request: CompletionRequest | None = None, *, on_token: Callable[[Any], None] | None = None,
        _input: bool = True, **params: Any,
    ) -> CompletionResult:
        """Run one completion. `on_token` (sync, must not block) receives streamed chunks.

        (`_input=False`: a completion made by another verb, e.g. `chat`, whose own input a
        trace already holds; a replay re-executes that verb, not this completion.)"""
        if request is None:
            try:
                request = msgspec.convert(params, CompletionRequest)
            except msgspec.ValidationError as e:
                raise InvalidParams(str(e)) from None
        request = request.check(self._limits)  # a json_schema comes back as its grammar
        self._check_open()
        if _input:
            await self.dispatcher.input("completion", request)
        rid = next(self._rids)
        bound = self.config.request_timeout_s
        slot: Slot | None = None
        self._inflight[rid] = None
        try:
            if request.mind is not None:
                assert self.placer is not None
                return await self.placer.ask(PlaceMind(complete=Complete(rid=rid, req=request)), stream=on_token,
                                             timeout=bound)
            slot = self._slot(request.slot) if request.slot is not None else await self._place(request)
            self._inflight[rid] = slot.id
            return await slot.ask(Complete(rid=rid, req=request), stream=on_token, timeout=bound)
        except (anyio.get_cancelled_exc_class(), AskTimeout):
            # The caller is gone (or out of time): the request ends at its next step.
            await self._cancel(rid, slot.id if slot is not None else None)
            raise
        finally:
            self._inflight.pop(rid, None)
            if not self._inflight and self._idle is not None:
                self._idle.set()

    async def complete_n(self, request: CompletionRequest, n: int, *,
                         on_token: Callable[[Any], None] | None = None) -> list[CompletionResult]:
        """n completions of one prompt, prefilled once (actord/chat/choices.py), by index; each
        streamed chunk carries its choice's `index`."""
        from actord.chat.choices import complete_choices

        await self.dispatcher.input("completion", request)
        return await complete_choices(self, request, n, on_token)

    def hold_slots(self, slots: list[int]) -> list[int]:
        """Mark slots as bound for work about to come (no placement picks them); the ids to release."""
        rids = [next(self._rids) for _ in slots]
        self._inflight.update(zip(rids, slots))
        return rids

    def release_slots(self, rids: list[int]) -> None:
        for rid in rids:
            self._inflight.pop(rid, None)
        if not self._inflight and self._idle is not None:
            self._idle.set()

    async def _cancel(self, rid: int, slot: int | None) -> None:
        """Tell whoever holds request `rid` to end it; bounded, and never raises."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            try:
                if slot is not None:
                    await self.slots[slot].tell(CancelRequest(rid=rid))
                elif self.placer is not None:
                    # Through the placer: it forwards the cancel after the placement it may
                    # still be making, so the cancel cannot overtake the request.
                    await self.placer.tell(CancelPlaced(rid=rid))
            except ActordError:
                pass

    async def chat(
        self, request: Any = None, *, on_token: Callable[[Any], None] | None = None, n: int = 1, **params: Any,
    ) -> Any:
        """Run one chat turn: messages rendered with the model's chat template (actord.chat.template).

        A conversation this system served before comes back as the exact tokens of its
        last prompt + reply, so its mind decodes only the new messages. Returns a
        `ChatResult` (the reply message, the completion's result and usage); with `n` > 1,
        a list of n, one per choice (actord/chat/choices.py: choice 0's reply is the one remembered).
        """
        from actord.chat.messages import ChatRequest
        from actord.chat.turn import run_turn

        if request is None:
            try:
                request = msgspec.convert(params, ChatRequest)
            except msgspec.ValidationError as e:
                raise InvalidParams(str(e)) from None
        return await run_turn(self, request, on_token, n)

    async def _place(self, request: CompletionRequest) -> Slot:
        """No slot named: the idle slot whose tokens share the longest prefix, else least deferred."""
        infos: list[SlotInfo] = [await s.ask(Info()) for s in self.slots]
        # Slots that a request placed meanwhile is bound for are not idle for this one: no
        # await between this choice and its record in _inflight, so two concurrent
        # placements cannot pick the same slot.
        bound_for = {s for s in self._inflight.values() if s is not None}
        idle = [i for i in infos if i.state == "idle" and i.deferred == 0 and i.id not in bound_for]
        # A mind's resident state is not written over while another idle slot can serve: an
        # unnamed request would cost the mind its cache (its next turn would prefill again).
        idle = [i for i in idle if i.mind is None] or idle
        if isinstance(request.prompt, list) and idle:
            best = max(idle, key=lambda i: (common_prefix(self.slots[i.id].kv_tokens, request.prompt), -i.n_tokens))
            return self.slots[best.id]
        if idle:
            return self.slots[min(idle, key=lambda i: i.n_tokens).id]
        if not infos:
            raise NoFreeSlot("no slots")
        return self.slots[min(infos, key=lambda i: i.deferred).id]

    # -- slots -------------------------------------------------------------------------

    async def slot_list(self) -> list[SlotInfo]:
        await self.dispatcher.input('slot.list', {})
        return [await s.ask(Info()) for s in self.slots]

    async def slot_erase(self, slot: int) -> dict[str, Any]:
        self._check_open()
        await self.dispatcher.input('slot.erase', {'slot': slot})
        return await self._slot(slot).ask(Erase())

    # -- pages -------------------------------------------------------------------------

    async def page_out(self, slot: int, page: str) -> dict[str, Any]:
        self._check_open()
        await self.dispatcher.input("page.out", {"slot": slot, "page": page})
        if not page:
            raise InvalidParams("page name is empty")
        return await self._slot(slot).ask(PageOutSlot(page=page))

    async def page_in(self, slot: int, page: str) -> dict[str, Any]:
        self._check_open()
        await self.dispatcher.input('page.in', {'slot': slot, 'page': page})
        target = self._slot(slot)
        assert self.pages is not None and self.scheduler is not None
        held = {p.page: p.n_tokens for p in await self.pages.ask(ListPages())}
        if page not in held:
            return await target.ask(PageInSlot(page=page))  # refused by the slot, typed
        # KV cells for the page, from idle slots if need be, held for this move until it is
        # over, however it ends (no count is left behind by a refused page-in).
        room = await self.scheduler.ask(MakeRoom(slot=slot, cells=held[page]))
        try:
            if room.cells < held[page]:
                raise ContextFull(f"no KV cells for page {page!r} now: it needs {held[page]}, the shared cache "
                                  f"(n_ctx {self.props.n_ctx}) has {room.cells} free for slot {slot}",
                                  page=page, slot=slot, n_tokens=held[page], free=room.cells)
            return await target.ask(PageInSlot(page=page))
        finally:
            if room.token:  # answered once the count is the slot's own again
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.ask_timeout_s):
                    try:
                        await self.scheduler.ask(ReleaseRoom(token=room.token))
                    except ActordError:
                        pass  # stopping

    async def page_drop(self, page: str) -> Any:
        self._check_open()
        await self.dispatcher.input('page.drop', {'page': page})
        assert self.pages is not None
        return await self.pages.ask(DropPage(name=page))

    async def page_list(self) -> Any:
        await self.dispatcher.input('page.list', {})
        assert self.pages is not None
        return await self.pages.ask(ListPages())

    async def checkpoint_stats(self) -> Any:
        await self.dispatcher.input('checkpoint.stats', {})
        assert self.ckpt_budget is not None
        return await self.ckpt_budget.ask(BudgetStats())

    async def page_spill(self, page: str, file: str, drop: bool = False) -> dict[str, Any]:
        """Write a page to a page file on a worker thread; with drop, free that generation.

        The store holds the page for the spill's whole duration, so its charge keeps counting
        even if the page is paged in, dropped or replaced meanwhile.
        """
        assert self.pages is not None
        self._check_open()
        await self.dispatcher.input("page.spill", {"page": page, "file": file, "drop": drop})
        return await self._spill(page, file, drop)

    async def _spill(self, page: str, file: str, drop: bool) -> dict[str, Any]:
        assert self.pages is not None
        self.files.check(file)
        t0 = time.perf_counter()
        async with self.files.holding(file):  # no other publication of `file` until the drop
            held = await self.pages.ask(SpillBegin(name=page))
            dropped = False
            durable = False
            try:
                stats = await self.files.publish(
                    file, page_image(self.props, held.state, held.checkpoints, held.tokens, held.genes,
                                     held.divergences, held.prompt_end, draft=held.draft, draft_n=held.draft_n),
                    held=True)
                durable = True  # publish returns only once every file and folder is fsynced
            except ActordError as e:
                self.metrics.page_failed_total.inc()
                log.warning("page.spill_failed", page=page, file=file, kept=True, error=e.to_dict())
                raise
            finally:
                # The RAM page goes only once its file is durable, and before anyone can
                # publish over that file: a failed or cancelled spill (a full or read-only
                # page folder, EIO) leaves the page where it was.
                with anyio.CancelScope(shield=True):
                    dropped = await self.pages.ask(SpillEnd(gen=held.gen, drop=drop and durable))
        self.metrics.page_spill_total.inc()
        t_ms = (time.perf_counter() - t0) * 1e3
        log.info("page.spilled", page=page, file=file, n_bytes=stats.n_bytes, dropped=dropped, t_ms=round(t_ms, 3))
        return {"page": page, "file": file, "n_bytes": stats.n_bytes, "dropped": dropped, "t_ms": t_ms}

    async def slot_save(self, slot: int, file: str) -> dict[str, Any]:
        self._check_open()
        await self.dispatcher.input('slot.save', {'slot': slot, 'file': file})
        return await self._slot(slot).ask(SaveSlot(file=file))

    async def slot_restore(self, slot: int, file: str) -> dict[str, Any]:
        self._check_open()
        await self.dispatcher.input('slot.restore', {'slot': slot, 'file': file})
        target = self._slot(slot)
        n = await self.files.n_tokens(file) if self.files is not None and self.scheduler is not None else None
        if not n:
            return await target.ask(RestoreSlot(file=file))  # nothing to hold, or refused by the slot, typed
        # As a page-in: the file's cells (its header says how many) held for this move until
        # it is over, so the steps in flight are never counted against cells it takes.
        assert self.scheduler is not None
        room = await self.scheduler.ask(MakeRoom(slot=slot, cells=n))
        try:
            if room.cells < n:
                raise ContextFull(f"no KV cells for file {file!r} now: it needs {n}, the shared cache "
                                  f"(n_ctx {self.props.n_ctx}) has {room.cells} free for slot {slot}",
                                  file=file, slot=slot, n_tokens=n, free=room.cells)
            return await target.ask(RestoreSlot(file=file))
        finally:
            if room.token:
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.ask_timeout_s):
                    try:
                        await self.scheduler.ask(ReleaseRoom(token=room.token))
                    except ActordError:
                        pass  # stopping

    async def page_stats(self) -> Any:
        await self.dispatcher.input('page.stats', {})
        assert self.pages is not None
        return await self.pages.ask(StoreStats())

    # -- genes -------------------------------------------------------------------------

    async def gene_load(self, path: str, *, default: bool = False) -> Any:
        assert self.residency is not None
        self._check_open()
        await self.dispatcher.input("gene.load", {"path": path, "default": default})
        # A client-named file: regular, bounded, timed, confined to --gene-dir when set
        # (storage/clientfiles.py). Files the operator listed with --gene are not confined.
        files = self.operator_files if path in self.config.gene else self.client_files
        async with files.reading(path) as image:  # counted against --max-gene-read-bytes until loaded
            msg = LoadGene(path=path, image=image, default=default)
            del image
            try:
                return await self.residency.ask(msg)
            except ActordError as e:
                # A refusal's traceback runs through every frame that held the image (the
                # engine's, the residency's, ours): cut it, so the bytes go now, not whenever
                # the cycle collector next looks.
                del msg
                raise e.with_traceback(None) from None

    async def gene_unload(self, gene_id: int) -> Any:
        self._check_open()
        await self.dispatcher.input('gene.unload', {'id': gene_id})
        return await self.residency.ask(UnloadGene(id=gene_id))  # type: ignore[union-attr]

    async def gene_page_out(self, gene_id: int) -> Any:
        self._check_open()
        await self.dispatcher.input('gene.page_out', {'id': gene_id})
        return await self.residency.ask(PageOutGene(id=gene_id))  # type: ignore[union-attr]

    async def gene_page_in(self, gene_id: int) -> Any:
        self._check_open()
        await self.dispatcher.input('gene.page_in', {'id': gene_id})
        return await self.residency.ask(PageInGene(id=gene_id))  # type: ignore[union-attr]

    async def gene_list(self) -> Any:
        await self.dispatcher.input('gene.list', {})
        return await self.residency.ask(ListGenes())  # type: ignore[union-attr]

    # -- introspection -----------------------------------------------------------------

    async def props_dict(self) -> dict[str, Any]:
        assert self.props is not None
        return {
            "model": self.config.model,
            "n_slots": len(self.slots),
            **({"http": self.http_address} if getattr(self, "http_address", None) else {}),
            **msgspec.to_builtins(self.props),
            **PROPS_VERSION,
        }

    async def health(self) -> dict[str, Any]:
        failed = [a.name for a in self.actors() if a.failed]
        return {
            "status": "ok" if not failed else "degraded",
            "failed_actors": failed,
            "uptime_s": round(time.time() - self._started, 3),
            "engine_queue": self.engine.queued,
        }

    def metrics_text(self) -> str:
        return self.metrics.exposition()

    async def step_records(self) -> list[J.StepRecord]:
        return await self.engine.run(J.StepRecords())

    def final_state(self) -> dict[str, Any]:
        """What a replay must reproduce: each actor's state that outlives a request."""
        from actord.service.hooks import state_digest as digest

        # Wall-clock series (creation stamps, seconds busy) differ run to run: not state.
        metrics = {k: v for k, v in self.metrics.snapshot().items() if "_created" not in k and "_seconds" not in k}
        return {
            "slots": [(s.id, digest(s.kv_tokens), s.resume_raw_lcp, [(c.pos, c.n_bytes) for c in s.checkpoints],
                       s.genes, s.mind) for s in self.slots],
            "pages": sorted((n, g) for n, g in self.pages.names.items()) if self.pages else [],
            "charged": self.pages.charged if self.pages else 0,
            "genes": sorted((g.id, g.resident) for g in self.residency.genes.values()) if self.residency else [],
            "ckpt_used": self.ckpt_budget.used if self.ckpt_budget else 0,
            "metrics": sorted(metrics.items()),
        }

    def statistics(self) -> list[Any]:
        return [a.statistics() for a in self.actors()]
