"""What the chat package is given of its host (the system): the `ChatHost` protocol, and
the stream a streamed request feeds (`TokenChunk`, `OnToken`).

Why here, in chat: the interface a part needs from whoever hosts it belongs to that part, so
chat (floor 4) names it and the façade above implements it (actord/service/system.py);
nothing in chat imports the service. `ChatHost` gives the system's bounds and
configuration, its text jobs, its completions, and the one slot move n choices need (a
prefix forked into idle slots), without the actors themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, TypedDict

from actord.engine.jobs import ChatTemplateInfo, ModelProps
from actord.vocabulary.types import CompletionRequest, CompletionResult, RequestLimits
from actord.vocabulary.config import Config

if TYPE_CHECKING:
    from actord.chat.tool_output import CallMade
    from actord.chat.turn import ChatState


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
    calls: list["CallMade"]
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


class ChatHost(Protocol):
    """What the chat package is given of the system (see the module docstring)."""

    config: "Config"
    chat_state: "ChatState"  # the prompter and what else chats keep between turns
    # Thread work that is no event of its own (a template render, a template file read):
    # a deterministic dispatcher must know it is in flight (anyio.to_thread.run_sync's shape).
    run_sync: Callable[..., Awaitable[Any]]

    def check_open(self) -> None: ...
    def request_limits(self) -> RequestLimits: ...
    def model_props(self) -> ModelProps: ...
    async def chat_info(self) -> ChatTemplateInfo: ...
    async def tokens_of(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    async def text_of(self, tokens: list[int]) -> str: ...
    async def pieces_of(self, tokens: list[int]) -> list[bytes]: ...  # each token's bytes, control tokens as text
    async def complete(self, request: CompletionRequest, *, on_token: OnToken | None = None,
                       _input: bool = True) -> CompletionResult: ...
    async def fork_prefix(self, source: int, prefix: list[int], want: int) -> list[int]: ...

