"""Per-slot context (`--ctx-per-slot`): each slot held to n_ctx / slots tokens, as
llama-server gives each of its slots, for clients that size their prompts by what /props
and /slots report.

Why at the service and not in the slots: actord's KV cache is one pool of `--ctx` cells the
slots share (a long conversation may take most of it while others are short), and the
placement, eviction and paging all work on that pool; the per-slot mode is a promise about
requests, not a different cache. So it is kept where every request passes once, before it
reaches a slot: a prompt of n_ctx / slots tokens or more is refused with llama-server's
numbers (PromptTooLong with n_prompt_tokens and n_ctx: `exceed_context_size_error` on the
native routes, `context_length_exceeded` on /v1), and a generation is held to what is left
of the slot's size (it ends `length`, llama-server's `limit`). A text prompt is tokenized here
for that, once, as the slot would tokenize it (BOS added, special tokens parsed), and goes on
as its tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.vocabulary.errors import PromptTooLong
from actord.vocabulary.types import CompletionRequest
from actord.vocabulary.config import Config

def slot_n_ctx(config: "Config", n_ctx: int) -> int:
    """A slot's context as /props and /slots report it: n_ctx / slots with --ctx-per-slot,
    else the whole pool (any slot may use all of it)."""
    return max(1, n_ctx // config.slots) if config.ctx_per_slot else n_ctx


async def fit(system: Any, request: CompletionRequest) -> CompletionRequest:
    """`request` held to a slot's context (see the module docstring)."""
    n_ctx = slot_n_ctx(system.config, system.model_props().n_ctx)
    prompt = await system.tokens_of(request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
    if len(prompt) >= n_ctx:
        raise PromptTooLong(f"the request exceeds the available context size: a prompt of {len(prompt)} tokens, "
                            f"a slot's context of {n_ctx} (--ctx-per-slot)", n_prompt_tokens=len(prompt), n_ctx=n_ctx)
    return msgspec.structs.replace(request, prompt=prompt, n_predict=min(request.n_predict, n_ctx - len(prompt)))
