"""MindRouter: owns the directory mind -> (node, epoch) and routes every turn to its node.

A detached, named, restartable Ray actor (`local.start_router`). Its directory
(directory.py) is persisted at every change, so a restarted router knows every mind's
owner; at its first call it reconciles every node's holdings against the directory (a copy
at another epoch or on another node is dropped).

This module holds the actor's state, its start, its nodes' registration and its
introspection; the rest of its verbs are parts it holds, in modules named for their jobs:

- turns.py: a mind's turn on its node (placing a new mind on the live node with the fewest
  turns in flight, then the fewest minds, then the most free page RAM), retried once on a
  restarted node with the same turn id; and a request of no mind (`free_turn`).
- migration.py: `migrate` and `rebalance` (a node added later takes minds from the
  busiest nodes).
- loss.py: the monitor of Ray's node table, and the re-homing of a lost node's minds.
- nodelink.py: every call to a node (`NodeLink`), and what counts as a node gone.

Fronts, in this process: the JSON-RPC socket (rpc.py) and, with `node.http`, the OpenAI
HTTP front (front.py, `serve_http`). A request that names no mind (the HTTP front's) is
run on the least loaded node, outside the directory (`free_turn`). A caller that goes away
cancels its node's work (`ray.cancel`).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any, Callable

import msgspec

from actord.cluster.directory import Directory, Entry
from actord.cluster.locks import MindLocks
from actord.cluster.loss import NodeLoss
from actord.cluster.messages import Holding
from actord.cluster.migration import Migrations
from actord.cluster.nodelink import NODE_GONE, NodeLink
from actord.cluster.shared import RouterShared
from actord.cluster.turns import TurnOut, Turns
from actord.vocabulary.config import ClusterConfig
from actord.vocabulary.errors import ActordError, InvalidParams, NodeUnavailable, PageNotFound
from actord.vocabulary.log import get
from actord.vocabulary.names import check_part
from actord.vocabulary import log as actord_log

log = get("actord.cluster.router")

ROUTER_NAME = "actord-router"
ROUTER_KICK_S = 1.0  # how often each node calls the router (its `ping`), which restarts its fronts


def _served(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("cluster.http_failed", error=repr(task.exception()))


class MindRouter:
    def __init__(self, config_json: bytes) -> None:
        self.cfg = msgspec.json.decode(config_json, type=ClusterConfig)
        actord_log.configure(level=self.cfg.log_level)
        self.root = Path(self.cfg.root)
        self.dir = Directory(self.root / "router" / "directory.json")
        self.nodes = NodeLink(self.cfg, self.dir)
        self.locks = MindLocks()
        self.limits = self.cfg.node.request_limits()
        shared = RouterShared(self.dir, self.nodes, self.locks)
        self.loss = NodeLoss(self.cfg, shared)
        self.moves = Migrations(shared, self.loss)
        self.turns = Turns(shared, self.limits, self.loss, self._reconcile)
        self.incarnation = uuid.uuid4().hex[:12]
        self._started: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._rpc: Any = None
        self._http: Any = None  # the HTTP front (front.py), once serve_http ran
        self._http_lock = asyncio.Lock()
        self._http_task: asyncio.Task[None] | None = None
        self._info: dict[str, Any] | None = None  # the model's props and chat info (model_info)
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
        self._monitor = asyncio.get_running_loop().create_task(self.loss.watch())
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

    async def _connect(self, name: str) -> list[Holding]:
        await self.nodes.health(name)
        holdings: list[Holding] = await self.nodes.call(name, "start")
        await self._reconcile(name, holdings)
        return holdings

    async def _reconcile(self, name: str, holdings: list[Holding]) -> None:
        """Drop every copy `name` holds that the directory does not name."""
        for h in holdings:
            async with self.locks.of(h.mind):
                entry = self.dir.get(h.mind)
                if entry is not None and entry.node == name and entry.epoch == h.epoch:
                    if h.frozen:  # a migration cut short (this router restarted): it stays here
                        await self.nodes.call(name, "thaw", h.mind, h.epoch)
                    continue
                log.info("cluster.stale_copy_dropped", node=name, mind=h.mind, epoch=h.epoch,
                         owner=None if entry is None else (entry.node, entry.epoch))
                await self.nodes.call(name, "release", h.mind, h.epoch)

    async def register_node(self, name: str, rebalance: bool = False) -> dict[str, Any]:
        """A node's daemon is up (named `actord-node-NAME`): route to it from now on."""
        await self._ensure()
        if check_part(name) is not None:
            raise InvalidParams(f"bad node name {name!r}")
        self.nodes.forget(name)
        holdings = await self._connect(name)
        self.dir.add_node(name)
        moved = await self.moves.rebalance() if rebalance else []
        return {"node": name, "holdings": len(holdings), "moved": moved}

    # -- turns and moves (turns.py, migration.py) ----------------------------------------

    async def turn(self, mind: str, request: dict[str, Any], turn_id: str | None = None,
                   sink: Callable[[Any], None] | None = None, kind: str = "completion") -> TurnOut:
        await self._ensure()
        return await self.turns.turn(mind, request, turn_id, sink, kind)

    async def free_turn(self, request: dict[str, Any], sink: Callable[[Any], None] | None = None,
                        kind: str = "completion") -> TurnOut:
        await self._ensure()
        return await self.turns.free_turn(request, sink, kind)

    async def migrate(self, mind: str, dest: str) -> dict[str, Any]:
        await self._ensure()
        return await self.moves.migrate(mind, dest)

    async def rebalance(self) -> list[dict[str, Any]]:
        await self._ensure()
        return await self.moves.rebalance()

    # -- introspection and upkeep --------------------------------------------------------

    async def persist(self, mind: str) -> dict[str, Any]:
        """Make a mind's state durable in its node's page file now."""
        await self._ensure()
        async with self.locks.of(mind):
            entry = self.dir.get(mind)
            if entry is None:
                raise PageNotFound(f"no mind {mind!r} in the directory", mind=mind)
            return await self.nodes.call(entry.node, "persist", mind, entry.epoch)

    async def model_info(self) -> dict[str, Any]:
        """The served model's props and chat template info, asked of a live node once."""
        await self._ensure()
        return await self._model_info()

    async def _model_info(self) -> dict[str, Any]:
        if self._info is None:
            last: Exception | None = None
            for node in self.dir.live_nodes():
                try:
                    self._info = await self.nodes.call(node, "model_info", timeout=60.0)
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
        loads = {l.node: msgspec.to_builtins(l) for l in await self.nodes.loads()}
        return {
            "router": {"incarnation": self.incarnation, "pid": os.getpid(),
                       "socket": self._rpc.path if self._rpc is not None else None,
                       "http": self._http.address if self._http is not None else None},
            "nodes": {n: {"live": n not in self.dir.state.lost, "minds": len(self.dir.minds_on(n)),
                          "load": loads.get(n)} for n in self.dir.state.nodes},
            "minds": {m: msgspec.to_builtins(e) for m, e in sorted(self.dir.state.minds.items())},
            "lost": self.loss.lost_log,
            "migrations": len(self.moves.migrations),
        }

    async def lost_events(self) -> list[dict[str, Any]]:
        return self.loss.lost_log

    async def ping(self) -> str:
        """Its incarnation, once started: a router Ray restarted after a crash serves its
        socket and HTTP front again at its first call, and every node calls this each
        ROUTER_KICK_S (node.py `_kick_router`), so that is within seconds, whoever else
        calls it (after kill -9 the socket refused connections for 60 s and more). A
        front a node's stand-in held while this router started is taken back here."""
        await self._ensure()
        await self._refront()
        return self.incarnation

    async def fronts(self) -> dict[str, Any]:
        """Where this router serves and from which process: what a node on its machine needs
        to stand in for it while it is down (standin.py)."""
        await self._ensure()
        from actord.cluster.standin import loopback_host

        return {"pid": os.getpid(), "host": loopback_host(),
                "socket": self._rpc.path if self._rpc is not None else None,
                "http": self._http.address if self._http is not None else None}

    async def _refront(self) -> None:
        if self._rpc is not None:
            try:
                await self._rpc.ensure_bound()
            except OSError as e:
                log.warning("cluster.rpc_not_served", path=self._rpc.path, error=repr(e))
        if self.cfg.node.http and self._http is None and self.dir.live_nodes():
            try:
                await self._serve_http()
            except (*NODE_GONE, ActordError) as e:
                log.debug("cluster.http_not_served", http=self.cfg.node.http, error=repr(e))
