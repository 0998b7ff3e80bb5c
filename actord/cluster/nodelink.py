"""The router's link to its NodeDaemons over Ray: one call, one try of a turn, the nodes' loads.

The router never touches a node except through here, so what "a node is gone" means is
decided in one place: `NODE_GONE` is every Ray error (and timeout) after which the caller
must ask whether the node comes back (`back`) or is lost, rather than treat the answer as a
refusal. A refusal (an `ActordError`) crosses Ray as itself, wrapped in an `Answer`; a bug
on the node (`RayTaskError`) is an `InternalError` and is never retried.

`inflight` counts the turns this router has sent to each node and not yet had answered; the
placement rule (`pick`) weighs it above the nodes' own queues, which lag by one poll.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

from actord.cluster.directory import Directory
from actord.cluster.messages import Answer, NodeLoad
from actord.vocabulary.config import ClusterConfig
from actord.vocabulary.errors import ActordError, InternalError, NodeUnavailable
from actord.vocabulary.log import get

log = get("actord.cluster.router")


class NodeMissing(Exception):
    """No daemon is registered under the node's name (it died for good, or never started)."""


NODE_GONE = (RayActorError, ActorUnavailableError, ObjectLostError, GetTimeoutError, asyncio.TimeoutError, NodeMissing)


def node_actor_name(node: str) -> str:
    return f"actord-node-{node}"


def _cancel(ref: Any) -> None:
    """Cancel a node's task whose caller went away (an async actor's asyncio task is
    cancelled: the slot's request ends as a cancelled one does on one daemon)."""
    try:
        ray.cancel(ref)
    except Exception as e:  # already done, or the node gone: nothing to stop
        log.info("cluster.cancel_not_sent", error=repr(e))


class NodeLink:
    """The router's handles on its nodes (by name), their Ray node ids, and its turns in flight."""

    def __init__(self, cfg: ClusterConfig, directory: Directory) -> None:
        self.cfg = cfg
        self.dir = directory
        self.handles: dict[str, Any] = {}
        self.ray_ids: dict[str, str] = {}
        self.inflight: dict[str, int] = {}

    def handle(self, name: str) -> Any:
        h = self.handles.get(name)
        if h is None:
            try:
                h = self.handles[name] = ray.get_actor(node_actor_name(name), namespace=self.cfg.namespace)
            except ValueError as e:  # Ray's "failed to look up actor"
                raise NodeMissing(f"no daemon for node {name}: {e}") from None
        return h

    def forget(self, name: str) -> None:
        """Look the node's daemon up again at the next call (it was replaced, or is lost)."""
        self.handles.pop(name, None)

    async def call(self, node: str, method: str, *args: Any, timeout: float | None = None) -> Any:
        ref = getattr(self.handle(node), method).remote(*args)
        try:
            ans: Answer = await asyncio.wait_for(ref, timeout or self.cfg.call_timeout_s)
        except RayTaskError as e:  # a bug on the node, not a refusal: no retry
            raise InternalError(f"node {node} failed {method}: {e}", node=node) from None
        return ans.unwrap()

    async def health(self, name: str) -> None:
        """Ask the node's daemon for its health, and remember which Ray node it runs on."""
        health = await asyncio.wait_for(self.handle(name).health.remote(), self.cfg.call_timeout_s)
        self.ray_ids[name] = health["ray_node_id"]

    async def run(self, node: str, method: str, args: tuple[Any, ...], sink: Callable[[Any], None] | None,
                  skip: int) -> Any:
        """One try of a turn (`method` "turn", or "free" for a request of no mind) on
        `node`: its result. Streamed (`sink`), its chunks go to `sink`, except the first
        `skip` (a retry's, sent by the try before). Cancelled (the caller went away: an
        HTTP client that hung up), the node's work is cancelled too (`ray.cancel`)."""
        handle = self.handle(node)
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

    async def alive_ray_nodes(self) -> set[str]:
        nodes = await asyncio.to_thread(ray.nodes)
        return {n["NodeID"] for n in nodes if n.get("Alive")}

    async def loads(self, exclude: set[str] = frozenset()) -> list[NodeLoad]:  # type: ignore[assignment]
        """The loads of the live nodes that answer (those that do not are left out)."""
        names = [n for n in self.dir.live_nodes() if n not in exclude]

        async def one(n: str) -> NodeLoad | None:
            try:
                return await self.call(n, "load", timeout=10.0)
            except (*NODE_GONE, ActordError):
                return None

        return [x for x in await asyncio.gather(*(one(n) for n in names)) if x is not None]

    def pick(self, loads: list[NodeLoad]) -> str:
        """Where a new mind goes: the node with the fewest turns in flight, then the fewest
        minds, then the most free page RAM."""
        if not loads:
            raise NodeUnavailable("no live node to place a mind on")
        counts = self.dir.counts()
        best = min(loads, key=lambda l: (l.queue + self.inflight.get(l.node, 0), counts.get(l.node, 0),
                                         -l.free_page_bytes, l.node))
        return best.node

    async def back(self, node: str) -> bool:
        """Wait for Ray to restart `node`'s daemon: True once it answers, False if its Ray
        node is dead or it does not come back within restart_wait_s."""
        deadline = time.monotonic() + self.cfg.restart_wait_s
        while time.monotonic() < deadline:
            rid = self.ray_ids.get(node)
            if rid and rid not in await self.alive_ray_nodes():
                return False
            try:
                await self.call(node, "start", timeout=10.0)
                return True
            except ActorUnavailableError:
                await asyncio.sleep(0.2)
            except RayActorError:  # died for good (ActorDiedError), or between restarts
                await asyncio.sleep(0.2)
            except (GetTimeoutError, asyncio.TimeoutError):
                pass
        return False
