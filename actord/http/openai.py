"""The OpenAI wire shapes: request Structs, response builders, the error object.

Pure data and pure functions, no I/O, so the shapes can be tested without a server. Requests
decode with msgspec at the edge (a wrong type names its JSON path in the 400's message);
fields we cannot honour (n > 1, tools, logprobs, penalties) are refused with a 400 that
says so, never silently ignored. Unknown fields are ignored, as OpenAI-compatible servers
do, because SDKs add new optional fields faster than servers learn them.

Extensions, all optional: `top_k`, `genes` (actord's LoRA genes) in the body, and
`usage.prompt_tokens_details.cached_tokens` in the answer (OpenAI's own field for prompt
tokens served from cache).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec

from actord.api import CompletionResult, GeneRef
from actord.chat import ChatMessage
from actord.errors import ActordError, InvalidParams, PromptTooLong


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True, frozen=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    genes: list[GeneRef] = []


class ChatCompletionRequest(_Common, kw_only=True, frozen=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None


class TextCompletionRequest(_Common, kw_only=True, frozen=True):
    prompt: str | list[int]
    echo: bool = False
    suffix: str | None = None


def refuse_unsupported(req: _Common) -> None:
    if req.n != 1:
        raise InvalidParams("only n=1 is supported", param="n")
    if req.logprobs:
        raise InvalidParams("logprobs are not supported", param="logprobs")
    if req.presence_penalty or req.frequency_penalty:
        raise InvalidParams("presence/frequency penalties are not supported", param="presence_penalty")
    if isinstance(req, ChatCompletionRequest) and req.tools:
        raise InvalidParams("tools are not supported", param="tools")
    if isinstance(req, TextCompletionRequest) and (req.echo or req.suffix):
        raise InvalidParams("echo and suffix are not supported", param="echo")
    if req.max_tokens is not None and req.max_tokens < 0:
        raise InvalidParams("max_tokens must be >= 0", param="max_tokens")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise InvalidParams("temperature must be in [0, 2]", param="temperature")


def chat_messages(msgs: list[Message]) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(msgs):
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise InvalidParams(f"messages[{i}]: only text content parts are supported",
                                        param=f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content or ""
        if m.tool_calls:
            raise InvalidParams("tool calls are not supported", param=f"messages[{i}].tool_calls")
        out.append(ChatMessage(role=m.role, content=content))
    return out


def stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def finish_reason(stop_reason: str) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}.get(stop_reason, "stop")


def usage(r: CompletionResult) -> dict[str, Any]:
    n_out = len(r.tokens)
    return {
        "prompt_tokens": r.n_prompt_tokens,
        "completion_tokens": n_out,
        "total_tokens": r.n_prompt_tokens + n_out,
        "prompt_tokens_details": {"cached_tokens": r.n_cached},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def chat_completion(rid: str, model: str, r: CompletionResult, created: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": r.content},
            "finish_reason": finish_reason(r.stop_reason), "logprobs": None,
        }],
        "usage": usage(r),
    }


def text_completion(rid: str, model: str, r: CompletionResult, created: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": r.content, "finish_reason": finish_reason(r.stop_reason), "logprobs": None}],
        "usage": usage(r),
    }


class Chunks:
    """Builds the SSE `data:` payloads of one streamed answer, in OpenAI's chunk format."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice] if choice is not None else [], **extra}

    def first(self) -> dict[str, Any] | None:
        if not self.chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def delta(self, text: str) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"index": 0, "delta": {"content": text}, "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "finish_reason": None})

    def last(self, r: CompletionResult) -> dict[str, Any]:
        reason = finish_reason(r.stop_reason)
        if self.chat:
            return self._chunk({"index": 0, "delta": {}, "finish_reason": reason})
        return self._chunk({"index": 0, "text": "", "finish_reason": reason})

    def usage(self, r: CompletionResult) -> dict[str, Any]:
        return self._chunk(None, usage=usage(r))


# -- errors ----------------------------------------------------------------------------

_OVERLOADED = {"NoFreeSlot", "PageRamExceeded", "DeviceBudgetExceeded", "ShuttingDown"}


def error_status(e: ActordError) -> int:
    if isinstance(e, PromptTooLong):
        return 413
    if e.type in _OVERLOADED:
        return 503
    return e.http_status if 400 <= e.http_status < 600 else 500


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "invalid_request_error", 503: "overloaded_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
