"""The chat verb's shapes: a message, a tool and a call, the request and its result.

Why a module of their own: every part of a chat turn and every front reads them (the
template renders messages, the prompter keys its memory on them, tool planning reads
their calls, the socket and the HTTP fronts decode requests into them, the cluster ships
them between nodes), so they sit below all of those and import none of them. They are
actord's own shapes: the OpenAI wire forms of tools and calls are converted at the HTTP
front (actord/frontends/http/openai/tools_wire.py), not here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.vocabulary.types import CompletionResult, GeneRef, SamplingFields
from actord.vocabulary.errors import InvalidParams



# Reasoning (actord.chat.reasoning): the modes and formats a request may name.
REASONING_MODES = ("on", "off", "auto")
REASONING_FORMATS = ("none", "deepseek", "auto")


def check_reasoning(mode: str = "auto", fmt: str = "auto", budget: int | None = None) -> None:
    """A 400 naming the first field out of its range."""
    if mode not in REASONING_MODES:
        raise InvalidParams(f"reasoning is one of {', '.join(REASONING_MODES)}", param="reasoning")
    if fmt not in REASONING_FORMATS:
        raise InvalidParams(f"reasoning_format is one of {', '.join(REASONING_FORMATS)}", param="reasoning_format")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or not -1 <= budget < 2**31):
        raise InvalidParams("reasoning_budget is -1 (no limit), 0 (thinking off) or a number of tokens",
                            param="reasoning_budget")


class Tool(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One function the model may call (OpenAI's `tools[].function`)."""

    name: str
    description: str = ""
    parameters: dict | None = None


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One call the model made: `arguments` is the JSON text of an object (OpenAI's)."""

    id: str
    name: str
    arguments: str = "{}"


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, weakref=True):
    # weakref: the prompter's conversation keys remember a message object without keeping it.
    role: str
    content: str = ""
    # Tool calling (actord.chat.tools): an assistant turn's calls, a `tool` result's call id,
    # and a message's name (a tool result's function, where the template reads it).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # An assistant turn's thought (actord.chat.reasoning), apart from its content; templates
    # that keep past thoughts (Qwen3's) read it.
    reasoning_content: str | None = None


class ChatRequest(SamplingFields, kw_only=True, frozen=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    n_predict: int = 256
    slot: int | None = None
    mind: str | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stream: bool = False
    genes: list[GeneRef] = []
    template: str | None = None  # Jinja2 source; default: the model's tokenizer.chat_template
    add_generation_prompt: bool = True
    # Tool calling (actord.chat.tools): the functions offered, auto | none | required | a named
    # function ({"type": "function", "function": {"name": ...}}), and the output format
    # ("" = the daemon's --tool-format, which by default reads it from the template).
    tools: list[Tool] = []
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    tool_format: str = ""
    # Reasoning (actord.chat.reasoning): more template variables (llama-server's
    # `chat_template_kwargs`, `enable_thinking` among them), how the thought is parsed out
    # ("" = the daemon's --reasoning-format), the thinking budget and the text forced before
    # the end marker when it cuts a thought (None = the daemon's).
    template_kwargs: dict[str, Any] = {}
    reasoning_format: str = ""
    reasoning_budget: int | None = None
    reasoning_budget_message: str | None = None
    # A last assistant message is continued, not closed (llama-server's prefill); refused
    # with add_generation_prompt, which would open a new reply after it.
    continue_final_message: bool = False
    # Streamed only (llama-server's): prompt progress chunks, and timings on every chunk
    # (actord/serving/stream_extras.py).
    return_progress: bool = False
    timings_per_token: bool = False
    # llama-server's: the model's end-of-generation tokens do not end the reply, n_predict does
    # (what benchmarks with fixed output lengths send).
    ignore_eos: bool = False

    def check(self) -> "ChatRequest":
        if not self.messages:
            raise InvalidParams("messages is empty")
        for i, m in enumerate(self.messages):
            if not m.role:
                raise InvalidParams(f"messages[{i}].role is empty", index=i)
        if self.template is not None and not self.template.strip():
            raise InvalidParams("template is empty")
        self.check_scope()
        check_reasoning(fmt=self.reasoning_format or "auto", budget=self.reasoning_budget)
        last = self.messages[-2:]
        if (len(last) == 2 and last[0].role == last[1].role == "assistant" and not last[1].tool_calls
                and (self.add_generation_prompt or self.continue_final_message)):
            # The last would be continued (a prefill), after another reply: llama-server's refusal.
            raise InvalidParams("cannot have 2 or more assistant messages at the end of the list", param="messages")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidParams("continue_final_message continues the last message, add_generation_prompt opens "
                                    "a new one: send one", param="continue_final_message")
            if self.messages[-1].role != "assistant":
                raise InvalidParams("continue_final_message needs an assistant message last",
                                    param="continue_final_message")
        return self


class ChatResult(msgspec.Struct, frozen=True):
    message: ChatMessage  # the reply, as the next turn should send it back
    completion: CompletionResult  # usage: n_prompt_tokens, n_cached, n_prompt_processed, ...
    reused_turn: bool  # the prompt began with the exact tokens of a turn this daemon served


def as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as a template without tool support gets them (role and content)."""
    return [{"role": m.role, "content": m.content} if m.reasoning_content is None else
            {"role": m.role, "content": m.content, "reasoning_content": m.reasoning_content} for m in messages]


def has_tools(messages: list[ChatMessage]) -> bool:
    """Whether a conversation holds tool calls or results (it then renders through actord.chat.tools)."""
    return any(m.tool_calls or m.role == "tool" for m in messages)
