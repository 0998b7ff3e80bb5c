"""Anthropic's Messages API shapes: the request Structs, their translation to actord's chat
(actord.chat.messages), the answer body and the error object.

Pure data and pure functions, no I/O, so the translation is tested without a server. A
request decodes with msgspec at the edge: a wrong type, a missing `messages`, or a content
block of a type Anthropic does not define is a 400 naming its JSON path.

Every field is honoured, refused, or ignored by design:
- honoured: `model` (any name, echoed), `messages` (text, `tool_use`, `tool_result`,
  `thinking` blocks), `system` (a string or text blocks, joined with "\\n"), `max_tokens`
  (optional, as llama-server has it: the daemon's --http-default-max-tokens), `stop_sequences`,
  `temperature` (Anthropic's [0, 1]), `top_p`, `top_k`, `stream`, `tools` (custom tools),
  `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), `thinking` (enabled:
  the template's `enable_thinking` on; disabled: off), `metadata.user_id` (names the mind,
  as OpenAI's `user` does), `output_config.format` (a JSON schema: grammar-constrained
  decoding, as `response_format` on the chat route), llama-server's `chat_template_kwargs`;
- answered in a lesser form, each named in the `X-Actord-Degraded` header
  (actord/frontends/http/degraded.py): server tools (web search, code execution, ...: no
  local server runs them) dropped, a tool schema the grammar cannot hold relaxed, `system`
  messages inside `messages` (Claude Code's mid-conversation system beta) kept where they
  are, or merged into the leading one where the template refuses them;
- refused with a 400 naming the field, because ignoring it would change the answer without
  saying so: image and document blocks (this server serves text models), `mcp_servers`,
  `container`, a `thinking.budget_tokens` that is not a count;
- ignored by design: `cache_control` on any block or tool (actord caches every prompt's
  prefix by itself, in the slot or the mind's page), `redacted_thinking` blocks (opaque
  outside Anthropic), a tool result's `is_error` (llama-server's reading: the result's text
  says it), `output_config.effort`, `speed`, `inference_geo` and `service_tier` (how much
  of Anthropic's compute to spend: one local model has one way to answer), top-level
  `cache_control`, unknown fields.

Choices, stated:
- `thinking.budget_tokens` (enabled) is the turn's reasoning budget (llama-server's mapping):
  a thought that reaches it is closed by force and the reply goes on as text
  (actord.chat.reasoning); absent, the daemon's --reasoning-budget holds.
- A user message's `tool_result` blocks become tool messages placed before its text (which
  follows as a user message): results answer the assistant turn just before them, and
  Anthropic requires them first in the message anyway.
- Claude Code's `x-anthropic-billing-header` system line carries a stamp (`cch=...`) that
  changes on every request; it is made constant, as llama-server does, so the prompt's
  prefix (and the mind's cache) survives from one request to the next.
- `stop_reason`: `end_turn` (the model ended), `stop_sequence` (one of `stop_sequences`,
  named in `stop_sequence`), `max_tokens` (the budget or the context ran out), `tool_use`.
- usage: `input_tokens` is the prompt's tokens the model processed, `cache_read_input_tokens`
  those served from the slot's or the mind's cache (Anthropic's split, as llama-server
  gives it), `cache_creation_input_tokens` 0 (nothing is written on a client's say).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Mapping

import msgspec

from actord.chat.defaults import asked
from actord.chat.messages import ChatMessage, Tool, ToolCall
from actord.frontends.http.degraded import Degraded
from actord.frontends.http.turns import Turn, TurnContext, mind_of
from actord.vocabulary.errors import ActordError, InvalidParams, PromptTooLong


class Text(msgspec.Struct, tag="text", tag_field="type", frozen=True):
    text: str
    cache_control: Any = None
    citations: Any = None


class Image(msgspec.Struct, tag="image", tag_field="type", frozen=True):
    source: Any = None
    cache_control: Any = None


class Document(msgspec.Struct, tag="document", tag_field="type", frozen=True):
    source: Any = None
    cache_control: Any = None


class ToolUse(msgspec.Struct, tag="tool_use", tag_field="type", frozen=True):
    id: str
    name: str
    input: Any = None
    cache_control: Any = None


class ToolResult(msgspec.Struct, tag="tool_result", tag_field="type", frozen=True):
    tool_use_id: str
    content: str | list[Text | Image | Document] = ""
    is_error: bool = False
    cache_control: Any = None


class Thinking(msgspec.Struct, tag="thinking", tag_field="type", frozen=True):
    thinking: str
    signature: str = ""


class RedactedThinking(msgspec.Struct, tag="redacted_thinking", tag_field="type", frozen=True):
    data: str = ""


Block = Text | Image | Document | ToolUse | ToolResult | Thinking | RedactedThinking


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[Block]


class ToolDef(msgspec.Struct, frozen=True):
    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" (or absent); anything else is a server tool
    cache_control: Any = None


class ToolChoice(msgspec.Struct, frozen=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(msgspec.Struct, frozen=True):
    type: str
    budget_tokens: Any = None


class Metadata(msgspec.Struct, frozen=True):
    user_id: str | None = None


class OutputConfig(msgspec.Struct, frozen=True):
    format: Any = None
    effort: Any = None


class MessagesRequest(msgspec.Struct, kw_only=True, frozen=True):
    """POST /v1/messages's body (and /v1/messages/count_tokens's: it reads the prompt's part)."""

    messages: list[Message]
    model: str | None = None
    max_tokens: int | None = None
    system: str | list[Text] | None = None
    cache_salt: str | None = None  # an extension (vLLM's field): reuse of cells only within one salt
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # llama-server's: more template variables
    ignore_eos: bool = False  # llama-server's: generate max_tokens whatever the model's end token says
    # Refused unless absent (see the module docstring).
    mcp_servers: Any = None
    container: Any = None


def _refuse(field: str, why: str) -> InvalidParams:
    return InvalidParams(f"unsupported parameter '{field}': {why}", param=field)


def check(req: MessagesRequest) -> None:
    """A 400 naming the first field this front cannot honour, or out of Anthropic's range."""
    for name in ("mcp_servers", "container"):
        if getattr(req, name) not in (None, []):
            raise _refuse(name, "not supported by this server")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise InvalidParams(f"max_tokens must be >= 1, got {req.max_tokens}", param="max_tokens")
    if req.temperature is not None and not 0 <= req.temperature <= 1:
        raise InvalidParams("temperature must be in [0, 1]", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise InvalidParams("top_p must be in (0, 1]", param="top_p")
    if req.top_k is not None and req.top_k < 0:
        raise InvalidParams("top_k must be >= 0", param="top_k")
    if req.stop_sequences is not None and any(not s for s in req.stop_sequences):
        raise InvalidParams("a stop sequence is empty", param="stop_sequences")
    if not req.messages:
        raise InvalidParams("messages: at least one message is required", param="messages")


_BILLING = re.compile(r"^(x-anthropic-billing-header:[^\n]*?\bcch=)[0-9A-Za-z]+;")


def system_text(system: str | list[Text] | None) -> str | None:
    """The system prompt as one text (blocks joined with "\\n"), its billing stamp constant."""
    if system is None:
        return None
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return _BILLING.sub(r"\g<1>00000;", text)


def _unsupported(block: Any, param: str) -> InvalidParams:
    kind = "image" if isinstance(block, Image) else "document"
    return InvalidParams(f"{param}: {kind} input is not supported: this server serves a text model", param=param)


def _result_text(r: ToolResult, param: str) -> str:
    if isinstance(r.content, str):
        return r.content
    texts = []
    for k, part in enumerate(r.content):
        if not isinstance(part, Text):
            raise _unsupported(part, f"{param}.content[{k}]")
        texts.append(part.text)
    return "\n".join(texts)


def chat_messages(req: MessagesRequest) -> list[ChatMessage]:
    """The conversation as actord's chat messages (see the module docstring)."""
    out: list[ChatMessage] = []
    system = system_text(req.system)
    if system is not None:
        out.append(ChatMessage(role="system", content=system))
    for i, m in enumerate(req.messages):
        p = f"messages[{i}]"
        if m.role not in ("user", "assistant", "system"):
            raise InvalidParams(f"{p}.role must be user, assistant or system", param=f"{p}.role")
        if m.role == "system":  # mid-conversation system text (Claude Code's beta): text only
            if isinstance(m.content, str):
                out.append(ChatMessage(role="system", content=m.content))
                continue
            for j, b in enumerate(m.content):
                if not isinstance(b, Text):
                    raise InvalidParams(f"{p}.content[{j}]: a system message holds text blocks",
                                        param=f"{p}.content[{j}].type")
            out.append(ChatMessage(role="system", content="\n".join(b.text for b in m.content)))  # type: ignore[union-attr]
            continue
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        texts: list[str] = []
        thought: list[str] = []
        calls: list[ToolCall] = []
        results: list[ChatMessage] = []
        for j, b in enumerate(m.content):
            q = f"{p}.content[{j}]"
            if isinstance(b, Text):
                texts.append(b.text)
            elif isinstance(b, Thinking):
                thought.append(b.thinking)
            elif isinstance(b, ToolUse):
                if m.role != "assistant":
                    raise InvalidParams(f"{q}: tool_use blocks are the assistant's", param=f"{q}.type")
                args = b.input if b.input is not None else {}
                if not isinstance(args, dict):
                    raise InvalidParams(f"{q}.input is the call's arguments, an object", param=f"{q}.input")
                calls.append(ToolCall(id=b.id, name=b.name, arguments=json.dumps(args, ensure_ascii=False)))
            elif isinstance(b, ToolResult):
                if m.role != "user":
                    raise InvalidParams(f"{q}: tool_result blocks are the user's", param=f"{q}.type")
                results.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=_result_text(b, q)))
            elif isinstance(b, (Image, Document)):
                raise _unsupported(b, q)
            # RedactedThinking: opaque outside Anthropic, dropped
        out.extend(results)
        text = "\n".join(texts)
        if m.role == "assistant":
            if text or calls or thought:
                out.append(ChatMessage(role="assistant", content=text, tool_calls=calls or None,
                                       reasoning_content="".join(thought) if thought else None))
        elif text or not results:
            out.append(ChatMessage(role="user", content=text))
    return out


def to_turn(req: MessagesRequest, headers: Mapping[str, str], context: TurnContext) -> Turn:
    """A Messages request as one chat turn (actord/frontends/http/turns.py): every field read
    and checked as the module docstring says, a 400 naming the first that is wrong; what it
    leaves unsaid (`max_tokens`, optional here as in llama-server, and the sampling) is the
    chat layer's defaults. The mind: the `X-Actord-Mind` header (or a session header the
    operator named), else `metadata.user_id` through a digest."""
    check(req)
    degraded = Degraded()
    tool_fields = chat_tools(req, degraded)
    mind, label = mind_of(headers, context, None, req.metadata.user_id if req.metadata else None)
    chat = asked(context.defaults, messages=chat_messages(req), max_tokens=req.max_tokens,
                 temperature=req.temperature, top_p=req.top_p, top_k=req.top_k or 0, mind=mind,
                 stop=list(req.stop_sequences or []), stream=req.stream, template_kwargs=thinking_kwargs(req),
                 reasoning_budget=thinking_budget(req), grammar=output_grammar(req, degraded),
                 ignore_eos=req.ignore_eos, cache_salt=req.cache_salt, **tool_fields)
    return Turn(chat, degraded, label=label)


def chat_tools(req: MessagesRequest, degraded: Any = None) -> dict[str, Any]:
    """The ChatRequest's tool fields (actord.chat.tools) from `tools` and `tool_choice`;
    with `degraded` (frontends/http/degraded.py), server tools are dropped and schemas the
    grammar cannot hold relaxed, each noted there (without it, both are refused)."""
    from actord.chat import tools as T
    from actord.frontends.http.degraded import relax_tool

    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            if degraded is None:
                raise InvalidParams(f"tools[{i}].type: server tools ({t.type[:40]!r}) are not supported; "
                                    "only custom tools", param=f"tools[{i}].type")
            degraded.add(f"tools[{i}]: server tool {t.type[:40]!r} ({t.name[:40]}) dropped: this server runs none")
            continue
        tool = Tool(name=t.name, description=t.description, parameters=t.input_schema)
        tools.append(tool if degraded is None else relax_tool(tool, f"tools[{i}]", degraded))
    tc = req.tool_choice
    choice: Any = "auto"
    if tc is not None:
        if tc.type == "tool":
            if not tc.name:
                raise InvalidParams("tool_choice of type tool names the tool", param="tool_choice.name")
            choice = {"type": "function", "function": {"name": tc.name}}
        elif tc.type in ("auto", "any", "none"):
            choice = {"any": "required"}.get(tc.type, tc.type)
        else:
            raise InvalidParams(f"tool_choice.type is auto, any, tool or none, not {tc.type[:40]!r}",
                                param="tool_choice.type")
        if choice != "auto" and choice != "none" and not tools:
            raise InvalidParams("tool_choice asks for a tool, but there are no tools", param="tool_choice")
    T.check_tools(tools, choice)
    return {"tools": tools, "tool_choice": choice,
            "parallel_tool_calls": not (tc is not None and tc.disable_parallel_tool_use)}


def output_grammar(req: MessagesRequest, degraded: Any = None) -> str:
    """`output_config.format` (structured outputs) as GBNF, "" for free text; a schema the
    converter cannot take, once relaxed (noted in `degraded`), is a 400 naming the field (as
    response_format on the chat route)."""
    from actord.engine.grammar import JSON_OBJECT_GBNF, schema_grammar
    from actord.frontends.http.degraded import relax_schema

    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return ""
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidParams("output_config.format is {\"type\": \"json_schema\", \"schema\": {...}}",
                            param="output_config.format")
    schema = fmt.get("schema")
    if schema is not None and degraded is not None:
        schema = relax_schema(schema, "output_config.format.schema", degraded)
    return JSON_OBJECT_GBNF if schema is None else schema_grammar(schema, "output_config.format")


def thinking_kwargs(req: MessagesRequest) -> dict[str, Any]:
    """The template variables: llama-server's `chat_template_kwargs`, then `thinking`'s
    `enable_thinking` (enabled or disabled; absent: the daemon's --reasoning)."""
    kwargs = dict(req.chat_template_kwargs or {})
    t = req.thinking
    if t is None or t.type == "adaptive":
        return kwargs
    if t.type not in ("enabled", "disabled"):
        raise InvalidParams(f"thinking.type is enabled, disabled or adaptive, not {t.type[:40]!r}",
                            param="thinking.type")
    b = t.budget_tokens
    if t.type == "enabled" and b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
        raise InvalidParams("thinking.budget_tokens is a count of tokens", param="thinking.budget_tokens")
    return {**kwargs, "enable_thinking": t.type == "enabled"}


def thinking_budget(req: MessagesRequest) -> int | None:
    """The turn's reasoning budget: `thinking.budget_tokens` when thinking is enabled with one
    (checked by `thinking_kwargs`), else None (the daemon's)."""
    t = req.thinking
    return t.budget_tokens or None if t is not None and t.type == "enabled" else None


# -- the answer -------------------------------------------------------------------------


def new_id(prefix: str = "msg") -> str:
    """An id in Anthropic's form: `msg_` and 24 letters or digits."""
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(c: Any, n_prompt: int | None = None, n_cached: int | None = None) -> dict[str, int]:
    """A completion's usage (see the module docstring); before its result, the prompt's
    counts as placed (TokenChunk's n_prompt and n_cached) and no output yet."""
    if c is not None:
        n_prompt, n_cached, n_out = c.n_prompt_tokens, c.n_cached, len(c.tokens)
    else:
        n_out = 0
    n_prompt, n_cached = n_prompt or 0, n_cached or 0
    return {"input_tokens": n_prompt - n_cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": n_cached, "output_tokens": n_out}


def stop_reason(c: Any, calls: bool, word: str) -> str:
    if c.stop_reason in ("length", "context"):
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if word else "end_turn"


def tool_input(arguments: str) -> Any:
    """A call's arguments as the object Anthropic's `input` is ({} when they are not one)."""
    try:
        v = json.loads(arguments)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def content_blocks(msg: ChatMessage) -> list[dict[str, Any]]:
    """A whole reply's blocks: its thought, its text, its calls (one text block, empty, when
    it has none of them, so `content[0]` is always there)."""
    blocks: list[dict[str, Any]] = []
    if msg.reasoning_content:
        blocks.append({"type": "thinking", "thinking": msg.reasoning_content, "signature": ""})
    if msg.content or not (msg.tool_calls or blocks):
        blocks.append({"type": "text", "text": msg.content})
    for c in msg.tool_calls or []:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)})
    return blocks


def from_result(rid: str, model: str, result: Any, word: str) -> dict[str, Any]:
    """The whole answer: a turn's ChatResult as Anthropic's `message` (`word`: the stop
    sequence that ended it, "" for none)."""
    c, msg = result.completion, result.message
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content_blocks(msg),
            "stop_reason": stop_reason(c, bool(msg.tool_calls), word), "stop_sequence": word or None,
            "usage": usage(c)}


# -- errors -----------------------------------------------------------------------------


def error_type(status: int) -> str:
    """Anthropic's error type for a status (its SDKs branch on the status, people on this)."""
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            503: "overloaded_error", 529: "overloaded_error"}.get(
        status, "api_error" if status >= 500 else "invalid_request_error")


def error_message(e: Any, message: str) -> str:
    """`message`, or for a prompt over the context Anthropic's words first ("prompt is too
    long: N tokens > M maximum", which agents match on to compact their history)."""
    if isinstance(e, PromptTooLong) and "n_prompt_tokens" in e.data and "n_ctx" in e.data:
        return f"prompt is too long: {e.data['n_prompt_tokens']} tokens > {e.data['n_ctx']} maximum ({e.message})"
    if isinstance(e, PromptTooLong):
        return f"prompt is too long: {e.message}"
    return e.message if isinstance(e, ActordError) else message


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}
