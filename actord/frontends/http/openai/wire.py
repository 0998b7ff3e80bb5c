"""The OpenAI wire shapes: request Structs, response builders, the error object.

Pure data and pure functions, no I/O, so the shapes can be tested without a server. Requests
decode with msgspec at the edge (a wrong type names its JSON path in the 400's message).

Every field falls in one of three kinds, and `refuse_unsupported` is where the line is drawn:
honoured (`model` as any name, `messages` (tool calls and results included), `tools`,
`tool_choice`, `parallel_tool_calls`, legacy `functions`/`function_call` (actord.chat.tools),
`prompt` (one, or a list: each its own request in one answer), `max_tokens`/`max_completion_tokens`,
`temperature`, `top_p`, `seed`, `stop`, `stream`, `stream_options.include_usage`, `user`,
`prompt_cache_key`, `n` (1 to `--max-n` choices from one prefill: actord/chat/choices.py), `response_format` text/json_object/json_schema (grammar-
constrained decoding; llama-server's `schema` inside a json_object applied too), llama-server's
`chat_template_kwargs`, `reasoning_format`, `reasoning_budget` (or `reasoning_budget_tokens`) and
`reasoning_budget_message` (actord.chat.reasoning),
`add_generation_prompt` and `continue_final_message` (a last assistant message continued), `logit_bias`, `presence_penalty`, `frequency_penalty`, `logprobs`
and `top_logprobs`, and llama-server's `grammar`, `json_schema`, `repeat_penalty`,
`repeat_last_n`, `min_p`; all mapped by `sampling`; llama-server's streamed extras
`return_progress` (chunks with `prompt_progress` while the prompt is decoded) and
`timings_per_token` (each chunk with its `timings`), and `ignore_eos`, extra fields OpenAI's clients ignore); refused with a 400 whose `param` names
the field, because ignoring it would change what the caller gets without saying so (`n`
over `--max-n`, audio output, `echo`, `suffix`,
`best_of` > 1, more prompts x `n` than `--max-n`, and llama-server's `n_probs`; bad tool
fields, `chat_tools`); answered in a lesser form and named in the `X-Actord-Degraded` header
(actord/frontends/http/degraded.py), as on the Responses API: hosted and custom tools
(`web_search`, ...: dropped), `web_search_options` (dropped), `reasoning_effort` and
`verbosity` (ignored), tool schemas the grammar cannot hold (relaxed), system
messages where the template refuses them (merged); and ignored by design, because they
change nothing in the answer (`store`, `metadata`, `service_tier`, `safety_identifier`,
`prediction`), plus unknown fields, as
OpenAI-compatible servers do, because SDKs add optional fields faster than servers learn
them.

Choices made here, stated:
- `max_tokens: 0` is refused (400 naming it), as OpenAI does, rather than answered empty:
  a caller asking for nothing has a bug, and an empty 200 would hide it.
- Text content parts join with "\\n", as llama-server does for templates that take string
  content (OpenAI does not document it; it is what the model sees either way).
- `developer` (OpenAI's newer name for `system`) reaches the template as `system` unless
  the template itself names the developer role (turns.py `roles_for`): templates written before it (Gemma 3's)
  refuse or drop an unknown role.
- `response_format` json_schema and json_object, and llama-server's `json_schema`, become a
  GBNF grammar through llama-cpp-python's own converter (actord.engine.grammar), applied
  first in the sampler chain: the output is JSON valid under the schema whenever the
  generation ends by itself (a `length` finish cuts it). A schema it cannot convert is a
  400 naming `response_format` (or `json_schema`) before anything runs. `strict` changes
  nothing: the grammar is always strict.
- `logprobs` are the model's: log-softmax of the step's raw logits, before biases,
  penalties, grammar or temperature (OpenAI's and vLLM's meaning), so under greedy decoding
  without biases the chosen token is the top-1. Legacy completions take `logprobs: N` as
  "and the N likeliest" (0 included), chat takes `logprobs: true` + `top_logprobs: N`.
- Penalties count the tokens this request generated (OpenAI's definition), not the prompt;
  llama-server's `repeat_last_n` bounds the window (default: all of them).
- `logit_bias` -100 bans the token (its logit becomes -inf, as OpenAI documents);
  other values in [-100, 100] are added to the logit.
- `user` and `prompt_cache_key` are free-form (OpenAI's end-user id and cache-routing key)
  and name a mind through a digest (`mind_for`): any string maps to the same valid,
  confined mind name every time, and two different strings never share one.

Extensions, all optional: `top_k`, `genes` (actord's LoRA genes) in the body, and
`usage.prompt_tokens_details.cached_tokens` in the answer (OpenAI's own field for prompt
tokens served from cache).
"""

from __future__ import annotations

from typing import Any, Mapping

import msgspec

from actord.vocabulary.types import GeneRef
from actord.chat.defaults import asked
from actord.chat.messages import ChatMessage
from actord.vocabulary.errors import ActordError, InvalidParams, PromptTooLong
from actord.frontends.http.degraded import Degraded
from actord.frontends.http.openai.tools_wire import calls_from_openai, functions_from_openai, tools_from_openai
from actord.frontends.http.openai.answers import chat_completion, new_id
from actord.frontends.http.turns import Turn, TurnContext, mind_of


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # passed to the template (a tool result's function name, where it reads it)
    tool_calls: Any = None
    tool_call_id: str | None = None
    function_call: Any = None  # legacy: an assistant message's one call
    reasoning_content: str | None = None  # an assistant turn's thought (given to the template)


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
    cache_salt: str | None = None  # vLLM's: reuse of cells only with requests of the same salt
    genes: list[GeneRef] = []
    # Typed Any so that a wrong value gets a 400 naming the field (`sampling`,
    # `refuse_unsupported`), rather than a type error at decode.
    repeat_last_n: Any = None
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
    verbose: bool | None = None  # llama-server's: the answer carries `__verbose` (default: --http-verbose)
    # llama-server's, streamed only: prompt progress chunks, timings on every chunk.
    return_progress: bool = False
    timings_per_token: bool = False
    ignore_eos: bool = False  # llama-server's: n_predict, not the end token, ends the output


class ChatCompletionRequest(_Common, kw_only=True, frozen=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    tool_format: str | None = None  # extension: hermes, mistral, llama3, generic (default: the daemon's)
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # llama-server's (actord.chat.reasoning): more template variables (`enable_thinking`),
    # how the thought is parsed out, the thinking budget; and a last assistant message
    # continued (prefill) rather than closed.
    chat_template_kwargs: Any = None
    reasoning_format: Any = None
    reasoning_budget: Any = None
    reasoning_budget_tokens: Any = None  # llama-server's name (-1: the daemon's budget)
    reasoning_budget_message: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None


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
    if not _zero(req.n_probs):
        raise _refuse("n_probs", "llama-server's n_probs is its native API's: use logprobs and top_logprobs")
    if isinstance(req, ChatCompletionRequest):
        if req.modalities not in (None, ["text"]) or req.audio is not None:
            raise _refuse("audio" if req.audio is not None else "modalities", "only text output is supported")
        for name, kind in (("reasoning_effort", str), ("verbosity", str), ("web_search_options", dict)):
            v = getattr(req, name)
            if v is not None and not isinstance(v, kind):
                raise InvalidParams(f"{name} is {'a string' if kind is str else 'an object'}", param=name)
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


MAX_TOP_LOGPROBS = 20


def choices(req: _Common, max_n: int) -> int:
    """How many choices `n` asks for: 1 to the daemon's `--max-n`, else a 400 naming `n`."""
    from actord.chat.choices import check_n

    return 1 if req.n is None else check_n(req.n, max_n)


def _number(req: _Common, name: str, lo: float, hi: float, default: float) -> float:
    v = getattr(req, name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise InvalidParams(f"{name} must be a number in [{lo:g}, {hi:g}]", param=name)
    return float(v)


def _count(name: str, v: Any, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise InvalidParams(f"{name} must be an integer in [0, {hi}]", param=name)
    return v


def _logit_bias(v: Any, n_vocab: int) -> dict[str, float]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise InvalidParams("logit_bias maps token ids (as strings) to biases in [-100, 100]", param="logit_bias")
    out: dict[str, float] = {}
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < n_vocab):
            raise InvalidParams(f"logit_bias key {key[:20]!r} is not a token id of this model (0..{n_vocab - 1})",
                                param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidParams(f"logit_bias[{key!r}] must be a number in [-100, 100]", param="logit_bias")
        out[str(int(key))] = float(bias)
    return out


def response_grammar(req: _Common) -> str:
    """The GBNF `response_format` (or llama-server's `grammar` / `json_schema`) asks for,
    "" for free text; a schema the converter cannot take is a 400 naming the field."""
    from actord.engine.grammar import JSON_OBJECT_GBNF, check_grammar, schema_grammar

    asked = [n for n in ("grammar", "json_schema") if getattr(req, n) not in (None, "")]
    rf = req.response_format
    if rf is not None and rf != {"type": "text"}:
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise InvalidParams(f"{asked[0]} and {asked[1]} both constrain the output: send one", param=asked[1])
    if not asked:
        return ""
    if asked[0] == "grammar":
        if not isinstance(req.grammar, str):
            raise InvalidParams("grammar is GBNF text", param="grammar")
        return check_grammar(req.grammar)
    if asked[0] == "json_schema":
        return schema_grammar(req.json_schema, "json_schema")
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":  # llama-server's extension: a `schema` inside it is applied
        schema = rf.get("schema")
        return JSON_OBJECT_GBNF if schema is None else schema_grammar(schema, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidParams("response_format.json_schema must be an object with a schema",
                                param="response_format")
        schema = spec.get("schema")
        # OpenAI's `schema` is optional: without one, any JSON object.
        return JSON_OBJECT_GBNF if schema is None else schema_grammar(schema, "response_format")
    raise _refuse("response_format", f"type {str(kind)[:40]!r} is not one of text, json_object, json_schema")


def sampling(req: _Common, n_vocab: int) -> dict[str, Any]:
    """The request's SamplingFields (actord.vocabulary.types) as keyword arguments: what the OpenAI
    fields ask for, checked with OpenAI's ranges (400 naming the field)."""
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs not in (None, True, False):
            raise InvalidParams("logprobs must be a boolean", param="logprobs")
        logprobs = bool(req.logprobs)
        top = 0 if req.top_logprobs is None else _count("top_logprobs", req.top_logprobs, MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise InvalidParams("top_logprobs needs logprobs: true", param="top_logprobs")
    else:  # legacy completions: logprobs is the number of alternatives (0 included)
        logprobs = req.logprobs is not None and req.logprobs is not False
        top = _count("logprobs", req.logprobs, MAX_TOP_LOGPROBS) if logprobs else 0
        if req.top_logprobs is not None:
            raise _refuse("top_logprobs", "completions take logprobs: N for N alternatives")
    last_n = req.repeat_last_n
    if last_n is not None and (isinstance(last_n, bool) or not isinstance(last_n, int) or last_n < -1):
        raise InvalidParams("repeat_last_n must be an integer >= -1 (-1: every generated token)",
                            param="repeat_last_n")
    return {
        "grammar": response_grammar(req),
        "logit_bias": _logit_bias(req.logit_bias, n_vocab),
        "presence_penalty": _number(req, "presence_penalty", -2, 2, 0.0),
        "frequency_penalty": _number(req, "frequency_penalty", -2, 2, 0.0),
        "repeat_penalty": _number(req, "repeat_penalty", 1e-6, 1e6, 1.0),
        "repeat_last_n": -1 if last_n is None else last_n,
        "min_p": _number(req, "min_p", 0, 1, 0.0),
        "logprobs": logprobs,
        "top_logprobs": top,
        "cache_salt": req.cache_salt,
    }


def _check_max(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        # OpenAI refuses 0 too ("integer below minimum value"): a caller asking for no
        # tokens at all has a bug, and an empty answer would hide it.
        raise InvalidParams(f"{name} must be >= 1, got {v}", param=name)


def _tokens(p: Any) -> bool:
    return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def text_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts: a string or a token list is one; a list of strings and token lists is
    several (each served as its own request: `routes.complete_prompts`). A flat list of ints
    is one prompt of tokens, never several prompts of one token each."""
    if isinstance(prompt, str) or _tokens(prompt):
        return [prompt]
    if all(isinstance(p, str) or _tokens(p) for p in prompt):
        return list(prompt)
    raise InvalidParams("prompt must be a string, a list of token ids, or a list of those", param="prompt")


def chat_tools(req: ChatCompletionRequest, degraded: Any = None) -> dict[str, Any]:
    """The ChatRequest's tool fields (actord.chat.tools) from `tools` / `tool_choice` /
    `parallel_tool_calls`, or from the legacy `functions` / `function_call` (then the answer
    carries `function_call`, one call). A bad value is a 400 naming its field; with
    `degraded` (frontends/http/degraded.py), hosted tools (`web_search`, ...) are dropped and a
    schema the grammar cannot hold is relaxed, each noted there instead."""
    from actord.chat import tools as T
    from actord.frontends.http.degraded import relax_tools

    if req.functions is not None or req.function_call is not None:
        if req.tools is not None or req.tool_choice is not None:
            raise _refuse("functions", "send tools or the legacy functions, not both")
        tools, choice = functions_from_openai(req.functions or [], req.function_call)
        parallel = False
    else:
        wired = req.tools
        if degraded is not None and isinstance(wired, list):  # hosted tools dropped, as on Responses
            from actord.frontends.http.degraded import unrunnable

            wired = [t for i, t in enumerate(wired) if not unrunnable(t, f"tools[{i}]", degraded)]
        tools, choice = tools_from_openai(wired), req.tool_choice
        parallel = req.parallel_tool_calls is not False
    if choice is not None and not tools and choice not in ("none", "auto"):
        raise InvalidParams("tool_choice names a tool, but there are no tools", param="tool_choice")
    if req.parallel_tool_calls is not None and not isinstance(req.parallel_tool_calls, bool):
        raise InvalidParams("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if degraded is not None:
        tools = relax_tools(tools, degraded)
    T.check_tools(tools, choice)
    if req.tool_format is not None and req.tool_format not in T.FORMATS:
        raise InvalidParams(f"tool_format is one of {', '.join(T.FORMATS)}", param="tool_format")
    return {"tools": tools, "tool_choice": choice if choice is not None else "auto", "parallel_tool_calls": parallel,
            "tool_format": req.tool_format or ""}


def chat_fields(req: ChatCompletionRequest) -> dict[str, Any]:
    """The ChatRequest's template and reasoning fields (llama-server's), checked: a wrong
    type is a 400 naming the field."""
    kwargs = req.chat_template_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidParams("chat_template_kwargs is an object of template variables", param="chat_template_kwargs")
    if req.reasoning_format is not None and not isinstance(req.reasoning_format, str):
        raise InvalidParams("reasoning_format is none, deepseek or auto", param="reasoning_format")
    for name in ("reasoning_budget", "reasoning_budget_tokens"):
        v = getattr(req, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise InvalidParams(f"{name} is an integer", param=name)
    budget = req.reasoning_budget if req.reasoning_budget is not None else (
        None if req.reasoning_budget_tokens == -1 else req.reasoning_budget_tokens)
    if req.reasoning_budget_message is not None and not isinstance(req.reasoning_budget_message, str):
        raise InvalidParams("reasoning_budget_message is a string", param="reasoning_budget_message")
    out: dict[str, Any] = {"template_kwargs": kwargs or {}, "reasoning_format": req.reasoning_format or "",
                           "reasoning_budget": budget, "reasoning_budget_message": req.reasoning_budget_message}
    for name in ("add_generation_prompt", "continue_final_message"):
        v = getattr(req, name)
        if v is not None:
            if not isinstance(v, bool):
                raise InvalidParams(f"{name} is a boolean", param=name)
            out[name] = v
    if out.get("continue_final_message") and req.add_generation_prompt is None:
        out["add_generation_prompt"] = False  # continuing the last message opens no new one
    return out


def hosted_options(req: ChatCompletionRequest, degraded: Degraded) -> None:
    """Options a hosted model honours and a local one cannot, ignored and named, as the
    Responses API ignores `reasoning.effort` and drops hosted tools: an agent's every turn
    would otherwise be refused."""
    if req.reasoning_effort not in (None, "none"):
        degraded.add(f"reasoning_effort {str(req.reasoning_effort)[:20]!r} ignored: "
                     "this model reasons as its template and chat_template_kwargs say")
    if req.verbosity is not None:
        degraded.add(f"verbosity {str(req.verbosity)[:20]!r} ignored: the answer's length follows the prompt "
                     "and max_tokens")
    if req.web_search_options is not None:
        degraded.add("web_search_options dropped: this server runs no web search")


def to_turn(req: ChatCompletionRequest, headers: Mapping[str, str], context: TurnContext) -> Turn:
    """A chat completion request as one chat turn (actord/frontends/http/turns.py): every
    field read and checked as the module docstring says, a 400 naming the first that is
    wrong; the length and sampling it leaves unsaid are the chat layer's defaults."""
    refuse_unsupported(req)
    n = choices(req, context.max_n)
    fields = sampling(req, context.n_vocab)
    degraded = Degraded()  # what is answered in a lesser form (degraded.py): its header
    hosted_options(req, degraded)
    tool_fields = chat_tools(req, degraded)  # tools, tool_choice, parallel_tool_calls (actord.chat.tools)
    if not req.messages:
        raise InvalidParams("messages is empty", param="messages")
    mind, label = mind_of(headers, context, req.prompt_cache_key, req.user)
    chat = asked(context.defaults, messages=chat_messages(req.messages),
                 max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
                 temperature=req.temperature, top_p=req.top_p, mind=mind, ignore_eos=req.ignore_eos,
                 top_k=req.top_k, seed=req.seed, stop=stops(req.stop), stream=req.stream, genes=req.genes,
                 return_progress=req.return_progress, timings_per_token=req.timings_per_token,
                 **fields, **tool_fields, **chat_fields(req))
    return Turn(chat, degraded, n=n, label=label)


def from_result(result: Any, *, model: str, created: int, fingerprint: str, logprobs: bool,
                functions: bool = False) -> dict[str, Any]:
    """A turn's ChatResult (n > 1: the list of them) as the whole `chat.completion` body."""
    return chat_completion(new_id("chatcmpl"), model, result, created, fingerprint, logprobs, functions)


def chat_messages(msgs: list[Message]) -> list[ChatMessage]:
    """The messages as actord's (roles as sent: a `developer` one becomes `system` where the
    template needs it, actord/frontends/http/turns.py `roles_for`)."""
    out = []
    for i, m in enumerate(msgs):
        calls = None
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidParams(f"messages[{i}]: only assistant messages carry tool_calls",
                                    param=f"messages[{i}].tool_calls")
            calls = calls_from_openai(m.tool_calls, f"messages[{i}].tool_calls")
        elif m.function_call is not None and m.role == "assistant":  # legacy: one call, no id
            calls = calls_from_openai([{"id": "call_0", "function": m.function_call}], f"messages[{i}].function_call")
        role = m.role
        call_id = m.tool_call_id
        if role == "function":  # legacy: a function's result, named
            role, call_id = "tool", call_id or "call_0"
        if role == "tool" and not call_id:
            raise InvalidParams(f"messages[{i}]: a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id")
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
        out.append(ChatMessage(role=role, content=content, tool_calls=calls, tool_call_id=call_id if role == "tool" else None,
                               name=m.name, reasoning_content=m.reasoning_content if role == "assistant" else None))
    return out


def stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# -- errors ----------------------------------------------------------------------------

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
