"""The façade's side of the prompt cache (policy/prompt_cache.py): which unnamed requests
run as the daemon's own minds, what their answers say, and the forgetting past the bound.

Why here: the choice is made where every front's completion enters (`ActorSystem.complete`),
so the socket, the HTTP routes and an embedding host all get it; the placer then treats
such a request as any mind's turn. A request that names a slot or a mind, brings a prompt
shorter than `prompt_cache_min_tokens`, or has a one-off salt (native `cache_prompt:
false`) runs as before; a text prompt is tokenized first (where the slot would have). No answer names the cache's mind, and no client's
listing shows one (a name holding the scope mark is no client's: service/tenancy.py).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

import anyio
import msgspec

from actord.engine.jobs import ModelProps
from actord.policy.prompt_cache import PromptCache
from actord.serving.slot import gene_set
from actord.service.daemon_minds import charged, forget_past_bound
from actord.vocabulary.config import Config
from actord.vocabulary.kv_identity import one_off
from actord.vocabulary.metrics import Metrics
from actord.vocabulary.names import MIND_FILE_SUFFIX, is_cache_mind, is_responses_mind
from actord.vocabulary.types import CompletionRequest, CompletionResult


class CacheTurns:
    """The prompt cache of one system: it is given the system's default genes (a shared list,
    filled at start), how to forget a mind by the daemon's name, and how to list the minds
    resident in slots."""

    def __init__(self, config: Config, metrics: Metrics, default_genes: Sequence[int],
                 forget: Callable[[str], Awaitable[int]], resident: Callable[[], Awaitable[set[str]]]) -> None:
        self.cache = PromptCache(config.prompt_cache_minds, config.prompt_cache_bytes) \
            if config.prompt_cache_minds > 0 else None
        self.min_tokens = config.prompt_cache_min_tokens
        self.metrics = metrics
        self.default_genes = default_genes
        self.forget = forget
        self.resident = resident

    async def begin(self, request: CompletionRequest, tokens_of: Callable[[str], Awaitable[list[int]]],
                    props: ModelProps) -> CompletionRequest:
        """`request` as it runs: as a mind of the cache's where it is one the cache serves. A
        text prompt that may be long enough is tokenized here (`tokens_of`, as the slot would:
        special tokens added and parsed), and runs as its tokens."""
        if (self.cache is None or request.mind is not None or request.slot is not None
                or one_off(request.cache_salt)):
            return request
        if isinstance(request.prompt, str):
            if len(request.prompt.encode()) < self.min_tokens:  # a token is at least a byte
                return request
            request = msgspec.structs.replace(request, prompt=await tokens_of(request.prompt))
        assert isinstance(request.prompt, list)
        if len(request.prompt) < self.min_tokens:
            return request
        mind, found = self.cache.take(request.prompt, gene_set(self.default_genes, request), request.kv_scope(),
                                      parted=cuts_anywhere(props))
        self.metrics.prompt_cache_turns_total.labels(found="yes" if found else "no").inc()
        return msgspec.structs.replace(request, mind=mind)

    async def end(self, request: CompletionRequest, result: CompletionResult, props: ModelProps) -> CompletionResult:
        """After a cache mind's turn: found by this prompt from here on, and the minds past
        the bound forgotten (shielded: the bound holds whether or not the client stays)."""
        if self.cache is None or request.mind is None or not is_cache_mind(request.mind):
            return result
        assert isinstance(request.prompt, list)
        self.cache.done(request.mind, request.prompt, gene_set(self.default_genes, request), request.kv_scope())
        n_bytes = charged(props, result.n_prompt_tokens + len(result.tokens))
        with anyio.CancelScope(shield=True):  # the bound holds whether or not the client stays
            await forget_past_bound(self.cache.minds, request.mind, n_bytes, forget=self.forget,
                                    resident=self.resident, evicted=self.metrics.prompt_cache_evicted_total,
                                    gauge=self.metrics.prompt_cache_minds, event="prompt_cache.mind_forgotten")
        return result

    def failed(self, request: CompletionRequest) -> None:
        if self.cache is not None and request.mind is not None and is_cache_mind(request.mind):
            self.cache.failed(request.mind)


def cuts_anywhere(props: ModelProps) -> bool:
    """Can a paged-in state be cut back to any position? Not under a sliding window (a page
    holds only its last window of those layers) nor with recurrent state (one state, at the end)."""
    return props.n_swa == 0 and not props.recurrent and not props.hybrid


def stale_files(names: Any) -> list[str]:
    """The page files in the page folder's index at start of the minds an earlier process
    made for requests that named none: the prompt cache's (the index that found them is gone
    with that process, so nothing would ever use them) and the Responses front's anonymous
    conversations' (their bound, `--http-anonymous-minds`, is kept in memory: files left
    from each process would otherwise pile up, one bound's worth per restart)."""
    return sorted(n for n in names if "/" not in n and n.endswith(MIND_FILE_SUFFIX)
                  and (is_cache_mind(n) or is_responses_mind(n)))
