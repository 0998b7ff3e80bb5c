"""NodeDaemon: one per Ray node, hosting today's `ActorSystem` on the actor's event loop.

Ray runs it as a detached, named async actor (`local.start_node`: num_cpus=0, num_gpus
where the node has one, hard node affinity, max_restarts=-1, max_task_retries=0). The
system is started by the first call, in a host task of the default concurrency group's
loop that holds the system's context for the actor's life; the engine thread is its own,
as on one machine. `health` runs in the "control" concurrency group, on another loop: it
answers while the work loop or the engine is busy.

Every work method answers an `Answer` (a value or a typed error). Turns are fenced
(fence.py): a stale epoch or a duplicate turn id is refused before anything runs; a turn's
answer is recorded durably before it leaves the node. A turn is a completion or a chat
(`Turn.kind`): a chat is rendered here, by the system's own `chat` (the model's template,
this node's turn memory), so a mind's next turn reuses its last as on one daemon. `free`
runs a request of no mind (the HTTP front's, placed as one daemon places it; not fenced).
A streamed turn cancelled by the router (its client went away) cancels the work. On a restart the daemon reloads its
fences and finds its minds' page files where the last incarnation spilled them (the page
files are the durable copy; Ray's object store never is); `holdings` reports them.

Fault points (`arm_fault`) let the tests kill the process at a chosen step with
`os._exit`, as a crash would: "turn_mid" (at the turn's first streamed token, or after N),
"turn_after_apply" (applied, not recorded), "turn_after_record" (recorded, reply not sent),
"export_after_spill" (a migration's source, after it made the page durable).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

import anyio
import msgspec
import ray

from actord.serving.placer import mind_file
from actord.vocabulary.types import CompletionRequest
from actord.cluster.fence import FenceBook, MindFence
from actord.chat.messages import ChatRequest
from actord.cluster.messages import KINDS, Answer, Holding, NodeLoad, Turn
from actord.cluster.placer import ClusterPlacer, ForgetMind, PersistMind
from actord.cluster.transfer import PageBlob, pack, unpack
from actord.vocabulary.config import ClusterConfig
from actord.vocabulary.errors import ActordError, DuplicateTurn, InvalidParams, NodeUnavailable, StaleEpoch
from actord.vocabulary.log import get
from actord.storage.osfs import OsFs
from actord.storage.pagefile import sidecar_paths
from actord.vocabulary.names import check_part
from actord.storage.publish import read_generation
from actord.service.background import run_background
from actord.service.system import ActorSystem
from actord.vocabulary import log as actord_log

log = get("actord.cluster.node")

FAULTS = ("turn_mid", "turn_after_apply", "turn_after_record", "export_after_spill")


def node_dir(root: str | Path, node: str) -> Path:
    return Path(root) / "nodes" / node


class NodeSystem(ActorSystem):
    """The ActorSystem with the cluster's placer (ClusterPlacer); nothing else differs."""

    placer_class = ClusterPlacer


def _answer(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Answer]]:
    @functools.wraps(fn)
    async def wrapper(self: "NodeDaemon", *args: Any, **kw: Any) -> Answer:
        try:
            return Answer(value=await fn(self, *args, **kw))
        except ActordError as e:
            return Answer.of_error(e)

    return wrapper


def _check_mind(mind: Any) -> str:
    if not isinstance(mind, str) or check_part(mind) is not None:
        raise InvalidParams(f"a mind name is one page-name component: {check_part(str(mind))}", mind=str(mind)[:64])
    return mind


def _request(kind: str, request: dict[str, Any], mind: str | None) -> CompletionRequest | ChatRequest:
    typ = {"completion": CompletionRequest, "chat": ChatRequest}.get(kind)
    if typ is None:
        raise InvalidParams(f"a turn's kind is one of {', '.join(KINDS)}", kind=str(kind)[:32])
    try:
        return msgspec.convert({**request, "mind": mind}, typ)
    except msgspec.ValidationError as e:
        raise InvalidParams(str(e)) from None


async def _run(system: ActorSystem, req: CompletionRequest | ChatRequest, on_token: Any) -> Any:
    """The verb: a completion's CompletionResult, a chat's ChatResult (rendered here, with
    the model's template and this node's turn memory, as one daemon renders it)."""
    if isinstance(req, ChatRequest):
        return await system.chat(req, on_token=on_token)
    return await system.complete(req, on_token=on_token)


async def _pump(run: Callable[[Callable[[Any], None]], Awaitable[Answer]]) -> Any:
    """Run `run(sink)`, yielding each chunk it sinks as it comes, then its Answer. Closed or
    cancelled early (the router's caller went away: `ray.cancel`), the run is cancelled."""
    q: asyncio.Queue[Any] = asyncio.Queue()
    task = asyncio.get_running_loop().create_task(run(q.put_nowait))
    try:
        while True:
            get = asyncio.ensure_future(q.get())
            done, _ = await asyncio.wait({task, get}, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                yield get.result()
                continue
            get.cancel()
            while not q.empty():
                yield q.get_nowait()
            yield task.result()
            return
    finally:
        if not task.done():
            task.cancel()


class NodeDaemon:
    def __init__(self, name: str, config_json: bytes) -> None:
        self.cfg = msgspec.json.decode(config_json, type=ClusterConfig)
        actord_log.configure(level=self.cfg.log_level)
        self.name = name
        self.dir = node_dir(self.cfg.root, name)
        self.page_dir = self.dir / "pages"
        self.page_dir.mkdir(parents=True, exist_ok=True)
        self.fence = FenceBook(self.dir / "fence", keep=self.cfg.turns_kept)
        self.node_config = msgspec.structs.replace(self.cfg.node, page_dir=str(self.page_dir))
        if self.node_config.engine_cpus == "auto":
            # A node may share its machine with other nodes (`cluster up` simulates several on
            # one) and Ray's own workers: "auto" would put every node's engine on the same
            # CPUs. A node pins only where its config names the CPUs.
            self.node_config = msgspec.structs.replace(self.node_config, engine_cpus="off")
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self.system: NodeSystem | None = None
        self._ready: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._start_error: BaseException | None = None
        self.faults: set[str] = set()
        self.fault_after = 0
        self.queue = 0
        self.turns_applied = 0
        self.running: set[tuple[str, str]] = set()
        self.frozen: set[str] = set()
        try:
            self.ray_node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # pragma: no cover - outside Ray (unit use)
            self.ray_node_id = ""
        log.info("cluster.node_init", node=name, incarnation=self.incarnation, pid=os.getpid(),
                 minds=len(self.fence.minds))

    # -- the hosted system ---------------------------------------------------------------

    async def _ensure(self) -> NodeSystem:
        if self._ready is None:
            self._ready = asyncio.Event()
            self._stop = asyncio.Event()
            self._host = asyncio.get_running_loop().create_task(self._host_main())
        await self._ready.wait()
        if self.system is None:
            raise NodeUnavailable(f"node {self.name}'s system did not start: {self._start_error!r}", node=self.name)
        return self.system

    async def _host_main(self) -> None:
        assert self._ready is not None and self._stop is not None
        try:
            async with NodeSystem(self.node_config) as system:
                self.system = system
                self._ready.set()
                loop = asyncio.get_running_loop()
                kick = loop.create_task(self._kick_router())
                background = loop.create_task(run_background(system, self.node_config))  # write-behind too
                try:
                    await self._stop.wait()
                finally:
                    kick.cancel()
                    background.cancel()
                await system.shutdown(self.node_config.shutdown_grace_s)
        except BaseException as e:
            self._start_error = e
            log.error("cluster.node_system_failed", node=self.name, error=repr(e))
        finally:
            self.system = None
            self._ready.set()

    async def _kick_router(self) -> None:
        """Call the router every ROUTER_KICK_S: one that Ray restarted after a crash starts
        its socket and HTTP front at its first call (router.py `ping`), which no client of
        the socket can make. A router away (restarting) is simply called again; while its
        process is gone, a node on its machine answers for it (standin.py): clients get a
        typed NodeUnavailable, not a refused connection."""
        from actord.cluster.router import ROUTER_KICK_S, ROUTER_NAME
        from actord.cluster.standin import StandIn, loopback_host

        seen = ""
        fronts: dict[str, Any] | None = None  # where the router serves, and its process
        stand_in: StandIn | None = None
        try:
            while True:
                await asyncio.sleep(ROUTER_KICK_S)
                call = None
                try:
                    router = ray.get_actor(ROUTER_NAME, namespace=self.cfg.namespace)
                    call = asyncio.ensure_future(router.ping.remote())
                    done, _ = await asyncio.wait({call}, timeout=ROUTER_KICK_S)
                    if not done and fronts is not None and stand_in is None:
                        stand_in = await self._stand_in(fronts)
                    incarnation = await asyncio.wait_for(call, timeout=30.0)
                except Exception as e:  # noqa: BLE001 - any failure: the router is away; call again
                    if call is not None and not call.done():
                        call.cancel()
                    log.debug("cluster.router_kick_failed", node=self.name, error=repr(e)[:200])
                    if fronts is not None and stand_in is None:
                        stand_in = await self._stand_in(fronts)
                    continue
                if stand_in is not None:  # the router answers: it takes its fronts back
                    await stand_in.close()
                    stand_in = None
                    try:
                        await asyncio.wait_for(router.ping.remote(), timeout=30.0)
                    except Exception as e:  # noqa: BLE001 - its next call takes them back
                        log.debug("cluster.router_kick_failed", node=self.name, error=repr(e)[:200])
                if incarnation != seen:
                    if seen:
                        log.info("cluster.router_restarted", node=self.name, incarnation=incarnation)
                    seen = incarnation
                    try:
                        fronts = await asyncio.wait_for(router.fronts.remote(), timeout=30.0)
                    except Exception as e:  # noqa: BLE001 - asked again at its next incarnation
                        log.debug("cluster.router_fronts_failed", node=self.name, error=repr(e)[:200])
                        fronts = None
                    if fronts is not None and fronts.get("host") != loopback_host():
                        fronts = None  # another machine's router: its socket is not here to stand in for
        finally:
            if stand_in is not None:
                await stand_in.close()

    @staticmethod
    async def _stand_in(fronts: dict[str, Any]) -> Any:
        """A stand-in for the router's fronts, if its process is gone (None: it is not, or
        there was nothing to take)."""
        from actord.cluster.standin import StandIn, router_process_gone

        if not router_process_gone(int(fronts["pid"])):
            return None  # alive but slow: its socket is its own
        s = StandIn(fronts.get("socket"), fronts.get("http"))
        await s.start()
        return s if s.serving else None

    # -- control (its own loop: answers while the work loop is busy) ----------------------

    @ray.method(concurrency_group="control")
    def health(self) -> dict[str, Any]:
        return {"node": self.name, "incarnation": self.incarnation, "pid": os.getpid(), "ray_node_id": self.ray_node_id,
                "up": self.system is not None, "queue": self.queue, "minds": len(self.fence.minds),
                "uptime_s": round(time.time() - self.started_at, 3)}

    @ray.method(concurrency_group="control")
    def arm_fault(self, point: str, after: int = 0) -> None:
        """Exit at `point` of the next turn or export ("turn_mid": after `after` tokens)."""
        if point not in FAULTS:
            raise ValueError(f"fault point is one of {FAULTS}")
        self.faults.add(point)
        self.fault_after = after

    def _fault(self, point: str) -> None:
        if point in self.faults:
            log.warning("cluster.node_fault", node=self.name, point=point)
            os._exit(17)

    # -- work ------------------------------------------------------------------------------

    @_answer
    async def start(self) -> list[Holding]:
        """Start the system (if not yet) and report what this node holds."""
        await self._ensure()
        return await self._holdings()

    @_answer
    async def holdings(self) -> list[Holding]:
        return await self._holdings()

    async def _holdings(self) -> list[Holding]:
        fs = OsFs()

        def scan() -> list[Holding]:
            return [Holding(mind=m, epoch=r.epoch, durable=fs.stat(self.page_dir / mind_file(m)) is not None,
                            last_turn=r.turns[-1].turn if r.turns else None, frozen=m in self.frozen)
                    for m, r in sorted(self.fence.minds.items())]

        return await anyio.to_thread.run_sync(scan)

    @_answer
    async def load(self) -> NodeLoad:
        system = await self._ensure()
        stats = await system.page_stats()
        return NodeLoad(node=self.name, incarnation=self.incarnation, pid=os.getpid(), ray_node_id=self.ray_node_id,
                        free_page_bytes=max(0, stats.ceiling - stats.charged), page_ram_bytes=stats.ceiling,
                        queue=self.queue, minds=len(self.fence.minds), turns_applied=self.turns_applied)

    async def turn_stream(self, turn: Turn) -> Any:
        """`turn`, streamed: each chunk (a dict, as the daemon's `completion.chunk`) as it
        is generated, then the turn's `Answer` (Ray streams what a generator yields)."""
        async with contextlib.aclosing(_pump(lambda sink: self.turn(turn, sink=sink))) as items:
            async for item in items:
                yield item

    @_answer
    async def turn(self, turn: Turn, sink: Callable[[Any], None] | None = None) -> dict[str, Any]:
        """Run one turn of a mind this node holds at `turn.epoch`, once per turn id."""
        system = await self._ensure()
        mind = _check_mind(turn.mind)
        if (mind, turn.turn) in self.running:
            raise DuplicateTurn(f"turn {turn.turn} of {mind!r} is running here", mind=mind, turn=turn.turn, result=None)
        try:
            self.fence.check(mind, turn.epoch, turn.turn)
        except DuplicateTurn as e:  # who applied it: a client answered from the record says where
            e.data.setdefault("node", self.name)
            raise
        if mind in self.frozen:
            raise StaleEpoch(f"{mind!r} is being moved off this node", mind=mind, epoch=turn.epoch,
                             held=self.fence.held(mind))
        req = _request(turn.kind, turn.request, mind)
        on_token = None
        if sink is not None or "turn_mid" in self.faults:
            seen = [0]

            def on_token(chunk: Any) -> None:
                seen[0] += 1
                if seen[0] > self.fault_after:
                    self._fault("turn_mid")
                if sink is not None:
                    sink(chunk)
        self.running.add((mind, turn.turn))
        self.queue += 1
        try:
            out = msgspec.to_builtins(await _run(system, req, on_token))
            self._fault("turn_after_apply")
            await anyio.to_thread.run_sync(self.fence.record, mind, turn.epoch, turn.turn, out)
            self.turns_applied += 1
            self._fault("turn_after_record")
            if self.cfg.durable_turns:
                await system.placer.ask(PersistMind(mind=mind, drop=False))  # type: ignore[union-attr]
        finally:
            self.queue -= 1
            self.running.discard((mind, turn.turn))
        return out

    @_answer
    async def free(self, kind: str, request: dict[str, Any], sink: Callable[[Any], None] | None = None) -> Any:
        """A request that names no mind, placed by this node's system as one daemon places
        it (the idle slot sharing the longest prefix). Not fenced: it changes no mind's
        state, so the router may send it again elsewhere when this node fails first."""
        system = await self._ensure()
        req = _request(kind, request, None)
        self.queue += 1
        try:
            return msgspec.to_builtins(await _run(system, req, sink))
        finally:
            self.queue -= 1

    async def free_stream(self, kind: str, request: dict[str, Any]) -> Any:
        """`free`, streamed as `turn_stream` streams a turn."""
        async with contextlib.aclosing(_pump(lambda sink: self.free(kind, request, sink=sink))) as items:
            async for item in items:
                yield item

    @_answer
    async def model_info(self) -> dict[str, Any]:
        """What an HTTP front needs of the model: its props and its chat template's info."""
        system = await self._ensure()
        return {"props": system.model_props(), "chat": await system.chat_info()}

    @_answer
    async def persist(self, mind: str, epoch: int) -> dict[str, Any]:
        """Make the mind's state durable in its page file (it stays where it is)."""
        system = await self._ensure()
        self._held_at(mind, epoch)
        return await system.placer.ask(PersistMind(mind=mind, drop=False))  # type: ignore[union-attr]

    def _held_at(self, mind: str, epoch: int) -> None:
        held = self.fence.held(_check_mind(mind))
        if held != epoch:
            raise StaleEpoch(f"this node holds {mind!r} at epoch {held}, not {epoch}", mind=mind, epoch=epoch, held=held)

    @_answer
    async def export(self, mind: str, epoch: int) -> PageBlob:
        """A migration's source: freeze the mind, page it out to its page file (durable
        here), and hand its bytes over as numpy arrays. The mind stays here, frozen, until
        `release` (the move committed) or `thaw` (it did not)."""
        system = await self._ensure()
        self._held_at(mind, epoch)
        self.frozen.add(mind)
        await system.placer.ask(PersistMind(mind=mind, drop=True))  # type: ignore[union-attr]
        self._fault("export_after_spill")
        image = await system.files.read(mind_file(mind)) if await system.files.exists(mind_file(mind)) else None
        blob = pack(mind, epoch, image, self.fence.turns(mind))
        log.info("cluster.exported", node=self.name, mind=mind, epoch=epoch, n_bytes=blob.n_bytes)
        return blob

    @_answer
    async def thaw(self, mind: str, epoch: int) -> bool:
        self.frozen.discard(mind)
        return True

    @_answer
    async def adopt(self, mind: str, epoch: int, blob: Any = None, from_node: str | None = None) -> dict[str, Any]:
        """Hold `mind` at `epoch`: fresh, from a migration's blob (an Answer of `export`),
        or from another node's page and fence files (a lost node, `from_node`). The page is
        written durably here before the fence moves to the new epoch."""
        system = await self._ensure()
        _check_mind(mind)
        held = self.fence.held(mind)
        if held is not None and held >= epoch:
            raise StaleEpoch(f"this node holds {mind!r} at epoch {held}; {epoch} is not newer", mind=mind,
                             epoch=epoch, held=held)
        t0 = time.perf_counter()
        if isinstance(blob, Answer):
            blob = blob.unwrap()
        turns = []
        image = None
        if isinstance(blob, PageBlob):
            turns = list(blob.turns)
            image = unpack(blob) if blob.has_page else None
        elif from_node is not None:
            src = node_dir(self.cfg.root, _check_mind(from_node))
            rec: MindFence | None = await anyio.to_thread.run_sync(FenceBook.load, src / "fence", mind)
            turns = list(rec.turns) if rec is not None else []
            src_pages = src / "pages"
            if (src_pages / mind_file(mind)).exists():
                try:
                    image = await anyio.to_thread.run_sync(read_generation, src_pages, mind_file(mind), OsFs())
                except ActordError as e:  # unreadable: the mind is re-prefilled
                    log.warning("cluster.rehome_unreadable", node=self.name, mind=mind, src=from_node, error=e.to_dict())
        # Whatever an older epoch left here goes first (a RAM page would win over the file).
        await system.placer.ask(ForgetMind(mind=mind))  # type: ignore[union-attr]
        n_bytes = 0
        if image is not None:
            stats = await system.files.publish(mind_file(mind), image)
            n_bytes = stats.n_bytes
        else:
            await self._remove_files(mind)
        await anyio.to_thread.run_sync(self.fence.hold, mind, epoch, turns)
        self.frozen.discard(mind)
        t_ms = (time.perf_counter() - t0) * 1e3
        log.info("cluster.adopted", node=self.name, mind=mind, epoch=epoch, n_bytes=n_bytes, from_node=from_node)
        return {"mind": mind, "epoch": epoch, "n_bytes": n_bytes, "page": image is not None, "t_ms": t_ms,
                "zero_copy": bool(isinstance(blob, PageBlob) and blob.has_page and not blob.state.flags.writeable)}

    @_answer
    async def release(self, mind: str, epoch: int) -> bool:
        """Drop the mind held at `epoch` or older (never a newer one): slot, RAM page,
        page file, fence. False when this node did not hold it."""
        system = await self._ensure()
        held = self.fence.held(_check_mind(mind))
        if held is None:
            return False
        if held > epoch:
            raise StaleEpoch(f"this node holds {mind!r} at the newer epoch {held}", mind=mind, epoch=epoch, held=held)
        await system.placer.ask(ForgetMind(mind=mind))  # type: ignore[union-attr]
        await self._remove_files(mind)
        await anyio.to_thread.run_sync(self.fence.drop, mind)
        self.frozen.discard(mind)
        log.info("cluster.released", node=self.name, mind=mind, epoch=held)
        return True

    async def _remove_files(self, mind: str) -> None:
        fs = OsFs()
        main = self.page_dir / mind_file(mind)

        def rm() -> None:
            for p in [main, *sidecar_paths(main).values()]:
                if fs.stat(p) is not None:
                    fs.unlink(p)
            fs.dirsync(self.page_dir)

        await anyio.to_thread.run_sync(rm)

    @_answer
    async def put_page(self, mind: str, epoch: int, blob: PageBlob) -> dict[str, Any]:
        """Write a page file for a mind held here at `epoch` (tests and benches make large
        synthetic pages this way; the bytes need not be a state this model can restore)."""
        system = await self._ensure()
        self._held_at(mind, epoch)
        await system.placer.ask(ForgetMind(mind=mind))  # type: ignore[union-attr]  # the file is its state now
        stats = await system.files.publish(mind_file(mind), unpack(blob))
        return {"n_bytes": stats.n_bytes}

    @_answer
    async def page_crc(self, mind: str) -> int | None:
        """The CRC-32 of the mind's page file here, as `transfer.pack` computes it."""
        system = await self._ensure()
        if not await system.files.exists(mind_file(mind)):
            return None
        image = await system.files.read(mind_file(mind))
        return pack(mind, 0, image, []).crc32

    @_answer
    async def stop(self) -> bool:
        if self._stop is not None:
            self._stop.set()
            await self._host
        return True
