"""Node loss: a monitor polls Ray's node table, and a dead node's minds are re-homed.

A lost node's minds go to the live nodes at a new epoch, from the lost node's page and
fence files in the shared cluster folder where they are, else fresh (their next turn
re-prefills). Each loss is one event in `lost_log` (when it was seen, where each mind
went, when it was done), which `status` reports. A turn that finds its node gone re-homes
just its own mind at once (it holds that mind's lock) and leaves the rest to a task.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from actord.cluster.nodelink import NODE_GONE
from actord.cluster.shared import RouterShared
from actord.vocabulary.config import ClusterConfig
from actord.vocabulary.errors import ActordError, NodeUnavailable
from actord.vocabulary.log import get

log = get("actord.cluster.loss")


class NodeLoss:
    """The router's node-loss handling: it owns the loss events; the directory, the node
    links and the minds' locks are the router's, shared with its other parts."""

    def __init__(self, cfg: ClusterConfig, shared: RouterShared) -> None:
        self.cfg = cfg
        self.shared = shared
        self.lost_log: list[dict[str, Any]] = []

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.monitor_interval_s)
            try:
                alive = await self.shared.nodes.alive_ray_nodes()
                for name in self.shared.dir.state.nodes:
                    rid = self.shared.nodes.ray_ids.get(name)
                    dead = name in self.shared.dir.state.lost or (rid is not None and rid not in alive)
                    if dead and self.shared.dir.minds_on(name):
                        await self.lost(name)
                    elif dead and name not in self.shared.dir.state.lost:
                        self._lost_event(name)
                        self.shared.dir.mark_lost(name)
            except Exception as e:  # the monitor must outlive one bad poll
                log.error("cluster.monitor_failed", error=repr(e))

    def _lost_event(self, name: str) -> dict[str, Any]:
        for ev in self.lost_log:
            if ev["node"] == name and "done" not in ev:
                return ev
        ev = {"node": name, "detected": time.time(), "rehomed": []}
        self.lost_log.append(ev)
        log.warning("cluster.node_lost", node=name, minds=len(self.shared.dir.minds_on(name)))
        return ev

    async def lost(self, name: str, only: str | None = None) -> None:
        """Re-home the minds of lost node `name`. `only`: the caller holds that mind's lock
        and re-homes just it; the rest are left to a task that takes one lock at a time."""
        event = self._lost_event(name)
        self.shared.dir.mark_lost(name)
        self.shared.nodes.forget(name)
        if only is not None:
            await self._rehome(only, name, event)
            asyncio.get_running_loop().create_task(self.lost(name))
            return
        for mind in self.shared.dir.minds_on(name):
            async with self.shared.locks.of(mind):
                await self._rehome(mind, name, event)
        if not self.shared.dir.minds_on(name):
            event["done"] = time.time()

    async def _rehome(self, mind: str, lost: str, event: dict[str, Any]) -> None:
        entry = self.shared.dir.get(mind)
        if entry is None or entry.node != lost:
            return
        loads = await self.shared.nodes.loads(exclude={lost})
        last: Exception | None = None
        while loads:
            node = self.shared.nodes.pick(loads)
            epoch = self.shared.dir.issue(mind)
            try:
                adopted = await self.shared.nodes.call(node, "adopt", mind, epoch, None, lost)
            except (*NODE_GONE, ActordError) as e:
                last = e
                loads = [l for l in loads if l.node != node]
                continue
            self.shared.dir.assign(mind, node, epoch)
            event["rehomed"].append({"mind": mind, "node": node, "epoch": epoch, "from_file": adopted["page"],
                                     "after_s": round(time.time() - event["detected"], 3)})
            log.info("cluster.rehomed", mind=mind, lost=lost, node=node, epoch=epoch, from_file=adopted["page"])
            return
        raise NodeUnavailable(f"no node could take {mind!r} from lost node {lost}: {last!r}", mind=mind, node=lost)
