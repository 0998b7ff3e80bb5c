"""The stream a streamed request feeds: its chunks (`TokenChunk`), the sink that takes them
(`OnToken`), the fields a held-back chunk passes on (`carry`), and a tool call a chunk
completed (`CallMade`).

Why apart from the host: the parsers that hold chunks back (reasoning.py, tool_output.py)
speak it, and the host's protocol (host.py) names it; neither needs the other.
"""

from __future__ import annotations

from typing import Any, Callable, TypedDict

import msgspec

from actord.chat.messages import ToolCall


class CallMade(msgspec.Struct, frozen=True):
    """A tool call a streamed chunk completed, whole: the `index`-th call of its choice
    (a call is sent once its JSON is complete, so a streamed answer never holds a call the
    final parse would refuse)."""

    index: int
    call: ToolCall


class TokenChunk(TypedDict, total=False):
    """One streamed chunk, as `on_token` receives it: the scheduler writes `slot`, `content`,
    `tokens` (and `logprobs`, `progress`, `timings` when asked), and with a request's first chunk `n_prompt` and
    `n_cached` (its prompt's tokens, of them those the slot already held: an API whose stream
    opens with the prompt's usage reads them); n choices add their `index`; a chat with tools
    adds the `calls` the chunk completed (actord/chat/tool_output.py). A sink that holds a
    chunk back passes its `PLACED` fields on with the next chunk it sends (`carry`)."""

    slot: int
    content: str
    tokens: list[int]
    logprobs: Any
    index: int
    calls: list[CallMade]
    progress: dict[str, Any]  # return_progress: the prompt's (content ""; actord/serving/stream_extras.py)
    timings: dict[str, Any]  # timings_per_token: the request's so far
    n_prompt: int
    n_cached: int


PLACED = ("n_prompt", "n_cached")


def carry(held: dict[str, Any], chunk: dict[str, Any]) -> dict[str, Any]:
    """`held` with a chunk's PLACED fields, which a sink keeps while it holds that chunk back
    (a marker may be starting), so the chunk it sends next still carries them."""
    return {**held, **{k: chunk[k] for k in PLACED if k in chunk}} if PLACED[0] in chunk else held


# Called on the event loop for every chunk; it must not block (a sink that raises ends its
# own request, nobody else's).
OnToken = Callable[[TokenChunk], None]
