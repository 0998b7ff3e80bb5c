"""MindRouter: owns the directory mind -> (node, epoch) and routes every turn to its node.

A detached, named, restartable Ray actor (`local.start_router`). Its directory
(directory.py) is persisted at every change, so a restarted router knows every mind's
owner; at its first call it reconciles every node's holdings against the directory (a copy
at another epoch or on another node is dropped).

- Placement: a new mind goes to the live node with the fewest turns in flight, then the
  fewest minds, then the most free page RAM.
- Turns: a completion or a chat (rendered on the node); each carries (mind, epoch, turn
  id); one mind's turns are routed one at a time
  (a per-mind lock), so a migration "freezes" a mind by taking that lock. A node that
  fails mid-turn (its process died: a Ray actor error) is waited for; once Ray restarted
  it the turn is sent again with the same turn id, once: a node that recorded it answers
  `DuplicateTurn` with the recorded answer, which is the turn's answer. A node that does
  not come back (its Ray node is dead) is treated as lost.
- Migration: export on the source (page out + spill: durable there; the mind is frozen),
  the blob goes source -> destination through the object store (the ObjectRef is passed,
  not the bytes: the router never holds them), the destination writes it durably and holds
  it at epoch + 1, the directory flips (the commit point), the source drops its copy. Any
  failure before the flip leaves the source the owner (thawed, or reloaded from its spill
  by its restart) and drops the destination's partial copy.
- Node loss: a monitor polls Ray's node table; a dead node's minds are re-homed on the
  live nodes at a new epoch, from the lost node's page and fence files in the shared
  cluster folder where they are, else fresh (their next turn re-prefills). A node added
  later takes minds from the busiest nodes (`rebalance`).
- Fronts, in this process: the JSON-RPC socket (rpc.py) and, with `node.http`, the OpenAI
  HTTP front (front.py, `serve_http`). A request that names no mind (the HTTP front's) is
  run on the least loaded node, outside the directory (`free_turn`). A caller that goes
  away cancels its node's work (`ray.cancel`).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import msgspec
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

from actord.service.types import CompletionRequest, SamplingFields
from actord.chat.template import ChatRequest
from actord.cluster.directory import Directory, Entry
from actord.cluster.messages import KINDS, Answer, Holding, NodeLoad, Turn
from actord.service.config import ClusterConfig
from actord.service.errors import (
    ActordError, DuplicateTurn, InternalError, InvalidParams, MigrationFailed, NodeUnavailable, PageNotFound,
)
from actord.service.log import get
from actord.storage.paths import check_part

log = get("actord.cluster.router")

class NodeMissing(Exception):
    """No daemon is registered under the node's name (it died for good, or never started)."""


NODE_GONE = (RayActorError, ActorUnavailableError, ObjectLostError, GetTimeoutError, asyncio.TimeoutError, NodeMissing)


def node_actor_name(node: str) -> str:
    return f"actord-node-{node}"


ROUTER_NAME = "actord-router"


def _cancel(ref: Any) -> None:
    """Cancel a node's task whose caller went away (an async actor's asyncio task is
    cancelled: the slot's request ends as a cancelled one does on one daemon)."""
    try:
        ray.cancel(ref)
    except Exception as e:  # already done, or the node gone: nothing to stop
        log.info("cluster.cancel_not_sent", error=repr(e))


def _served(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("cluster.http_failed", error=repr(task.exception()))


class TurnOut(msgspec.Struct, frozen=True):
    result: dict[str, Any]
    node: str
    epoch: int
    turn: str
    attempts: int = 1
    placed: bool = False


class MindRouter:
    def __init__(self, config_json: bytes) -> None:
        from actord.service import log as actord_log

        self.cfg = msgspec.json.decode(config_json, type=ClusterConfig)
        actord_log.configure(level=self.cfg.log_level)
        self.root = Path(self.cfg.root)
        self.dir = Directory(self.root / "router" / "directory.json")
        self.handles: dict[str, Any] = {}
        self.ray_ids: dict[str, str] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.place_lock = asyncio.Lock()
        self.lost_log: list[dict[str, Any]] = []
        self.migrations: list[dict[str, Any]] = []
        self.incarnation = uuid.uuid4().hex[:12]
        self._started: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._rpc: Any = None
        self._http: Any = None  # the HTTP front (front.py), once serve_http ran
        self._http_lock = asyncio.Lock()
        self._http_task: asyncio.Task[None] | None = None
        self._info: dict[str, Any] | None = None  # the model's props and chat info (model_info)
        self.inflight: dict[str, int] = {}
        self.limits = self.cfg.node.request_limits()
        log.info("cluster.router_init", incarnation=self.incarnation, minds=len(self.dir.state.minds),
                 nodes=self.dir.state.nodes)

    # -- start and nodes -----------------------------------------------------------------

    async def _ensure(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        for name in self.dir.live_nodes():
            try:
                await self._connect(name)
            except NODE_GONE as e:
                log.warning("cluster.node_unreachable_at_start", node=name, error=repr(e))
        self._monitor = asyncio.get_running_loop().create_task(self._watch())
        path = self.cfg.socket or str(self.root / "router" / "actord.sock")
        try:
            from actord.cluster.rpc import RouterRpc

            self._rpc = RouterRpc(self, path)
            await self._rpc.start()
        except OSError as e:  # the socket is a convenience; the Ray API works without it
            log.warning("cluster.rpc_not_served", path=path, error=repr(e))
        if self.cfg.node.http and self.dir.live_nodes():  # a restarted router serves it again
            try:
                await self._serve_http()
            except (*NODE_GONE, ActordError) as e:
                log.warning("cluster.http_not_served", http=self.cfg.node.http, error=repr(e))

    def _handle(self, name: str) -> Any:
        h = self.handles.get(name)
        if h is None:
            try:
                h = self.handles[name] = ray.get_actor(node_actor_name(name), namespace=self.cfg.namespace)
            except ValueError as e:  # Ray's "failed to look up actor"
                raise NodeMissing(f"no daemon for node {name}: {e}") from None
        return h

    async def _call(self, node: str, method: str, *args: Any, timeout: float | None = None) -> Any:
        ref = getattr(self._handle(node), method).remote(*args)
        try:
            ans: Answer = await asyncio.wait_for(ref, timeout or self.cfg.call_timeout_s)
        except RayTaskError as e:  # a bug on the node, not a refusal: no retry
            raise InternalError(f"node {node} failed {method}: {e}", node=node) from None
        return ans.unwrap()

    async def _connect(self, name: str) -> list[Holding]:
        health = await asyncio.wait_for(self._handle(name).health.remote(), self.cfg.call_timeout_s)
        self.ray_ids[name] = health["ray_node_id"]
        holdings: list[Holding] = await self._call(name, "start")
        await self._reconcile(name, holdings)
        return holdings

    async def _reconcile(self, name: str, holdings: list[Holding]) -> None:
        """Drop every copy `name` holds that the directory does not name."""
        for h in holdings:
            async with self._lock(h.mind):
                entry = self.dir.get(h.mind)
                if entry is not None and entry.node == name and entry.epoch == h.epoch:
                    if h.frozen:  # a migration cut short (this router restarted): it stays here
                        await self._call(name, "thaw", h.mind, h.epoch)
                    continue
                log.info("cluster.stale_copy_dropped", node=name, mind=h.mind, epoch=h.epoch,
                         owner=None if entry is None else (entry.node, entry.epoch))
                await self._call(name, "release", h.mind, h.epoch)

    async def register_node(self, name: str, rebalance: bool = False) -> dict[str, Any]:
        """A node's daemon is up (named `actord-node-NAME`): route to it from now on."""
        await self._ensure()
        if check_part(name) is not None:
            raise InvalidParams(f"bad node name {name!r}")
        self.handles.pop(name, None)
        holdings = await self._connect(name)
        self.dir.add_node(name)
        moved = await self.rebalance() if rebalance else []
        return {"node": name, "holdings": len(holdings), "moved": moved}

    def _lock(self, mind: str) -> asyncio.Lock:
        lock = self.locks.get(mind)
        if lock is None:
            lock = self.locks[mind] = asyncio.Lock()
        return lock

    async def _alive_ray_nodes(self) -> set[str]:
        nodes = await asyncio.to_thread(ray.nodes)
        return {n["NodeID"] for n in nodes if n.get("Alive")}

    async def _loads(self, exclude: set[str] = frozenset()) -> list[NodeLoad]:  # type: ignore[assignment]
        names = [n for n in self.dir.live_nodes() if n not in exclude]

        async def one(n: str) -> NodeLoad | None:
            try:
                return await self._call(n, "load", timeout=10.0)
            except (*NODE_GONE, ActordError):
                return None

        return [x for x in await asyncio.gather(*(one(n) for n in names)) if x is not None]

    def _pick(self, loads: list[NodeLoad]) -> str:
        if not loads:
            raise NodeUnavailable("no live node to place a mind on")
        counts = self.dir.counts()
        best = min(loads, key=lambda l: (l.queue + self.inflight.get(l.node, 0), counts.get(l.node, 0),
                                         -l.free_page_bytes, l.node))
        return best.node

    # -- turns ---------------------------------------------------------------------------

    async def _run(self, node: str, method: str, args: tuple[Any, ...], sink: Callable[[Any], None] | None,
                   skip: int) -> Any:
        """One try of a turn (`method` "turn", or "free" for a request of no mind) on
        `node`: its result. Streamed (`sink`), its chunks go to `sink`, except the first
        `skip` (a retry's, sent by the try before). Cancelled (the caller went away: an
        HTTP client that hung up), the node's work is cancelled too (`ray.cancel`)."""
        handle = self._handle(node)
        if sink is None:
            ref = getattr(handle, method).remote(*args)
            try:
                ans: Answer = await asyncio.wait_for(ref, self.cfg.call_timeout_s)
            except RayTaskError as e:  # a bug on the node, not a refusal: no retry
                raise InternalError(f"node {node} failed {method}: {e}", node=node) from None
            except asyncio.CancelledError:
                _cancel(ref)
                raise
            return ans.unwrap()
        gen = getattr(handle, method + "_stream").options(num_returns="streaming").remote(*args)
        sent = 0
        try:
            async for ref in gen:
                item = await asyncio.wait_for(ref, self.cfg.call_timeout_s)
                if isinstance(item, Answer):
                    return item.unwrap()
                if sent >= skip:
                    sink(item)
                sent += 1
        except RayTaskError as e:
            raise InternalError(f"node {node} failed a streamed {method}: {e}", node=node) from None
        except asyncio.CancelledError:
            _cancel(gen)
            raise
        raise InternalError(f"node {node} ended a streamed {method} without its answer", node=node)

    def _check(self, kind: str, mind: str | None, request: Any) -> None:
        """Refuse bad input here, before a new mind is placed: the verb's own checks, under
        the nodes' limits (a chat's as its rendered completion will be checked)."""
        if not isinstance(request, dict) or "mind" in request and request["mind"] not in (None, mind) or "slot" in request:
            raise InvalidParams("a cluster turn names its mind once and no slot")
        if kind not in KINDS:
            raise InvalidParams(f"a turn's kind is one of {', '.join(KINDS)}", kind=str(kind)[:32])
        try:
            if kind == "completion":
                msgspec.convert({**request, "mind": mind}, CompletionRequest).check(self.limits)
                return
            chat = msgspec.convert({**request, "mind": mind}, ChatRequest).check()
        except msgspec.ValidationError as e:
            raise InvalidParams(str(e)) from None
        CompletionRequest(prompt=[0], n_predict=chat.n_predict, mind=mind, temperature=chat.temperature,
                          top_k=chat.top_k, top_p=chat.top_p,
                          **{f: getattr(chat, f) for f in SamplingFields.__struct_fields__}).check(self.limits)

    async def turn(self, mind: str, request: dict[str, Any], turn_id: str | None = None,
                   sink: Callable[[Any], None] | None = None, kind: str = "completion") -> TurnOut:
        """Run one turn of `mind` on its node (placing it first if it is new): a completion
        (CompletionRequest's fields) or a chat (ChatRequest's: the node renders it). `sink`
        (in this process only: the socket's and the HTTP front's streams) gets each chunk once."""
        await self._ensure()
        if not isinstance(mind, str) or check_part(mind) is not None:
            raise InvalidParams(f"a mind name is one page-name component: {check_part(str(mind))}")
        self._check(kind, mind, request)
        turn = turn_id or uuid.uuid4().hex
        async with self._lock(mind):
            placed = False
            entry = self.dir.get(mind)
            if entry is None:
                entry = await self._place(mind)
                placed = True
            delivered = 0
            for attempt in (1, 2):
                node = entry.node
                self.inflight[node] = self.inflight.get(node, 0) + 1
                counted = [0]

                def counting(chunk: Any, counted: list[int] = counted) -> None:
                    counted[0] += 1
                    sink(chunk)  # type: ignore[misc]

                try:
                    result = await self._run(
                        node, "turn", (Turn(mind=mind, epoch=entry.epoch, turn=turn, request=request, kind=kind),),
                        counting if sink is not None else None, delivered)
                    return TurnOut(result=result, node=entry.node, epoch=entry.epoch, turn=turn, attempts=attempt,
                                   placed=placed)
                except DuplicateTurn as e:
                    if attempt == 2 and e.data.get("result") is not None:
                        # Applied before the failure, its answer lost with the process: that answer.
                        return TurnOut(result=e.data["result"], node=entry.node, epoch=entry.epoch, turn=turn,
                                       attempts=attempt, placed=placed)
                    raise
                except NODE_GONE as e:
                    if attempt == 2:
                        raise NodeUnavailable(f"node {entry.node} failed turn {turn} of {mind!r} twice",
                                              node=entry.node, mind=mind) from None
                    log.warning("cluster.turn_node_failed", node=entry.node, mind=mind, turn=turn, error=repr(e))
                    if await self._back(node):
                        # Copies the restart reports that the directory does not name go, in
                        # the background (it takes each mind's lock in turn; this one's is held).
                        try:
                            holdings = await self._call(node, "holdings")
                            asyncio.get_running_loop().create_task(self._reconcile(node, holdings))
                        except NODE_GONE:  # gone again: the retry below finds out
                            pass
                    else:
                        await self._node_lost(node, only=mind)
                    entry = self.dir.get(mind) or await self._place(mind)
                finally:
                    self.inflight[node] = self.inflight.get(node, 1) - 1
                    delivered += counted[0]
        raise AssertionError("unreachable")

    async def free_turn(self, request: dict[str, Any], sink: Callable[[Any], None] | None = None,
                        kind: str = "completion") -> TurnOut:
        """A request that names no mind (an HTTP request with no `user`, `prompt_cache_key`
        or mind header): run on the least loaded live node, placed there as one daemon
        places it, and not remembered in the directory (a fresh mind per request would be
        a mind no later request names, held until evicted). It changes no mind, so a node
        that fails before it sent a chunk is replaced by another, once."""
        await self._ensure()
        self._check(kind, None, request)
        tried: set[str] = set()
        for attempt in (1, 2):
            node = self._pick(await self._loads(exclude=tried))
            self.inflight[node] = self.inflight.get(node, 0) + 1
            sent = [0]

            def counting(chunk: Any, sent: list[int] = sent) -> None:
                sent[0] += 1
                sink(chunk)  # type: ignore[misc]

            try:
                result = await self._run(node, "free", (kind, request), counting if sink is not None else None, 0)
                return TurnOut(result=result, node=node, epoch=0, turn="", attempts=attempt)
            except NODE_GONE as e:
                if attempt == 2 or sent[0]:
                    raise NodeUnavailable(f"node {node} failed a request of no mind", node=node) from None
                log.warning("cluster.free_turn_node_failed", node=node, error=repr(e))
                tried.add(node)
            finally:
                self.inflight[node] = self.inflight.get(node, 1) - 1
        raise AssertionError("unreachable")

    async def _place(self, mind: str) -> Entry:
        async with self.place_lock:
            node = self._pick(await self._loads())
            epoch = self.dir.issue(mind)
            await self._call(node, "adopt", mind, epoch, None, None)
            entry = self.dir.assign(mind, node, epoch)
        log.info("cluster.placed", mind=mind, node=node, epoch=epoch)
        return entry

    async def _back(self, node: str) -> bool:
        """Wait for Ray to restart `node`'s daemon: True once it answers, False if its Ray
        node is dead or it does not come back within restart_wait_s."""
        deadline = time.monotonic() + self.cfg.restart_wait_s
        while time.monotonic() < deadline:
            rid = self.ray_ids.get(node)
            if rid and rid not in await self._alive_ray_nodes():
                return False
            try:
                await self._call(node, "start", timeout=10.0)
                return True
            except ActorUnavailableError:
                await asyncio.sleep(0.2)
            except RayActorError:  # died for good (ActorDiedError), or between restarts
                await asyncio.sleep(0.2)
            except (GetTimeoutError, asyncio.TimeoutError):
                pass
        return False

    # -- migration -----------------------------------------------------------------------

    async def migrate(self, mind: str, dest: str) -> dict[str, Any]:
        await self._ensure()
        async with self._lock(mind):
            return await self._migrate(mind, dest)

    async def _migrate(self, mind: str, dest: str) -> dict[str, Any]:
        entry = self.dir.get(mind)
        if entry is None:
            raise PageNotFound(f"no mind {mind!r} in the directory", mind=mind)
        if dest not in self.dir.live_nodes():
            raise InvalidParams(f"no live node {dest!r}", node=dest)
        if entry.node == dest:
            return {"mind": mind, "node": dest, "epoch": entry.epoch, "moved": False}
        src, epoch = entry.node, self.dir.issue(mind)
        t0 = time.perf_counter()
        try:
            blob = self._handle(src).export.remote(mind, entry.epoch)  # the ref travels, not the bytes
            adopted = await self._call(dest, "adopt", mind, epoch, blob, None)
        except (*NODE_GONE, ActordError) as e:
            await self._abort(mind, src, entry.epoch, dest, epoch)
            err = e.to_dict() if isinstance(e, ActordError) else {"type": type(e).__name__, "message": str(e)[:300]}
            log.warning("cluster.migration_failed", mind=mind, src=src, dest=dest, error=err)
            raise MigrationFailed(f"moving {mind!r} {src} -> {dest} failed: {err.get('message', '')[:200]}",
                                  mind=mind, owner=src, epoch=entry.epoch, cause=err.get("type")) from None
        self.dir.assign(mind, dest, epoch)  # the commit point
        t_ms = (time.perf_counter() - t0) * 1e3
        try:
            await self._call(src, "release", mind, entry.epoch)
        except (*NODE_GONE, ActordError) as e:  # fenced at the old epoch; reconciled when it answers again
            log.warning("cluster.source_not_released", mind=mind, src=src, error=repr(e))
        info = {"mind": mind, "from": src, "node": dest, "epoch": epoch, "moved": True, "t_ms": t_ms,
                "n_bytes": adopted["n_bytes"], "zero_copy": adopted["zero_copy"],
                "publish_ms": adopted["t_ms"]}
        self.migrations.append(info)
        log.info("cluster.migrated", **info)
        return info

    async def _abort(self, mind: str, src: str, src_epoch: int, dest: str, epoch: int) -> None:
        """Before the flip: the source stays the owner; the destination's copy goes."""
        try:
            await self._call(dest, "release", mind, epoch)
        except (*NODE_GONE, ActordError) as e:
            log.warning("cluster.dest_not_released", mind=mind, dest=dest, error=repr(e))
        try:
            await self._call(src, "thaw", mind, src_epoch, timeout=30.0)
        except NODE_GONE:  # the source died: its restart comes back unfrozen, from its spill
            if not await self._back(src):
                await self._node_lost(src, only=mind)
        except ActordError:
            pass

    async def rebalance(self) -> list[dict[str, Any]]:
        """Move minds from the nodes holding most to those holding fewest, until no two
        live nodes differ by more than one."""
        moved = []
        while True:
            counts = self.dir.counts()
            if len(counts) < 2:
                return moved
            hi = max(counts, key=lambda n: (counts[n], n))
            lo = min(counts, key=lambda n: (counts[n], n))
            if counts[hi] - counts[lo] <= 1:
                return moved
            mind = self.dir.minds_on(hi)[-1]
            async with self._lock(mind):
                moved.append(await self._migrate(mind, lo))

    # -- node loss -----------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.monitor_interval_s)
            try:
                alive = await self._alive_ray_nodes()
                for name in self.dir.state.nodes:
                    rid = self.ray_ids.get(name)
                    dead = name in self.dir.state.lost or (rid is not None and rid not in alive)
                    if dead and self.dir.minds_on(name):
                        await self._node_lost(name)
                    elif dead and name not in self.dir.state.lost:
                        self._lost_event(name)
                        self.dir.mark_lost(name)
            except Exception as e:  # the monitor must outlive one bad poll
                log.error("cluster.monitor_failed", error=repr(e))

    def _lost_event(self, name: str) -> dict[str, Any]:
        for ev in self.lost_log:
            if ev["node"] == name and "done" not in ev:
                return ev
        ev = {"node": name, "detected": time.time(), "rehomed": []}
        self.lost_log.append(ev)
        log.warning("cluster.node_lost", node=name, minds=len(self.dir.minds_on(name)))
        return ev

    async def _node_lost(self, name: str, only: str | None = None) -> None:
        """Re-home the minds of lost node `name`. `only`: the caller holds that mind's lock
        and re-homes just it; the rest are left to a task that takes one lock at a time."""
        event = self._lost_event(name)
        self.dir.mark_lost(name)
        self.handles.pop(name, None)
        if only is not None:
            await self._rehome(only, name, event)
            asyncio.get_running_loop().create_task(self._node_lost(name))
            return
        for mind in self.dir.minds_on(name):
            async with self._lock(mind):
                await self._rehome(mind, name, event)
        if not self.dir.minds_on(name):
            event["done"] = time.time()

    async def _rehome(self, mind: str, lost: str, event: dict[str, Any]) -> None:
        entry = self.dir.get(mind)
        if entry is None or entry.node != lost:
            return
        loads = await self._loads(exclude={lost})
        last: Exception | None = None
        while loads:
            node = self._pick(loads)
            epoch = self.dir.issue(mind)
            try:
                adopted = await self._call(node, "adopt", mind, epoch, None, lost)
            except (*NODE_GONE, ActordError) as e:
                last = e
                loads = [l for l in loads if l.node != node]
                continue
            self.dir.assign(mind, node, epoch)
            event["rehomed"].append({"mind": mind, "node": node, "epoch": epoch, "from_file": adopted["page"],
                                     "after_s": round(time.time() - event["detected"], 3)})
            log.info("cluster.rehomed", mind=mind, lost=lost, node=node, epoch=epoch, from_file=adopted["page"])
            return
        raise NodeUnavailable(f"no node could take {mind!r} from lost node {lost}: {last!r}", mind=mind, node=lost)

    # -- introspection and upkeep --------------------------------------------------------

    async def persist(self, mind: str) -> dict[str, Any]:
        """Make a mind's state durable in its node's page file now."""
        await self._ensure()
        async with self._lock(mind):
            entry = self.dir.get(mind)
            if entry is None:
                raise PageNotFound(f"no mind {mind!r} in the directory", mind=mind)
            return await self._call(entry.node, "persist", mind, entry.epoch)

    async def model_info(self) -> dict[str, Any]:
        """The served model's props and chat template info, asked of a live node once."""
        await self._ensure()
        return await self._model_info()

    async def _model_info(self) -> dict[str, Any]:
        if self._info is None:
            last: Exception | None = None
            for node in self.dir.live_nodes():
                try:
                    self._info = await self._call(node, "model_info", timeout=60.0)
                    break
                except (*NODE_GONE, ActordError) as e:
                    last = e
            else:
                raise NodeUnavailable(f"no live node answered for the model: {last!r}")
        return self._info

    async def serve_http(self) -> str | None:
        """Serve the OpenAI HTTP front (`node.http`: `actord cluster up --http HOST:PORT`)
        in this process, beside the socket; its address (None: not configured). Bound
        here, so an address that cannot be listened on fails this call."""
        await self._ensure()
        return await self._serve_http()

    async def _serve_http(self) -> str | None:
        if not self.cfg.node.http:
            return None
        async with self._http_lock:
            if self._http is None:
                from actord.cluster.front import ClusterFront, ClusterHttpFront

                front = ClusterHttpFront(ClusterFront(self, await self._model_info()), self.cfg.node)
                front.bind()  # InvalidParams: the address cannot be listened on
                # Held here: the loop keeps only a weak reference to a task.
                self._http_task = asyncio.get_running_loop().create_task(front.serve())
                self._http_task.add_done_callback(_served)
                self._http = front
                log.info("cluster.http_serving", address=front.address)
        return self._http.address

    async def where(self, mind: str) -> Entry | None:
        return self.dir.get(mind)

    async def status(self) -> dict[str, Any]:
        await self._ensure()
        loads = {l.node: msgspec.to_builtins(l) for l in await self._loads()}
        return {
            "router": {"incarnation": self.incarnation, "pid": os.getpid(),
                       "socket": self._rpc.path if self._rpc is not None else None,
                       "http": self._http.address if self._http is not None else None},
            "nodes": {n: {"live": n not in self.dir.state.lost, "minds": len(self.dir.minds_on(n)),
                          "load": loads.get(n)} for n in self.dir.state.nodes},
            "minds": {m: msgspec.to_builtins(e) for m, e in sorted(self.dir.state.minds.items())},
            "lost": self.lost_log,
            "migrations": len(self.migrations),
        }

    async def lost_events(self) -> list[dict[str, Any]]:
        return self.lost_log

    async def ping(self) -> str:
        return self.incarnation
