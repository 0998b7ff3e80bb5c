"""The driver-side client: a Ray driver's handle on the router.

    ray.init(address=..., namespace="actord")
    c = ClusterClient()
    out = c.turn("ada", {"prompt": [1, 2, 3], "n_predict": 8})   # TurnOut: result, node, epoch, turn
    c.migrate("ada", "n2"); c.status()

A process that is not a Ray driver reaches the same router through its JSON-RPC socket
(rpc.py) with `actord.frontends.client.Client(path)`, exactly as it reaches one daemon.
"""

from __future__ import annotations

from typing import Any

import time
import uuid

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from actord.cluster.router import ROUTER_NAME
from actord.cluster.turns import TurnOut
from actord.vocabulary.errors import ActordError, DuplicateTurn, NodeUnavailable


def get(refs: Any) -> Any:
    """ray.get, with a typed actord error raised as itself (not wrapped in RayTaskError)."""
    try:
        return ray.get(refs)
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, ActordError):
            raise cause from None
        raise


class ClusterClient:
    """`restart_wait_s`: how long a call waits out a router that Ray is restarting (its
    restart reads the directory and starts its fronts: seconds under load) before the
    caller gets actord's typed `NodeUnavailable` (data `router: true`), not Ray's error."""

    def __init__(self, router: Any = None, namespace: str = "actord", restart_wait_s: float = 60.0) -> None:
        self.router = router if router is not None else ray.get_actor(ROUTER_NAME, namespace=namespace)
        self.restart_wait_s = restart_wait_s

    def _backoff(self, attempt: int, deadline: float) -> bool:
        """Sleep before try `attempt + 1`; False when the router's restart outlasted the wait."""
        pause = min(0.25 * 2 ** (attempt - 1), 2.0)
        if time.monotonic() + pause > deadline:
            return False
        time.sleep(pause)
        return True

    def _unavailable(self, e: BaseException) -> NodeUnavailable:
        """What a caller gets once a restart outlasted the wait: actord's typed error, not Ray's."""
        return NodeUnavailable(f"the cluster's router did not answer within {self.restart_wait_s:g} s (restarting?): "
                               f"retry; {type(e).__name__}", router=True)

    def turn(self, mind: str, request: dict[str, Any], turn_id: str | None = None) -> TurnOut:
        return self.turns([(mind, request)], [turn_id])[0]

    def turns(self, calls: list[tuple[str, dict[str, Any]]], turn_ids: list[str | None] | None = None) -> list[TurnOut]:
        """Several minds' turns at once (each mind's own turns stay in order at the router).

        Each turn gets its id here, so a call the router could not answer (it was briefly
        unreachable, or restarting) is sent again with the same id: a turn it had applied
        meanwhile answers `DuplicateTurn`, whose recorded answer is the turn's answer."""
        ids = [t or uuid.uuid4().hex for t in (turn_ids or [None] * len(calls))]
        refs = [self.router.turn.remote(m, r, t) for (m, r), t in zip(calls, ids)]
        out: list[Any] = [None] * len(calls)
        deadline = time.monotonic() + self.restart_wait_s
        for i, ref in enumerate(refs):
            attempt = 0
            while True:
                attempt += 1
                try:
                    out[i] = get(ref)
                    break
                except (ActorUnavailableError, ActorDiedError) as e:  # the router restarting
                    if not self._backoff(attempt, deadline):
                        raise self._unavailable(e) from e
                except DuplicateTurn as e:
                    if attempt == 1 or e.data.get("result") is None:
                        raise
                    # Applied by a try whose answer was lost (the router died after it): the
                    # node's record says what and where.
                    out[i] = TurnOut(result=e.data["result"], node=e.data.get("node", "?"), epoch=e.data.get("epoch", 0),
                                     turn=ids[i], attempts=attempt)
                    break
                m, r = calls[i]
                ref = self.router.turn.remote(m, r, ids[i])
        return out

    def complete(self, mind: str, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        return self.turn(mind, {"prompt": prompt, **params}).result

    def migrate(self, mind: str, node: str) -> dict[str, Any]:
        return get(self.router.migrate.remote(mind, node))

    def persist(self, mind: str) -> dict[str, Any]:
        return get(self.router.persist.remote(mind))

    def where(self, mind: str) -> Any:
        return self._read("where", mind)

    def status(self) -> dict[str, Any]:
        return self._read("status")

    def rebalance(self) -> list[dict[str, Any]]:
        return get(self.router.rebalance.remote())

    def lost_events(self) -> list[dict[str, Any]]:
        return self._read("lost_events")

    def _read(self, method: str, *args: Any) -> Any:
        """A call that changes nothing, sent again if the router was briefly unreachable."""
        deadline = time.monotonic() + self.restart_wait_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return get(getattr(self.router, method).remote(*args))
            except (ActorUnavailableError, ActorDiedError) as e:
                if not self._backoff(attempt, deadline):
                    raise self._unavailable(e) from e
