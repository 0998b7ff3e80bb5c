"""The OpenAI wire shapes: request Structs, response builders, the error object.

Pure data and pure functions, no I/O, so the shapes can be tested without a server. Requests
decode with msgspec at the edge (a wrong type names its JSON path in the 400's message).

Every field falls in one of three kinds, and `refuse_unsupported` is where the line is drawn:
honoured (`model` as any name, `messages`, `prompt`, `max_tokens`/`max_completion_tokens`,
`temperature`, `top_p`, `seed`, `stop`, `stream`, `stream_options.include_usage`, `user`,
`prompt_cache_key`, `n: 1`, `response_format: {"type": "text"}`); refused with a 400 whose
`param` names the field, because ignoring it would change what the caller gets without
saying so (`n` > 1, `logprobs`, `top_logprobs`, penalties, `logit_bias`, `response_format`
other than text, `tools`, `tool_choice`, `functions`, `function_call`, audio output,
`reasoning_effort`, `verbosity`, `web_search_options`, `echo`, `suffix`, `best_of` > 1,
several prompts, and llama-server's `grammar`, `json_schema`, `min_p`, `repeat_penalty`,
`n_probs`); and ignored by design, because they change nothing in the answer (`store`,
`metadata`, `service_tier`, `safety_identifier`, `prediction`, `parallel_tool_calls` without
tools, a message's `name`), plus unknown fields, as OpenAI-compatible servers do, because
SDKs add optional fields faster than servers learn them.

Choices made here, stated:
- `max_tokens: 0` is refused (400 naming it), as OpenAI does, rather than answered empty:
  a caller asking for nothing has a bug, and an empty 200 would hide it.
- Text content parts join with "\\n", as llama-server does for templates that take string
  content (OpenAI does not document it; it is what the model sees either way).
- `developer` (OpenAI's newer name for `system`) reaches the template as `system` unless
  the template itself names the developer role: templates written before it (Gemma 3's)
  refuse or drop an unknown role.
- `user` and `prompt_cache_key` are free-form (OpenAI's end-user id and cache-routing key)
  and name a mind through a digest (`mind_for`): any string maps to the same valid,
  confined mind name every time, and two different strings never share one.

Extensions, all optional: `top_k`, `genes` (actord's LoRA genes) in the body, and
`usage.prompt_tokens_details.cached_tokens` in the answer (OpenAI's own field for prompt
tokens served from cache).
"""

from __future__ import annotations

import hashlib
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
    name: str | None = None  # ignored by design: few templates read it, and none needs it
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
    prompt_cache_key: str | None = None
    genes: list[GeneRef] = []
    # Refused unless they ask for nothing: typed Any so that the 400 names the field
    # whatever its value, rather than a type error at decode.
    n: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    response_format: Any = None
    grammar: Any = None
    json_schema: Any = None
    min_p: Any = None
    repeat_penalty: Any = None
    n_probs: Any = None


class ChatCompletionRequest(_Common, kw_only=True, frozen=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class TextCompletionRequest(_Common, kw_only=True, frozen=True):
    prompt: str | list[Any]
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


def _refuse(field: str, why: str) -> InvalidParams:
    return InvalidParams(f"unsupported parameter '{field}': {why}", param=field)


def _zero(v: Any) -> bool:
    return v is None or v is False or v == 0


def refuse_unsupported(req: _Common) -> None:
    """A 400 naming the first field this front cannot honour (see the module docstring)."""
    if req.n not in (None, 1):
        raise _refuse("n", "only n=1 is supported (one choice per request)")
    if not _zero(req.logprobs):
        raise _refuse("logprobs", "log probabilities are not supported")
    if not _zero(req.top_logprobs):
        raise _refuse("top_logprobs", "log probabilities are not supported")
    for name in ("presence_penalty", "frequency_penalty", "min_p", "n_probs"):
        if not _zero(getattr(req, name)):
            raise _refuse(name, "this sampler is not supported")
    if req.repeat_penalty not in (None, 1, 1.0):
        raise _refuse("repeat_penalty", "this sampler is not supported")
    if req.logit_bias not in (None, {}):
        raise _refuse("logit_bias", "logit biases are not supported")
    if req.response_format is not None and req.response_format != {"type": "text"}:
        raise _refuse("response_format", 'only {"type": "text"} is supported (no constrained decoding)')
    for name in ("grammar", "json_schema"):
        if getattr(req, name) not in (None, ""):
            raise _refuse(name, "constrained decoding is not supported")
    if isinstance(req, ChatCompletionRequest):
        if req.tools:
            raise _refuse("tools", "tool calling is not supported")
        if req.tool_choice is not None:
            raise _refuse("tool_choice", "tool calling is not supported (and there are no tools)")
        for name in ("functions", "function_call"):
            if getattr(req, name) is not None:
                raise _refuse(name, "function calling is not supported")
        if req.modalities not in (None, ["text"]) or req.audio is not None:
            raise _refuse("audio" if req.audio is not None else "modalities", "only text output is supported")
        for name in ("reasoning_effort", "verbosity", "web_search_options"):
            if getattr(req, name) is not None:
                raise _refuse(name, "not supported by this server")
        for name in ("max_tokens", "max_completion_tokens"):
            _check_max(name, getattr(req, name))
    if isinstance(req, TextCompletionRequest):
        if not _zero(req.echo):
            raise _refuse("echo", "echoing the prompt is not supported")
        if req.suffix not in (None, ""):
            raise _refuse("suffix", "insertion (a suffix) is not supported")
        if req.best_of not in (None, 1):
            raise _refuse("best_of", "only best_of=1 is supported")
        _check_max("max_tokens", req.max_tokens)
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise InvalidParams("temperature must be in [0, 2]", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise InvalidParams("top_p must be in (0, 1]", param="top_p")


def _check_max(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        # OpenAI refuses 0 too ("integer below minimum value"): a caller asking for no
        # tokens at all has a bug, and an empty answer would hide it.
        raise InvalidParams(f"{name} must be >= 1, got {v}", param=name)


def text_prompt(prompt: str | list[Any]) -> str | list[int]:
    """One prompt: a string or a token list; a list holding exactly one of those (which
    langchain always sends) is that prompt. Several prompts would be several choices."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if len(prompt) == 1 and (isinstance(prompt[0], str) or (
            isinstance(prompt[0], list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt[0]))):
        return prompt[0]
    if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise _refuse("prompt", f"a list of {len(prompt)} prompts is not supported: send one prompt per request")
    raise InvalidParams("prompt must be a string, a list of token ids, or a list holding one of those",
                        param="prompt")


def chat_messages(msgs: list[Message], *, developer_is_system: bool = True) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(msgs):
        if m.role in ("tool", "function"):
            raise _refuse(f"messages[{i}].role", f"{m.role!r} messages need tool calling, which is not supported")
        if m.tool_calls:
            raise _refuse(f"messages[{i}].tool_calls", "tool calls are not supported")
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise InvalidParams(f"messages[{i}].content[{j}]: only text content parts are supported",
                                        param=f"messages[{i}].content[{j}].type")
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" and developer_is_system else m.role
        out.append(ChatMessage(role=role, content=content))
    return out


def mind_for(kind: str, value: str) -> str:
    """A mind name for a free-form `user` ("u") or `prompt_cache_key` ("k"): stable across
    requests and restarts (no secret, so spilled pages keep their names), one page-name
    component whatever the input, and 128 bits of digest, so distinct values never meet."""
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16, person=b"actord-" + kind.encode())
    return f"{kind}-{digest.hexdigest()}"


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


def chat_completion(rid: str, model: str, r: CompletionResult, created: int, fingerprint: str) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": r.content},
            "finish_reason": finish_reason(r.stop_reason), "logprobs": None,
        }],
        "usage": usage(r),
    }


def text_completion(rid: str, model: str, r: CompletionResult, created: int, fingerprint: str) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "text": r.content, "finish_reason": finish_reason(r.stop_reason), "logprobs": None}],
        "usage": usage(r),
    }


class Chunks:
    """Builds the SSE `data:` payloads of one streamed answer, in OpenAI's chunk format."""

    def __init__(self, chat: bool, model: str, fingerprint: str = "") -> None:
        self.chat = chat
        self.model = model
        self.fingerprint = fingerprint
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [choice] if choice is not None else [], **extra}

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

_OVERLOADED = {"NoFreeSlot", "PageRamExceeded", "DeviceBudgetExceeded", "ShuttingDown", "Overloaded", "ContextFull"}


def error_status(e: ActordError) -> int:
    if isinstance(e, PromptTooLong):
        return 400  # OpenAI's status for a prompt over the context (code context_length_exceeded)
    if e.type in _OVERLOADED:
        return 503
    return e.http_status if 400 <= e.http_status < 600 else 500


def error_code(e: ActordError) -> str:
    """The `code` SDKs branch on: OpenAI's own where one exists, else actord's error type."""
    if isinstance(e, PromptTooLong):
        return "context_length_exceeded"
    return {"ModelNotFound": "model_not_found"}.get(e.type, e.type)


def error_message(e: ActordError) -> str:
    if isinstance(e, PromptTooLong) and "n_ctx" in e.data and "n_prompt_tokens" in e.data:
        # The phrase litellm and langchain match on, then actord's own words.
        return (f"This model's maximum context length is {e.data['n_ctx']} tokens. However, your prompt "
                f"resulted in {e.data['n_prompt_tokens']} tokens ({e.message}).")
    if isinstance(e, PromptTooLong):
        return f"This model's maximum context length is exceeded: {e.message}."
    return e.message


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 408: "invalid_request_error", 413: "invalid_request_error",
            429: "rate_limit_error", 431: "invalid_request_error", 503: "overloaded_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
