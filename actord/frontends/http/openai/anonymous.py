"""The minds the Responses front makes for anonymous conversations, and the rule that
forgets them: by count and by bytes, least recently used first, counted in
`http_anonymous_minds_evicted_total` (and the gauge `http_anonymous_minds`).

Why: a conversation that names no mind (no `X-Actord-Mind`, `prompt_cache_key` or `user`)
gets one named from how it starts (responses_api.py `conversation_mind`), so that its next
turn resumes from its state. Nothing ever dropped those: 400 anonymous conversations left
217 RAM pages and 181 page files, and per-request time rose from 12 to 113 ms (issue 33);
the stored responses were bounded, their minds were not. A named mind is its client's to
keep; an anonymous one is the daemon's, so the daemon bounds them: at most
`http_anonymous_minds` of them, holding at most `http_anonymous_mind_bytes` of state
(charged as a page would be: recurrent state plus KV bytes per token times its tokens).
Past either, the least recently used one's RAM page and page file are dropped
(`Service.forget_mind`); its next turn, if one comes, starts fresh. One resident in a slot
is not erased (the slot may serve another mind by then): it stays listed, oldest, and is
forgotten once it has been paged out, so the bound is exceeded by at most the slot count.

The policy is pure (`AnonymousMinds.touch` says whom to forget); the front awaits the
forgetting (`forget_past_bound`) after the turn that went past the bound, shielded from the
client's cancel. A system without `forget_mind` (the cluster's router) keeps its own.
"""

from __future__ import annotations

from typing import Any

from actord.frontends.http.openai.lru import BoundedLru
from actord.vocabulary.errors import ActordError
from actord.vocabulary.log import get

log = get("actord.frontends.http")


class AnonymousMinds(BoundedLru[int]):
    """The anonymous minds by last use, oldest first, with their charged bytes."""

    def __init__(self, max_minds: int, max_bytes: int) -> None:
        super().__init__(max_minds, max_bytes, int)

    def touch(self, mind: str, n_bytes: int) -> list[str]:
        """`mind` was just used and now holds `n_bytes`: the minds to forget, oldest first
        (never `mind` itself), already taken off the list."""
        return [old for old, _ in self._add(mind, n_bytes)]

    def keep(self, mind: str, n_bytes: int) -> None:
        """`mind` could not be forgotten yet (it sits in a slot): listed again, as the oldest."""
        self._add_oldest(mind, n_bytes)


async def forget_past_bound(minds: AnonymousMinds, system: Any, mind: str, c: Any) -> None:
    """After anonymous mind `mind`'s turn (its completion `c`): the minds past the bound
    forgotten, counted and logged."""
    forget = getattr(system, "forget_mind", None)
    if forget is None:
        return
    props = system.model_props()
    n_bytes = props.recurrent_state_bytes + (c.n_prompt_tokens + len(c.tokens)) * props.kv_bytes_per_token
    metrics = system.metrics
    resident: set[str] | None = None
    for old in minds.touch(mind, n_bytes):
        try:
            freed = await forget(old)
        except ActordError as e:  # a failing disk: the mind leaves the list, logged
            log.warning("responses.forget_failed", mind=old, error=e.to_dict())
            freed = -1
        if freed == 0:
            if resident is None:
                resident = {s.mind for s in await system.slot_list() if s.mind}
            if old in resident:  # in a slot: forgotten once it has been paged out
                minds.keep(old, 0)
            continue
        metrics.http_anonymous_minds_evicted_total.inc()
        log.info("responses.mind_forgotten", mind=old, n_bytes=freed)
    metrics.http_anonymous_minds.set(len(minds))
