"""What the chat package is given of its host (the system): the `ChatHost` protocol, and
the stream a streamed request feeds (`TokenChunk`, `OnToken`).

Why here, in chat: the interface a part needs from whoever hosts it belongs to that part, so
chat (floor 4) names it and the façade above implements it (actord/service/system.py);
nothing in chat imports the service. `ChatHost` gives the system's bounds and
configuration, its text jobs, its completions, and the one slot move n choices need (a
prefix forked into idle slots), without the actors themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from actord.engine.jobs import ChatTemplateInfo, ModelProps
from actord.vocabulary.types import CompletionRequest, CompletionResult, RequestLimits
from actord.vocabulary.config import Config

from actord.chat.stream import OnToken

if TYPE_CHECKING:
    from actord.chat.state import ChatState


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
                       _input: bool = True, _cached: bool = True) -> CompletionResult: ...
    async def fork_prefix(self, source: int, prefix: list[int], want: int) -> list[int]: ...

