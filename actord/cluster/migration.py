"""Moving a mind between nodes: `migrate` one, `rebalance` many.

Export on the source (page out + spill: durable there; the mind is frozen), the blob goes
source -> destination through the object store (the ObjectRef is passed, not the bytes: the
router never holds them), the destination writes it durably and holds it at epoch + 1, the
directory flips (the commit point), the source drops its copy. Any failure before the flip
leaves the source the owner (thawed, or reloaded from its spill by its restart) and drops
the destination's partial copy. The caller holds the mind's lock throughout, so no turn of
the mind runs while it moves.
"""

from __future__ import annotations

import time
from typing import Any

from actord.cluster.loss import NodeLoss
from actord.cluster.nodelink import NODE_GONE
from actord.cluster.shared import RouterShared
from actord.vocabulary.errors import ActordError, InvalidParams, MigrationFailed, PageNotFound
from actord.vocabulary.log import get

log = get("actord.cluster.migration")


class Migrations:
    """The router's moves of minds between nodes: it owns the record of the moves made;
    the directory, the node links, the minds' locks and the loss handling are shared."""

    def __init__(self, shared: RouterShared, loss: NodeLoss) -> None:
        self.shared = shared
        self.loss = loss
        self.migrations: list[dict[str, Any]] = []

    async def migrate(self, mind: str, dest: str) -> dict[str, Any]:
        async with self.shared.locks.of(mind):
            return await self._migrate(mind, dest)

    async def _migrate(self, mind: str, dest: str) -> dict[str, Any]:
        entry = self.shared.dir.get(mind)
        if entry is None:
            raise PageNotFound(f"no mind {mind!r} in the directory", mind=mind)
        if dest not in self.shared.dir.live_nodes():
            raise InvalidParams(f"no live node {dest!r}", node=dest)
        if entry.node == dest:
            return {"mind": mind, "node": dest, "epoch": entry.epoch, "moved": False}
        src, epoch = entry.node, self.shared.dir.issue(mind)
        t0 = time.perf_counter()
        try:
            blob = self.shared.nodes.handle(src).export.remote(mind, entry.epoch)  # the ref travels, not the bytes
            adopted = await self.shared.nodes.call(dest, "adopt", mind, epoch, blob, None)
        except (*NODE_GONE, ActordError) as e:
            await self._abort(mind, src, entry.epoch, dest, epoch)
            err = e.to_dict() if isinstance(e, ActordError) else {"type": type(e).__name__, "message": str(e)[:300]}
            log.warning("cluster.migration_failed", mind=mind, src=src, dest=dest, error=err)
            raise MigrationFailed(f"moving {mind!r} {src} -> {dest} failed: {err.get('message', '')[:200]}",
                                  mind=mind, owner=src, epoch=entry.epoch, cause=err.get("type")) from None
        self.shared.dir.assign(mind, dest, epoch)  # the commit point
        t_ms = (time.perf_counter() - t0) * 1e3
        try:
            await self.shared.nodes.call(src, "release", mind, entry.epoch)
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
            await self.shared.nodes.call(dest, "release", mind, epoch)
        except (*NODE_GONE, ActordError) as e:
            log.warning("cluster.dest_not_released", mind=mind, dest=dest, error=repr(e))
        try:
            await self.shared.nodes.call(src, "thaw", mind, src_epoch, timeout=30.0)
        except NODE_GONE:  # the source died: its restart comes back unfrozen, from its spill
            if not await self.shared.nodes.back(src):
                await self.loss.lost(src, only=mind)
        except ActordError:
            pass

    async def rebalance(self) -> list[dict[str, Any]]:
        """Move minds from the nodes holding most to those holding fewest, until no two
        live nodes differ by more than one."""
        moved = []
        while True:
            counts = self.shared.dir.counts()
            if len(counts) < 2:
                return moved
            hi = max(counts, key=lambda n: (counts[n], n))
            lo = min(counts, key=lambda n: (counts[n], n))
            if counts[hi] - counts[lo] <= 1:
                return moved
            mind = self.shared.dir.minds_on(hi)[-1]
            async with self.shared.locks.of(mind):
                moved.append(await self._migrate(mind, lo))
