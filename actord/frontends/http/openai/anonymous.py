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
(`Service.forget_mind`); its next turn, if one comes, starts fresh. The rule is the one
every mind the daemon makes is held to (service/daemon_minds.py).

The front awaits the forgetting after the turn that went past the bound, shielded from the
client's cancel. A system without `forget_mind` (the cluster's router) keeps its own.
"""

from __future__ import annotations

from typing import Any

from actord.policy.lru import DaemonMinds
from actord.service.daemon_minds import charged, forget_past_bound as forget_minds


async def forget_past_bound(minds: DaemonMinds, system: Any, mind: str, c: Any) -> None:
    """After anonymous mind `mind`'s turn (its completion `c`): the minds past the bound
    forgotten, counted and logged."""
    forget = getattr(system, "forget_mind", None)
    if forget is None:
        return
    props = system.model_props()

    async def resident() -> set[str]:
        return {s.mind for s in await system.slot_list() if s.mind}

    metrics = system.metrics
    await forget_minds(minds, mind, charged(props, c.n_prompt_tokens + len(c.tokens)), forget=forget,
                       resident=resident, evicted=metrics.http_anonymous_minds_evicted_total,
                       gauge=metrics.http_anonymous_minds, event="responses.mind_forgotten")
