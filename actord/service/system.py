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

import functools
import inspect
import itertools
import time
from typing import Any, Awaitable, Callable, TypeVar

import anyio
import msgspec

from actord.engine import jobs as J
from actord.engine.engine import Engine, run_job
from actord.engine.thread import EngineThread
from actord.service.builder import Actors, build_actors
from actord.service.config import Config
from actord.service.errors import ActordError, AskTimeout, ContextFull, InvalidParams, NoFreeSlot, ShuttingDown, SlotNotFound
from actord.service.log import get
from actord.service.metrics import Metrics
from actord.service.spill import spill_page
from actord.service.types import CompletionRequest, CompletionResult, SlotInfo
from actord.serving.checkpoint_budget import BudgetStats, CheckpointBudget
from actord.serving.gene_residency import GeneResidency, ListGenes, LoadGene, PageInGene, PageOutGene, UnloadGene
from actord.serving.kernel import Actor, Dispatcher
from actord.serving.messages import (
    CancelRequest, Complete, Erase, Info, PageInSlot, PageOutSlot, RestoreSlot, SaveSlot, SlotLost,
)
from actord.serving.page_store import DropPage, ListPages, PageStore, StoreStats
from actord.serving.placer import CancelPlaced, MindPlacer, PlaceMind
from actord.serving.room import holding_room
from actord.serving.scheduler import Scheduler
from actord.serving.slot import Slot, common_prefix
from actord.storage.clientfiles import ByteBudget, ClientFiles
from actord.storage.files import PageFiles

log = get("actord.service.system")

PROPS_VERSION = {"slot_page_version": 1, "lora_page_version": 1}

V = TypeVar("V", bound=Callable[..., Awaitable[Any]])


def entry(method: str, *, check_open: bool = True, **names: str) -> Callable[[V], V]:
    """A verb's entry at the façade: refused once the system is closing (`check_open`), and
    recorded as the external input `method` with its arguments (under the RPC's parameter
    names: `names` maps an RPC name to the argument's), so a replay re-executes it. One hook
    here instead of the same two lines in every verb."""
    def deco(fn: V) -> V:
        sig = inspect.signature(fn)
        rpc_name = {arg: rpc for rpc, arg in names.items()}

        @functools.wraps(fn)
        async def verb(self: "ActorSystem", *args: Any, **kwargs: Any) -> Any:
            if check_open:
                self._check_open()
            bound = sig.bind(self, *args, **kwargs)
            bound.apply_defaults()
            params = {rpc_name.get(k, k): v for k, v in list(bound.arguments.items())[1:]}
            await self.dispatcher.input(method, params)
            return await fn(self, *args, **kwargs)

        return verb  # type: ignore[return-value]

    return deco


class ActorSystem:
    # The mind placer's class: a host may give a subclass with more verbs (the cluster's
    # node daemon does, actord/cluster/placer.py); the builder makes it as this one.
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
        self._props: J.ModelProps | None = None
        self._actors: Actors | None = None
        self.default_genes: list[int] = []  # --gene files, loaded at start; every slot applies them
        self._rids = itertools.count(1)
        self._limits = self.config.request_limits()
        c = self.config
        # Thread work that is no event of its own (a gene file read, a client's chat template)
        # goes through a deterministic dispatcher's run_sync: it must know the work is in
        # flight to tell when the system is quiet. The plain dispatcher has no such seam.
        self._run_sync: Callable[..., Any] = getattr(self.dispatcher, "run_sync", anyio.to_thread.run_sync)
        self.files = PageFiles(c.page_dir, threads=c.disk_threads, offload=self.dispatcher.offload)
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

    # -- what start built (typed; reading one before the start is a bug) ---------------

    @property
    def props(self) -> J.ModelProps:
        if self._props is None:
            raise ShuttingDown("the system is not running")
        return self._props

    @property
    def built(self) -> Actors:
        if self._actors is None:
            raise ShuttingDown("the system is not running")
        return self._actors

    @property
    def slots(self) -> list[Slot]:
        return self._actors.slots if self._actors is not None else []

    @property
    def scheduler(self) -> Scheduler:
        return self.built.scheduler

    @property
    def pages(self) -> PageStore:
        return self.built.pages

    @property
    def residency(self) -> GeneResidency:
        return self.built.residency

    @property
    def ckpt_budget(self) -> CheckpointBudget:
        return self.built.ckpt_budget

    @property
    def placer(self) -> MindPlacer:
        return self.built.placer

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> "ActorSystem":
        await self.engine.start()
        try:
            self._props = await self.engine.run(J.ModelInfo())
            if not self._props.kv_cells:  # pure recurrent: a prompt is not bounded by n_ctx
                self._limits = msgspec.structs.replace(self._limits, max_prompt_tokens=self._limits.max_prompt_bytes)
            self._actors = build_actors(self.config, self._props, self.dispatcher, self.engine, self.metrics,
                                        self.files, self._spill, self.default_genes, self.placer_class)
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
                self.default_genes.append(info.id)
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

    def actors(self) -> list[Actor[Any]]:
        return self._actors.all() if self._actors is not None else []

    def _on_actor_failure(self, actor: Actor[Any], error: BaseException) -> None:
        self.metrics.actor_failures_total.labels(actor=actor.name).inc()
        if isinstance(actor, Slot) and not self.scheduler.failed:
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
                else:
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

    @entry("slot.list", check_open=False)
    async def slot_list(self) -> list[SlotInfo]:
        return [await s.ask(Info()) for s in self.slots]

    @entry("slot.erase")
    async def slot_erase(self, slot: int) -> dict[str, Any]:
        return await self._slot(slot).ask(Erase())

    # -- pages -------------------------------------------------------------------------

    @entry("page.out")
    async def page_out(self, slot: int, page: str) -> dict[str, Any]:
        if not page:
            raise InvalidParams("page name is empty")
        return await self._slot(slot).ask(PageOutSlot(page=page))

    @entry("page.in")
    async def page_in(self, slot: int, page: str) -> dict[str, Any]:
        target = self._slot(slot)
        held = {p.page: p.n_tokens for p in await self.pages.ask(ListPages())}
        if page not in held:
            return await target.ask(PageInSlot(page=page))  # refused by the slot, typed
        # KV cells for the page, from idle slots if need be, held for this move until it is
        # over, however it ends (no count is left behind by a refused page-in).
        async with holding_room(self.scheduler, slot, held[page], release_timeout=self.config.ask_timeout_s) as room:
            if room.cells < held[page]:
                raise ContextFull(f"no KV cells for page {page!r} now: it needs {held[page]}, the shared cache "
                                  f"(n_ctx {self.props.n_ctx}) has {room.cells} free for slot {slot}",
                                  page=page, slot=slot, n_tokens=held[page], free=room.cells)
            return await target.ask(PageInSlot(page=page))

    @entry("page.drop")
    async def page_drop(self, page: str) -> Any:
        return await self.pages.ask(DropPage(name=page))

    @entry("page.list", check_open=False)
    async def page_list(self) -> Any:
        return await self.pages.ask(ListPages())

    @entry("checkpoint.stats", check_open=False)
    async def checkpoint_stats(self) -> Any:
        return await self.ckpt_budget.ask(BudgetStats())

    @entry("page.spill")
    async def page_spill(self, page: str, file: str, drop: bool = False) -> dict[str, Any]:
        """Write a page to a page file on a worker thread; with drop, free that generation.

        The store holds the page for the spill's whole duration, so its charge keeps counting
        even if the page is paged in, dropped or replaced meanwhile.
        """
        return await self._spill(page, file, drop)

    async def _spill(self, page: str, file: str, drop: bool) -> dict[str, Any]:
        return await spill_page(self.pages, self.files, self.props, self.metrics, page, file, drop)

    @entry("slot.save")
    async def slot_save(self, slot: int, file: str) -> dict[str, Any]:
        return await self._slot(slot).ask(SaveSlot(file=file))

    @entry("slot.restore")
    async def slot_restore(self, slot: int, file: str) -> dict[str, Any]:
        target = self._slot(slot)
        n = await self.files.n_tokens(file)
        if not n:
            return await target.ask(RestoreSlot(file=file))  # nothing to hold, or refused by the slot, typed
        # As a page-in: the file's cells (its header says how many) held for this move until
        # it is over, so the steps in flight are never counted against cells it takes.
        async with holding_room(self.scheduler, slot, n, release_timeout=self.config.ask_timeout_s) as room:
            if room.cells < n:
                raise ContextFull(f"no KV cells for file {file!r} now: it needs {n}, the shared cache "
                                  f"(n_ctx {self.props.n_ctx}) has {room.cells} free for slot {slot}",
                                  file=file, slot=slot, n_tokens=n, free=room.cells)
            return await target.ask(RestoreSlot(file=file))

    @entry("page.stats", check_open=False)
    async def page_stats(self) -> Any:
        return await self.pages.ask(StoreStats())

    # -- genes -------------------------------------------------------------------------

    @entry("gene.load")
    async def gene_load(self, path: str, *, default: bool = False) -> Any:
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

    @entry("gene.unload", id="gene_id")
    async def gene_unload(self, gene_id: int) -> Any:
        return await self.residency.ask(UnloadGene(id=gene_id))

    @entry("gene.page_out", id="gene_id")
    async def gene_page_out(self, gene_id: int) -> Any:
        return await self.residency.ask(PageOutGene(id=gene_id))

    @entry("gene.page_in", id="gene_id")
    async def gene_page_in(self, gene_id: int) -> Any:
        return await self.residency.ask(PageInGene(id=gene_id))

    @entry("gene.list", check_open=False)
    async def gene_list(self) -> Any:
        return await self.residency.ask(ListGenes())

    # -- introspection -----------------------------------------------------------------

    async def props_dict(self) -> dict[str, Any]:
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
        a = self._actors
        return {
            "slots": [(s.id, digest(s.kv_tokens), s.resume_raw_lcp, [(c.pos, c.n_bytes) for c in s.checkpoints],
                       s.genes, s.mind) for s in self.slots],
            "pages": sorted((n, g) for n, g in a.pages.names.items()) if a else [],
            "charged": a.pages.charged if a else 0,
            "genes": sorted((g.id, g.resident) for g in a.residency.genes.values()) if a else [],
            "ckpt_used": a.ckpt_budget.used if a else 0,
            "metrics": sorted(metrics.items()),
        }

    def statistics(self) -> list[Any]:
        return [a.statistics() for a in self.actors()]
