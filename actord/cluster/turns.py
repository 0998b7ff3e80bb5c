"""The router's turns: a mind's turn on its node, and a request of no mind on any node.

Each turn carries (mind, epoch, turn id); one mind's turns are routed one at a time (a
per-mind lock), so a migration "freezes" a mind by taking that lock. A node that fails
mid-turn (its process died: a Ray actor error) is waited for; once Ray restarted it the turn
is sent again with the same turn id, once: a node that recorded it answers `DuplicateTurn`
with the recorded answer, which is the turn's answer. A node that does not come back (its
Ray node is dead) is treated as lost (loss.py) and the turn goes to the mind's new home.

Bad input is refused here (`check_turn`), before a new mind is placed, so a refused turn
changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, Awaitable, Callable, Iterator

import msgspec

from actord.chat.messages import ChatRequest
from actord.chat.turn import precheck
from actord.cluster.directory import Entry
from actord.cluster.loss import NodeLoss
from actord.cluster.messages import KINDS, Holding, Turn
from actord.cluster.nodelink import NODE_GONE
from actord.cluster.shared import RouterShared
from actord.engine.grammar import compiled
from actord.vocabulary.errors import DuplicateTurn, InvalidParams, NodeUnavailable
from actord.vocabulary.log import get
from actord.vocabulary.names import check_part
from actord.vocabulary.types import CompletionRequest, RequestLimits

log = get("actord.cluster.turns")


class TurnOut(msgspec.Struct, frozen=True):
    result: dict[str, Any]
    node: str
    epoch: int
    turn: str
    attempts: int = 1
    placed: bool = False


def check_turn(kind: str, mind: str | None, request: Any, limits: RequestLimits) -> None:
    """Refuse bad input: the verb's own checks, under the nodes' limits (a chat's as its
    rendered completion will be checked)."""
    if not isinstance(request, dict) or "mind" in request and request["mind"] not in (None, mind) or "slot" in request:
        raise InvalidParams("a cluster turn names its mind once and no slot")
    if kind not in KINDS:
        raise InvalidParams(f"a turn's kind is one of {', '.join(KINDS)}", kind=str(kind)[:32])
    try:
        if kind == "completion":
            compiled(msgspec.convert({**request, "mind": mind}, CompletionRequest).check(limits))
            return
        chat = msgspec.convert({**request, "mind": mind}, ChatRequest)
    except msgspec.ValidationError as e:
        raise InvalidParams(str(e)) from None
    precheck(chat, limits)


class _Chunks:
    """Passes a turn's chunks on to its sink and counts them: how many a node that failed
    mid-turn had already delivered (a retried turn skips them; a free turn that sent any is
    not retried)."""

    def __init__(self, sink: Callable[[Any], None] | None) -> None:
        self.n = 0
        self._sink = sink
        self.sink = self._pass if sink is not None else None

    def _pass(self, chunk: Any) -> None:
        self.n += 1
        self._sink(chunk)  # type: ignore[misc]


class Turns:
    """The router's turns: it owns the placing of new minds (one at a time); the directory,
    the node links, the minds' locks and the loss handling are shared. `reconcile` drops
    the copies a restarted node reports that the directory does not name (the router's)."""

    def __init__(self, shared: RouterShared, limits: RequestLimits, loss: NodeLoss,
                 reconcile: Callable[[str, list[Holding]], Awaitable[None]]) -> None:
        self.shared = shared
        self.limits = limits
        self.loss = loss
        self.reconcile = reconcile
        self.place_lock = asyncio.Lock()

    async def turn(self, mind: str, request: dict[str, Any], turn_id: str | None = None,
                   sink: Callable[[Any], None] | None = None, kind: str = "completion") -> TurnOut:
        """Run one turn of `mind` on its node (placing it first if it is new): a completion
        (CompletionRequest's fields) or a chat (ChatRequest's: the node renders it). `sink`
        (in this process only: the socket's and the HTTP front's streams) gets each chunk once."""
        if not isinstance(mind, str) or check_part(mind) is not None:
            raise InvalidParams(f"a mind name is one page-name component: {check_part(str(mind))}")
        check_turn(kind, mind, request, self.limits)
        turn = turn_id or uuid.uuid4().hex
        async with self.shared.locks.of(mind):
            placed = False
            entry = self.shared.dir.get(mind)
            if entry is None:
                entry = await self._place(mind)
                placed = True
            delivered = 0
            for attempt in (1, 2):
                node = entry.node
                with self._in_flight(node, sink) as chunks:
                    try:
                        result = await self.shared.nodes.run(
                            node, "turn", (Turn(mind=mind, epoch=entry.epoch, turn=turn, request=request, kind=kind),),
                            chunks.sink, delivered)
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
                        if await self.shared.nodes.back(node):
                            # Copies the restart reports that the directory does not name go, in
                            # the background (it takes each mind's lock in turn; this one's is held).
                            try:
                                holdings = await self.shared.nodes.call(node, "holdings")
                                asyncio.get_running_loop().create_task(self.reconcile(node, holdings))
                            except NODE_GONE:  # gone again: the retry below finds out
                                pass
                        else:
                            await self.loss.lost(node, only=mind)
                        entry = self.shared.dir.get(mind) or await self._place(mind)
                delivered += chunks.n
        raise AssertionError("unreachable")

    async def free_turn(self, request: dict[str, Any], sink: Callable[[Any], None] | None = None,
                        kind: str = "completion") -> TurnOut:
        """A request that names no mind (an HTTP request with no `user`, `prompt_cache_key`
        or mind header): run on the least loaded live node, placed there as one daemon
        places it, and not remembered in the directory (a fresh mind per request would be
        a mind no later request names, held until evicted). It changes no mind, so a node
        that fails before it sent a chunk is replaced by another, once."""
        check_turn(kind, None, request, self.limits)
        tried: set[str] = set()
        for attempt in (1, 2):
            node = self.shared.nodes.pick(await self.shared.nodes.loads(exclude=tried))
            with self._in_flight(node, sink) as chunks:
                try:
                    result = await self.shared.nodes.run(node, "free", (kind, request), chunks.sink, 0)
                    return TurnOut(result=result, node=node, epoch=0, turn="", attempts=attempt)
                except NODE_GONE as e:
                    if attempt == 2 or chunks.n:
                        raise NodeUnavailable(f"node {node} failed a request of no mind", node=node) from None
                    log.warning("cluster.free_turn_node_failed", node=node, error=repr(e))
                    tried.add(node)
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _in_flight(self, node: str, sink: Callable[[Any], None] | None) -> Iterator[_Chunks]:
        """While a turn runs on `node`, the node counts it in flight (what `NodeLink.pick`
        weighs), however the turn ends; its chunks reach `sink` counted."""
        inflight = self.shared.nodes.inflight
        inflight[node] = inflight.get(node, 0) + 1
        try:
            yield _Chunks(sink)
        finally:
            inflight[node] = inflight.get(node, 1) - 1

    async def _place(self, mind: str) -> Entry:
        """A new mind: on the node `NodeLink.pick` names, at a fresh epoch."""
        async with self.place_lock:
            node = self.shared.nodes.pick(await self.shared.nodes.loads())
            epoch = self.shared.dir.issue(mind)
            await self.shared.nodes.call(node, "adopt", mind, epoch, None, None)
            entry = self.shared.dir.assign(mind, node, epoch)
        log.info("cluster.placed", mind=mind, node=node, epoch=epoch)
        return entry
