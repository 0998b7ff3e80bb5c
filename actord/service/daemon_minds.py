"""Forgetting the minds the daemon made for itself once they pass their bound: the Responses
front's anonymous conversations (frontends/http/openai/responses_api.py) and the prompt
cache's minds (service/prompt_cache.py).

Why one loop: both lists are a `DaemonMinds` (policy/lru.py: by count and bytes, least
recently used first), and forgetting one is the same act for both: drop its RAM page and
remove its page file. A mind resident in a slot is not erased (the slot may serve another
by then): it stays listed, oldest, and is forgotten once it has been paged out, so a bound
is exceeded by at most the slot count. A failing disk takes the mind off the list, logged.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from actord.policy.lru import DaemonMinds
from actord.vocabulary.errors import ActordError
from actord.vocabulary.log import get

log = get("actord.service.daemon_minds")


def charged(props: Any, n_tokens: int) -> int:
    """The bytes a mind of `n_tokens` is charged, as her page would be: the recurrent state
    plus the KV bytes of each token."""
    return props.recurrent_state_bytes + n_tokens * props.kv_bytes_per_token


async def forget_past_bound(minds: DaemonMinds, mind: str, n_bytes: int, *, forget: Callable[[str], Awaitable[int]],
                            resident: Callable[[], Awaitable[set[str]]], evicted: Any, gauge: Any,
                            event: str) -> None:
    """After mind `mind`'s turn (it now holds `n_bytes`): the minds past the bound forgotten
    by `forget` (their bytes freed; 0 when nothing of theirs was outside a slot), each
    counted in `evicted` and logged as `event`; `gauge` set to the minds listed."""
    in_slots: set[str] | None = None
    for old in minds.touch(mind, n_bytes):
        try:
            freed = await forget(old)
        except ActordError as e:
            log.warning(f"{event}.forget_failed", mind=old, error=e.to_dict())
            freed = -1
        if freed == 0:
            if in_slots is None:
                in_slots = await resident()
            if old in in_slots:  # forgotten once it has been paged out
                minds.keep(old, 0)
                continue
        evicted.inc()
        log.info(event, mind=old, n_bytes=freed)
    gauge.set(len(minds))
