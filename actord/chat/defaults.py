"""What a chat turn gets where the API it came through said nothing, applied in one place.

Why in chat: OpenAI's chat completions, the Responses API and Anthropic's messages each
leave the reply's length and the sampling to the server when a request names neither, and
each front used to write the same fallbacks itself. A front's wire reader (`to_turn` in
each wire module) passes what the request asked for, None where it said nothing, to
`asked`; the fallbacks are here, once:

- the reply's length: `--http-default-max-tokens`, within the model's context
  (llama-server's `-n` analogue; native /completion's `n_predict` reads it too);
- temperature 1 and top_p 1: OpenAI's and Anthropic's documented defaults.

The socket's `chat` verb keeps its own defaults (ChatRequest's, 256 tokens and greedy),
which are its wire; llama-server's /completion keeps llama-server's sampling defaults
(actord/frontends/http/native/sampling.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.chat.messages import ChatRequest
from actord.vocabulary.config import Config

class TurnDefaults(msgspec.Struct, frozen=True):
    """The fallbacks of one daemon and model (see the module docstring)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0


def max_tokens(config: "Config", n_ctx: int) -> int:
    """The reply's length when a request names none: --http-default-max-tokens within `n_ctx`."""
    return min(config.http_default_max_tokens, n_ctx)


def turn_defaults(config: "Config", n_ctx: int) -> TurnDefaults:
    return TurnDefaults(max_tokens=max_tokens(config, n_ctx))


def asked(d: TurnDefaults, *, max_tokens: int | None, temperature: float | None, top_p: float | None,
          **fields: Any) -> ChatRequest:
    """The ChatRequest a front's request asks for: its fields, the length and sampling it
    left unsaid (None) filled from `d`. Not checked yet: the front fits it to the template
    (folds) first, then `turn.precheck` refuses what is wrong."""
    return ChatRequest(n_predict=d.max_tokens if max_tokens is None else max_tokens,
                       temperature=d.temperature if temperature is None else temperature,
                       top_p=d.top_p if top_p is None else top_p, **fields)
