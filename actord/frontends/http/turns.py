"""What every chat API's routes share between reading a request and calling the `chat` verb.

Why a module of its own: OpenAI's chat completions, the Responses API and Anthropic's
messages are one chat turn each, read from three wires. A route is thin: it decodes the
body, hands it to its wire module's pure `to_turn(request, headers, context)` (the
`TurnContext`: the daemon's defaults and limits, the model's vocabulary, the session
headers to read), fits the turn to the model's template (`fit`: the one async step, since
what the template refuses is probed once per front), calls the Service verb, and writes the
result with its wire's `from_result` (or its streamed events). What those steps share is
here: the context, the `Turn` a wire reads, the mind a request names (`mind_of`), and `fit`.

The mind: the `X-Actord-Mind` header (used as given: it must be a valid mind name), else a
session header the operator named (`--http-mind-headers`), else the API's cache key
(OpenAI's `prompt_cache_key`), else its end-user id (`user`, Anthropic's
`metadata.user_id`), both free-form and mapped to a mind name through a digest
(`mind_for`). With none, a request is placed like llama-server's: the idle slot sharing the
longest prefix. A digest-named mind's name as the client gave it is the turn's `label`,
which the route notes for the dashboard.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

import msgspec

from actord.chat.defaults import TurnDefaults, turn_defaults
from actord.chat.messages import ChatMessage, ChatRequest
from actord.chat.turn import precheck
from actord.frontends.http.degraded import Degraded, fold_for
from actord.vocabulary.config import split_names
from actord.vocabulary.types import RequestLimits


class TurnContext(msgspec.Struct, frozen=True):
    """What a wire reads a turn under, beside the request itself (see the module docstring)."""

    defaults: TurnDefaults
    limits: RequestLimits
    n_vocab: int  # a logit bias names a token of this model
    max_n: int  # --max-n: the choices one request may ask for
    mind_headers: tuple[str, ...] = ()  # --http-mind-headers, lower-cased

    @classmethod
    def of(cls, front: Any) -> "TurnContext":
        config, props = front.config, front.system.model_props()
        return cls(defaults=turn_defaults(config, props.n_ctx), limits=config.request_limits(),
                   n_vocab=props.n_vocab, max_n=config.max_n,
                   mind_headers=tuple(h.lower() for h in split_names(config.http_mind_headers)))


Label = tuple[str, str, str]  # (mind, where its name came from, the name as given)


@dataclass
class Turn:
    """A wire's request read as one chat turn: the ChatRequest (defaults applied, not yet
    fitted to the template nor checked: `fit`), what it answers in a lesser form (`degraded`,
    its header), how many choices, and the label of a digest-named mind."""

    chat: ChatRequest
    degraded: Degraded
    n: int = 1
    label: Label | None = None


def mind_for(kind: str, value: str) -> str:
    """A mind name for a free-form `user` ("u"), `prompt_cache_key` ("k") or session header
    ("h"): stable across requests and restarts (no secret, so spilled pages keep their
    names), one page-name component whatever the input, and 128 bits of digest, so distinct
    values never meet."""
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16, person=b"actord-" + kind.encode())
    return f"{kind}-{digest.hexdigest()}"


def mind_of(headers: Mapping[str, str], context: TurnContext, key: str | None,
            user: str | None) -> tuple[str | None, Label | None]:
    """The mind a request names (see the module docstring), and its label when a digest named it."""
    header = headers.get("x-actord-mind")
    if header:
        return header, None  # as given: the turn's check refuses a name that is not one
    given = next(((name, v) for name in context.mind_headers if (v := headers.get(name))), None)
    kind, source, value = (("h", given[0], given[1]) if given else ("k", "prompt_cache_key", key) if key
                           else ("u", "user", user) if user else ("", "", None))
    if not value:
        return None, None
    mind = mind_for(kind, value)
    return mind, (mind, source, value)


async def roles_for(front: Any, messages: list[ChatMessage]) -> list[ChatMessage]:
    """`developer` messages (OpenAI's newer name for `system`) as `system`, unless the
    template names the developer role itself: templates written before it (Gemma 3's)
    refuse or drop an unknown role."""
    if not any(m.role == "developer" for m in messages) or await front.template_names_developer():
        return messages
    return [msgspec.structs.replace(m, role="system") if m.role == "developer" else m for m in messages]


async def fitted(front: Any, messages: list[ChatMessage], degraded: Degraded) -> list[ChatMessage]:
    """A conversation as the template takes it: its roles (`roles_for`), then folded where
    the template refuses its shape (degraded.py, each fold noted)."""
    return await fold_for(front, await roles_for(front, messages), degraded)


async def fit(front: Any, turn: Turn) -> ChatRequest:
    """The turn's ChatRequest fitted to the template and checked (`chat.turn.precheck`):
    what the route hands the `chat` verb. The dashboard learns a digest-named mind's label."""
    chat = turn.chat
    messages = await fitted(front, chat.messages, turn.degraded)
    if messages is not chat.messages:
        chat = msgspec.structs.replace(chat, messages=messages)
    precheck(chat, front.config.request_limits())
    if turn.label is not None:
        front.mind_labels.note(*turn.label)
    return chat
