"""The driver-side client: a Ray driver's handle on the router.

    ray.init(address=..., namespace="actord")
    c = ClusterClient()
    out = c.turn("ada", {"prompt": [1, 2, 3], "n_predict": 8})   # TurnOut: result, node, epoch, turn
    c.migrate("ada", "n2"); c.status()

A process that is not a Ray driver reaches the same router through its JSON-RPC socket
(rpc.py) with `actord.client.Client(path)`, exactly as it reaches one daemon.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayTaskError

from actord.cluster.router import ROUTER_NAME, TurnOut
from actord.errors import ActordError


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
    def __init__(self, router: Any = None, namespace: str = "actord") -> None:
        self.router = router if router is not None else ray.get_actor(ROUTER_NAME, namespace=namespace)

    def turn(self, mind: str, request: dict[str, Any], turn_id: str | None = None) -> TurnOut:
        return get(self.router.turn.remote(mind, request, turn_id))

    def turns(self, calls: list[tuple[str, dict[str, Any]]]) -> list[TurnOut]:
        """Several minds' turns at once (each mind's own turns stay in order at the router)."""
        return get([self.router.turn.remote(m, r, None) for m, r in calls])

    def complete(self, mind: str, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        return self.turn(mind, {"prompt": prompt, **params}).result

    def migrate(self, mind: str, node: str) -> dict[str, Any]:
        return get(self.router.migrate.remote(mind, node))

    def persist(self, mind: str) -> dict[str, Any]:
        return get(self.router.persist.remote(mind))

    def where(self, mind: str) -> Any:
        return get(self.router.where.remote(mind))

    def status(self) -> dict[str, Any]:
        return get(self.router.status.remote())

    def rebalance(self) -> list[dict[str, Any]]:
        return get(self.router.rebalance.remote())

    def lost_events(self) -> list[dict[str, Any]]:
        return get(self.router.lost_events.remote())
