"""The embedded API: `async with ActorSystem(config) as system: await system.complete(...)`.

The system starts the engine thread, builds the actors, binds them to one dispatcher and
runs them in a task group; its methods are typed async calls that send messages and await
replies. It works the same from an asyncio (or uvloop) host and from a trio host, because
it only uses anyio.

The system is a client of its actors (above them all in the ask order): it may ask any of
them, always within a bound (`request_timeout_s` for a completion, `ask_timeout_s` for the
rest). Stopping is bounded too: `shutdown(grace)` refuses new work, lets requests in flight
finish within the grace, cancels the rest, then writes every mind to her page file within
`shutdown_persist_s` (service/persist.py), and leaving the context closes every mailbox and
gives the actors a bounded time to drain before they are cancelled.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Generic, TypeVar

import anyio
import msgspec

from actord.chat.state import ChatState
from actord.engine import jobs as J
from actord.engine.engine import Engine
from actord.engine.grammar import compiled
from actord.service import introspection, memory, slot_ctx, tenancy, text
from actord.service.builder import Actors, build_actors, engine_thread, failure_handler
from actord.vocabulary.config import Config
from actord.service.entry import entry
from actord.vocabulary.errors import ActordError, AskTimeout, InvalidParams, PageNotFound, ShuttingDown, SlotNotFound
from actord.service.genes import GeneFiles
from actord.vocabulary.trace import attach_recorder
from actord.service.inflight import InFlight
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics
from actord.service.protocol import Embedded, MemoryView, OnToken, TemplateSource, Tokenized
from actord.service.persist import Persister
from actord.service.placement import Placement
from actord.service.prompt_cache import CacheTurns, stale_files
from actord.service.spill import spill_page
from actord.vocabulary.types import CompletionRequest, CompletionResult, RequestLimits, SlotInfo
from actord.policy.yielding import YIELD, continuation, merged
from actord.serving.checkpoint_budget import BudgetStats, CheckpointBudget
from actord.serving.gene_residency import GeneResidency, ListGenes, PageInGene, PageOutGene, UnloadGene
from actord.serving.kernel import Actor, Dispatcher
from actord.serving.messages import CancelRequest, Complete, Erase, Info, PageInSlot, PageOutSlot, RestoreSlot, SaveSlot
from actord.serving.page_store import DropPage, ListPages, PageStore, StoreStats
from actord.serving.placer import CancelPlaced, MindPlacer, PlaceMind
from actord.serving.scheduler import Scheduler
from actord.serving.slot import Slot
from actord.storage.files import PageFiles
from actord.vocabulary.names import MIND_FILE_SUFFIX

T = TypeVar("T")
P = TypeVar("P")

log = get("actord.service.system")


def _continued(on_token: OnToken | None) -> OnToken | None:
    """A continuation's stream: its chunks without the prompt's placement, which the
    request's first chunk told (the continuation's prompt is the request's, and more)."""
    if on_token is None:
        return None

    def sink(chunk: dict[str, Any]) -> None:
        chunk.pop("n_prompt", None)
        chunk.pop("n_cached", None)
        on_token(chunk)

    return sink


def _decode(params: dict[str, Any], typ: type[T]) -> T:
    """A verb called with keyword arguments instead of its request: decoded as the socket decodes it."""
    try:
        return msgspec.convert(params, typ)
    except msgspec.ValidationError as e:
        raise InvalidParams(str(e)) from None


class _Part(Generic[P]):
    """A read-only view of one of the actors start built (`ActorSystem.built`), by name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, system: Any, owner: type | None = None) -> P:
        return getattr(system.built, self.name)


class ActorSystem:
    # The mind placer's class: a host may give a subclass with more verbs (the cluster's
    # node daemon does, actord/cluster/placer.py); the builder makes it as this one.
    placer_class: type[MindPlacer] = MindPlacer
    stop_requested: anyio.Event | None = None  # set by the `stop` verb (made at start); the daemon waits on it

    def __init__(self, config: Config, *, engine_factory: Callable[[Config], Any] | None = None,
                 dispatcher: Dispatcher | None = None, trace: Any = None, http_address: str | None = None) -> None:
        """`http_address`: where the daemon's HTTP front listens (bound before the model
        loads), which `props` reports."""
        self.config = config.validate()
        self.metrics = Metrics()
        self.dispatcher = dispatcher or Dispatcher()
        self.dispatcher.ask_bound_s = self.config.ask_timeout_s
        self.engine = engine_thread(self.config, engine_factory or Engine, self.dispatcher)
        self.recorder = attach_recorder(trace if trace is not None else self.config.trace, self.config, self.dispatcher)
        self.http_address = http_address
        self._props: J.ModelProps | None = None
        self._actors: Actors | None = None
        self.default_genes: list[int] = []  # --gene files, loaded at start; every slot applies them
        self._limits = self.config.request_limits()
        c = self.config
        # Thread work that is no event of its own (a gene file read, a client's chat template)
        # goes through the dispatcher: a deterministic one must know the work is in flight
        # to tell when the system is quiet.
        self.run_sync: Callable[..., Any] = self.dispatcher.run_sync
        self.files = PageFiles(c.page_dir, threads=c.disk_threads, offload=self.dispatcher.offload,
                               disk_bytes=c.page_disk_bytes, metrics=self.metrics, share_bases=c.page_file_bases)
        self.gene_files = GeneFiles(c, self.run_sync)
        self.chat_state = ChatState()
        self._tg: Any = None
        self._started = time.time()
        self.closing = False
        self.inflight = InFlight()
        self.memory_sources = memory.MemorySources()  # bytes the fronts hold, read by memory_report
        self.text_verbs = text.TextVerbs(self, self.engine)
        self.prompt_cache = CacheTurns(c, self.metrics, self.default_genes, self._forget, self._resident_minds)
        self._persister: Persister | None = None
        self._placement: Placement | None = None
        self._persisted = False

    # -- what start built (typed; reading one before the start is a bug) ---------------

    @property
    def props(self) -> J.ModelProps:
        if self._props is None:
            raise ShuttingDown("the system is not running")
        return self._props

    def model_props(self) -> J.ModelProps:
        return self.props

    @property
    def asleep(self) -> bool:
        """The idle daemon freed its model and context (service/sleep.py); the next request
        that needs the engine wakes it."""
        return bool(getattr(self.engine, "asleep", False))

    def request_limits(self) -> RequestLimits:
        """The bounds every request is checked against (a pure recurrent model's prompt is
        bounded by bytes only: it has no n_ctx cells)."""
        return self._limits

    @property
    def built(self) -> Actors:
        if self._actors is None:
            raise ShuttingDown("the system is not running")
        return self._actors

    @property
    def placement(self) -> Placement:
        if self._placement is None:
            raise ShuttingDown("the system is not running")
        return self._placement

    @property
    def slots(self) -> list[Slot]:
        return self._actors.slots if self._actors is not None else []

    scheduler: _Part[Scheduler] = _Part()
    pages: _Part[PageStore] = _Part()
    residency: _Part[GeneResidency] = _Part()
    ckpt_budget: _Part[CheckpointBudget] = _Part()
    placer: _Part[MindPlacer] = _Part()

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> "ActorSystem":
        self.stop_requested = anyio.Event()
        t0 = time.perf_counter()
        # The page folder's index first (names and sizes, no file read): minds come back
        # lazily from their files, at their next request.
        n_files = await self.files.start()
        log.info("page_files.indexed", files=n_files, bytes=self.files.index.used,
                 t_ms=round((time.perf_counter() - t0) * 1e3, 1))
        await self.engine.start()
        try:
            self._props = await self.engine.run(J.ModelInfo())
            if not self._props.kv_cells:  # pure recurrent: a prompt is not bounded by n_ctx
                self._limits = msgspec.structs.replace(self._limits, max_prompt_tokens=self._limits.max_prompt_bytes)
            self._actors = build_actors(self.config, self._props, self.dispatcher, self.engine, self.metrics,
                                        self.files, self._spill_page, self.default_genes, self.placer_class)
            c = self.config
            self._placement = Placement(self._actors.slots, self._actors.scheduler, self._actors.index, self.inflight,
                                        self._props, c.ask_timeout_s, self.default_genes)
            self._persister = Persister(self._actors.slots, self._actors.pages, self._spill_page, self.metrics,
                                        window_s=c.write_behind_s, threads=c.disk_threads,
                                        ask_timeout_s=c.ask_timeout_s)
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            await self.engine.stop()
            raise
        try:
            self.dispatcher.bind(self._tg)
            on_failure = failure_handler(self.built, self.metrics)
            for actor in self.actors():
                actor.on_failure = on_failure
                self.dispatcher.spawn(actor)
            for name in stale_files(self.files.index.files):  # the prompt cache's, from another process
                await self.files.remove(name)
            # Which files a client kept by name, and which base files are used: read in the background.
            self._tg.start_soon(self._sweep_files)
            for path in self.config.gene:
                info = await self.gene_load(path, default=True)
                self.default_genes.append(info.id)
        except BaseException:
            # A failed start leaves nothing running: actors stopped, engine thread joined.
            # (Not inside a shielding scope of ours: the task group's own scope must be the
            # current one when it exits; the engine's stop is shielded in __aexit__.)
            await self.__aexit__(None, None, None)
            raise
        introspection.log_started(self.props, self.config)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.closing = True
        for actor in self.actors():
            actor.close()
        self.dispatcher.close_actors()
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
        counts = await self.inflight.drain(grace, self._cancel)
        if self.config.persist_on_stop and self._persister is not None and not self._persisted:
            self._persisted = True
            self._persister.stop_background()  # no write-behind pass races the stop's own
            counts.update(await self.persist())
        return counts

    @entry("persist", check_open=False)
    async def persist(self) -> dict[str, int]:
        """Write every mind not yet in her page file (slots and RAM pages) now, within
        `shutdown_persist_s`; a graceful stop does this last. An input of its own, so a
        trace that holds a stop replays it."""
        assert self._persister is not None, "the system is not running"
        return await self._persister.persist_all(self.config.shutdown_persist_s)

    async def _sweep_files(self) -> None:
        try:
            await self.files.sweep()
        except ActordError as e:  # no base file is removed, and no file found at start evicted, until one succeeds
            log.warning("page_files.sweep_failed", error=e.to_dict())

    async def write_behind(self) -> None:
        """Run write-behind (service/persist.py) until cancelled or stopped: the daemon
        runs it beside its servers; an embedding host may run it in its own task group."""
        if self._persister is not None:
            await self._persister.run()

    async def write_behind_tick(self, now: float) -> int:
        """One write-behind pass at `now` (monotonic seconds): the minds written."""
        assert self._persister is not None, "the system is not running"
        return await self._persister.tick(now)

    @entry("stop", check_open=False)
    async def stop(self) -> dict[str, Any]:
        """Ask the daemon to stop gracefully, as SIGTERM does (the daemon waits on
        `stop_requested`); an embedding host reads the event itself."""
        log.info("system.stop_requested")
        if self.stop_requested is not None:
            self.stop_requested.set()
        return {"stopping": True}

    def check_open(self) -> None:
        if self.closing:
            raise ShuttingDown("the daemon is shutting down")

    def abort(self) -> None:
        """Cancel every actor now (a replay that diverged, a simulated crash)."""
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def actors(self) -> list[Actor[Any]]:
        return self._actors.all() if self._actors is not None else []

    # -- completions -------------------------------------------------------------------

    def _slot(self, slot: int) -> Slot:
        if not isinstance(slot, int) or not 0 <= slot < len(self.slots):
            raise SlotNotFound(f"no slot {slot}", slot=slot, n_slots=len(self.slots))
        return self.slots[slot]

    async def complete(self, request: CompletionRequest | None = None, *, on_token: OnToken | None = None,
                       _input: bool = True, _cached: bool = True, **params: Any) -> CompletionResult:
        """Run one completion. `on_token` (sync, must not block) receives streamed chunks.

        (`_input=False`: a completion made by another verb, e.g. `chat`, whose own input a
        trace already holds; a replay re-executes that verb, not this completion.
        `_cached=False`: one of n choices' completions, which place themselves by slot: not
        run as a mind of the prompt cache's.)"""
        if request is None:
            request = _decode(params, CompletionRequest)
        request = compiled(tenancy.stamp(request).check(self._limits))  # a json_schema comes back as its grammar
        self.check_open()
        if _input:
            await self.dispatcher.input("completion", request)
        request = request.with_scoped_mind()
        if self.config.ctx_per_slot:  # each slot held to n_ctx / slots (actord/service/slot_ctx.py)
            request = await slot_ctx.fit(self, request)
        if _cached:
            request = await self.prompt_cache.begin(request, self.tokens_of, self.props)
        rid = self.inflight.open()
        rids = [rid]  # one per part: a generation that gives its slot up goes on under another
        bound = self.config.request_timeout_s
        slot: Slot | None = None
        try:
            if request.mind is not None:
                try:
                    result = await self._run_mind(request, on_token, bound, rids)
                except BaseException:
                    self.prompt_cache.failed(request)
                    raise
                return introspection.answered(self.metrics, await self.prompt_cache.end(request, result, self.props))
            if request.slot is not None:
                slot = self._slot(request.slot)
            else:
                slot = await self.placement.place(request)
            self.inflight.slots[rid] = slot.id
            return introspection.answered(self.metrics, await slot.ask(Complete(rid=rid, req=request), stream=on_token,
                                                               timeout=bound))
        except (anyio.get_cancelled_exc_class(), AskTimeout):
            # The caller is gone (or out of time): the request ends at its next step.
            await self._cancel(rids[-1], slot.id if slot is not None else None)
            raise
        finally:
            self.inflight.release(rids)

    async def _run_mind(self, request: CompletionRequest, on_token: OnToken | None, bound: float,
                        rids: list[int]) -> CompletionResult:
        """A mind's request, placed by the placer. A part that gave its slot up to a waiting
        mind (policy/yielding.py) goes on as a continuation, placed after the minds it gave
        way to, within the request's one time bound; the caller gets one answer."""
        deadline = time.monotonic() + bound
        parts: list[CompletionResult] = []
        prompt: list[int] = []
        req, stream = request, on_token
        while True:
            left = max(1e-3, deadline - time.monotonic())
            spent = parts[-1].timings.engine_ms / 1e3 if parts else 0.0  # each part's account goes on
            part = await self.placer.ask(
                PlaceMind(complete=Complete(rid=rids[-1], req=req, yielded=bool(parts), engine_s=spent)),
                stream=stream, timeout=left)
            parts.append(part)
            if part.stop_reason != YIELD:
                return part if len(parts) == 1 else merged(parts)
            if not prompt:
                prompt = request.prompt if isinstance(request.prompt, list) else await self.tokens_of(request.prompt)
            req, stream = continuation(request, prompt, parts), _continued(on_token)
            rids.append(self.inflight.open())

    async def complete_n(self, request: CompletionRequest, n: int, *,
                         on_token: OnToken | None = None) -> list[CompletionResult]:
        """n completions of one prompt, prefilled once (actord/chat/choices.py), by index; each
        streamed chunk carries its choice's `index`."""
        from actord.chat.choices import complete_choices

        request = tenancy.stamp(request)
        await self.dispatcher.input("completion", request)
        return await complete_choices(self, request, n, on_token)

    async def fork_prefix(self, source: int, prefix: list[int], want: int) -> list[int]:
        """Up to `want` idle slots made to hold slot `source`'s `prefix` (n choices: actord/chat/choices.py)."""
        return await self.placement.fork_prefix(source, prefix, want)

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

    async def chat(self, request: Any = None, *, on_token: OnToken | None = None, n: int = 1, **params: Any) -> Any:
        """Run one chat turn: messages rendered with the model's chat template (actord.chat.template).

        A conversation this system served before comes back as the exact tokens of its
        last prompt + reply, so its mind decodes only the new messages. Returns a
        `ChatResult` (the reply message, the completion's result and usage); with `n` > 1,
        a list of n, one per choice (actord/chat/choices.py: choice 0's reply is the one remembered).
        """
        from actord.chat.messages import ChatRequest
        from actord.chat.turn import check_turn, run_turn

        request = tenancy.stamp(request if request is not None else _decode(params, ChatRequest))
        check_turn(self, request, n)  # a turn refused is not recorded
        await self.dispatcher.input("chat", request)
        return await run_turn(self, request, on_token, n)

    # -- text, without generating (actord/service/text.py) -------------------------------

    async def chat_info(self) -> J.ChatTemplateInfo:
        """The model's own chat template and its BOS/EOS texts (not an input: no trace holds it)."""
        return await self.engine.run(J.ChatInfo())

    async def tokens_of(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return await self.engine.run(J.Tokenize(text=text, add_special=add_special, parse_special=parse_special))

    async def text_of(self, tokens: list[int]) -> str:
        return await self.engine.run(J.Detokenize(tokens=tokens))

    async def pieces_of(self, tokens: list[int]) -> list[bytes]:
        return await self.engine.run(J.Pieces(tokens=tokens, special=True))

    @entry("tokenize", check_open=False, check=text.check_content)
    async def tokenize(self, content: str, add_special: bool = False, parse_special: bool = True,
                       with_pieces: bool = False) -> Tokenized:
        return await self.text_verbs.tokenize(content, add_special, parse_special, with_pieces)

    @entry("detokenize", check_open=False)
    async def detokenize(self, tokens: list[int]) -> str:
        return await self.text_verbs.detokenize(tokens)

    @entry("chat.template", check_open=False)
    async def chat_template(self) -> TemplateSource:
        return await self.text_verbs.template_source()

    @entry("apply_template", check_open=False, check=text.check_apply)
    async def apply_template(self, messages: list[Any], template: str | None = None,
                             add_generation_prompt: bool = True, tools: list[Any] | None = None,
                             template_kwargs: dict[str, Any] | None = None) -> str:
        return await self.text_verbs.apply_template(messages, template, add_generation_prompt, tools, template_kwargs)

    async def count_prompt(self, messages: list[Any], template: str | None = None, add_generation_prompt: bool = True,
                           tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None) -> int:
        return await self.text_verbs.count_prompt(messages, template, add_generation_prompt, tools, template_kwargs)

    async def embed(self, inputs: list[str | list[int]]) -> Embedded:
        """One pooled vector per input (not recorded: a trace holds no embeddings)."""
        return await self.text_verbs.embed(inputs)

    # -- slots -------------------------------------------------------------------------

    @entry("slot.list", check_open=False)
    async def slot_list(self) -> list[SlotInfo]:
        scope = tenancy.scope()  # a front's client sees her own minds' names only
        return [tenancy.own_slot(await s.ask(Info(scope=scope)), scope) for s in self.slots]

    @entry("slot.erase")
    async def slot_erase(self, slot: int) -> dict[str, Any]:
        # Another tenant's sequence is not the caller's to erase: answered as an empty slot.
        return await self._slot(slot).ask(Erase(scope=tenancy.scope()))

    # -- pages -------------------------------------------------------------------------

    @entry("page.out")
    async def page_out(self, slot: int, page: str) -> dict[str, Any]:
        if not page:
            raise InvalidParams("page name is empty")
        # Page names are the caller's scope's (service/tenancy.py), here and in every page verb.
        return tenancy.client_answer(await self._slot(slot).ask(PageOutSlot(page=tenancy.own_name(page, "page"),
                                                                             scope=tenancy.scope())))

    @entry("page.in")
    async def page_in(self, slot: int, page: str) -> dict[str, Any]:
        self._slot(slot)  # SlotNotFound first
        own = tenancy.own_name(page, "page")
        with tenancy.as_client(page):
            n = self.built.index.page_tokens(own)  # one page's size, as the page store published it
            if n is None:
                # Not asked of the slot: a page published after this look (another client's
                # page-out into that name) would move in with no cells held for it.
                raise PageNotFound(f"no page named {own!r}", page=own)
            # The slot refuses a page replaced by a larger one since this look (room_cells).
            return tenancy.client_answer(await self.placement.with_room(
                slot, n, PageInSlot(page=own, room_cells=n), page=own))

    @entry("page.drop")
    async def page_drop(self, page: str) -> Any:
        with tenancy.as_client(page):
            return tenancy.client_answer(await self.pages.ask(DropPage(name=tenancy.own_name(page, "page"))))

    async def forget_mind(self, mind: str) -> int:
        """Drop mind `mind`'s RAM page and remove its page file, whichever it has (the HTTP
        front's rule for the minds it made for anonymous conversations); the bytes freed. A
        mind resident in a slot stays there (0): its next page-out is forgotten next time."""
        n = 0
        try:
            n += (await self.page_drop(mind)).n_bytes
        except PageNotFound:
            pass
        return n + await self.files.remove(tenancy.own_name(mind + MIND_FILE_SUFFIX, "mind", file=True))

    async def _forget(self, mind: str) -> int:
        """`forget_mind` for a mind by the daemon's own name (the prompt cache's), inside a
        verb already recorded: no input of its own, no scope applied."""
        n = 0
        try:
            n += (await self.pages.ask(DropPage(name=mind))).n_bytes
        except PageNotFound:
            pass
        return n + await self.files.remove(mind + MIND_FILE_SUFFIX)

    async def _resident_minds(self) -> set[str]:
        """The minds in slots, by the daemon's names."""
        return {i.mind for i in [await s.ask(Info()) for s in self.slots] if i.mind}

    @entry("page.list", check_open=False)
    async def page_list(self, after: str = "", limit: int = 0) -> Any:
        """The pages by name: those after `after`, at most `limit` (0: all)."""
        if limit < 0:
            raise InvalidParams("limit is >= 0 (0: all)", limit=limit)
        # A front's client lists her own scope's pages, by the names she gave them.
        return await self.pages.ask(ListPages(after=after, limit=limit, scope=tenancy.scope()))

    @entry("checkpoint.stats", check_open=False)
    async def checkpoint_stats(self) -> Any:
        return await self.ckpt_budget.ask(BudgetStats())

    @entry("page.spill")
    async def page_spill(self, page: str, file: str, drop: bool = False) -> dict[str, Any]:
        """Write a page to a page file on a worker thread; with drop, free that generation.

        The store holds the page for the spill's whole duration, so its charge keeps counting
        even if the page is paged in, dropped or replaced meanwhile.
        """
        own = tenancy.own_name(page, "page")
        with tenancy.as_client(page):
            # A client's file by name: the disk budget never evicts it (storage/disk_index.py).
            return tenancy.client_answer(await self._spill_page(own, tenancy.own_name(file, "file", file=True), drop,
                                                                kept=True))

    def _spill_page(self, page: str, file: str, drop: bool, *, kept: bool = False) -> Awaitable[dict[str, Any]]:
        return spill_page(self.pages, self.files, self.props, self.metrics, page, file, drop, kept=kept)

    @entry("slot.save")
    async def slot_save(self, slot: int, file: str) -> dict[str, Any]:
        return tenancy.client_answer(await self._slot(slot).ask(SaveSlot(file=tenancy.own_name(file, "file", file=True),
                                                                          scope=tenancy.scope(), kept=True)))

    @entry("slot.restore")
    async def slot_restore(self, slot: int, file: str) -> dict[str, Any]:
        target = self._slot(slot)
        file = tenancy.own_name(file, "file", file=True)  # the caller's scope's file
        n = await self.files.n_tokens(file)  # the file's cells, as its header says
        if not n:  # nothing to hold, or refused by the slot, typed (one holding cells: ContextFull, nothing moved)
            return tenancy.client_answer(await target.ask(RestoreSlot(file=file, room_cells=0)))
        return tenancy.client_answer(await self.placement.with_room(slot, n, RestoreSlot(file=file, room_cells=n),
                                                                    file=file))

    @entry("page.stats", check_open=False)
    async def page_stats(self) -> Any:
        return await self.pages.ask(StoreStats())

    # -- genes -------------------------------------------------------------------------

    @entry("gene.load")
    async def gene_load(self, path: str, *, default: bool = False) -> Any:
        """A client-named file: regular, bounded, timed, confined to --gene-dir when set
        (actord/service/genes.py). Files the operator listed with --gene are not confined."""
        return await self.gene_files.load(self.residency, path, default)

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

    def default_gene_ids(self) -> set[int]:
        """The genes every request applies unless it says otherwise (--gene, `gene.load` default)."""
        return {g.id for g in self.residency.genes.values() if g.default} if self._actors is not None else set()

    # -- introspection (actord/service/introspection.py) ---------------------------------

    async def props_dict(self) -> dict[str, Any]:
        return introspection.props_dict(self.config.model, len(self.slots), self.http_address, self.props)

    async def health(self) -> dict[str, Any]:
        return introspection.health(self.actors(), self._started, self.engine.queued)

    async def memory(self, after: str = "", limit: int = 0) -> MemoryView:
        if limit < 0:
            raise InvalidParams("limit is >= 0 (0: all)", limit=limit)
        return await introspection.memory(self.built, self.files.index, self.props, self.metrics, after, limit)

    def metrics_text(self) -> str:
        return self.metrics.exposition()

    async def memory_report(self) -> memory.MemoryReport:
        """`stats memory`: bytes by what holds them, RSS and the rest (actord/service/memory.py)."""
        return await memory.report(self.built, self.engine, self.config, self.props, self.chat_state,
                                   self.memory_sources)

    def n_deferred(self) -> int:
        """Requests waiting for a slot (llama-server's `requests_deferred`)."""
        return sum(s.deferred_count() for s in self.slots)

    async def step_records(self) -> list[J.StepRecord]:
        return await self.engine.run(J.StepRecords())

    def final_state(self) -> dict[str, Any]:
        """What a replay must reproduce: each actor's state that outlives a request."""
        return introspection.final_state(self._actors, self.metrics)

    def statistics(self) -> list[Any]:
        return [a.statistics() for a in self.actors()]
