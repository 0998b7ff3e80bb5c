"""Chat messages -> the model's own prompt, with the model's own template, prefix-stable.

Every system a user might pick instead of actord (llama-server, vLLM, SGLang, Ollama)
takes `[{role, content}]` messages and renders them with the chat template the model ships
(`tokenizer.chat_template` in the GGUF). This module does the same, in two layers:

* `ChatTemplate`: a Jinja2 template compiled in `jinja2.sandbox.ImmutableSandboxedEnvironment`
  with the environment Hugging Face's `apply_chat_template` gives templates (trim_blocks,
  lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson`
  that keeps non-ASCII text), so a template renders the way its authors tested it.
  Why jinja2 directly rather than the formatter llama-cpp-python ships
  (`llama_cpp.llama_chat_format.Jinja2ChatFormatter`): that formatter is a thin wrapper over
  this same sandboxed environment, but it lives in the `llama_cpp` package, and only the
  engine package may import that (the engine thread is the only caller of libllama, and
  rendering runs on the event loop). Why not llama.cpp's own `llama_chat_apply_template`:
  it recognises a fixed list of built-in formats by heuristics rather than running the
  template, so an unknown template silently renders wrong. The sandbox (immutable: no
  `list.append` games either) matters because a request may name its own template.

* `ChatPrompter`: turns a conversation into prompt *tokens*. The text render is prefix-
  stable by construction for well-behaved templates (turn n+1's prompt extends turn n's
  prompt plus the reply), but tokens are not: the tokens a model generated need not be the
  ones its tokenizer would give for the same text, and a template may trim a reply's
  whitespace. So the prompter remembers, for each turn it served, the exact tokens of
  prompt + reply (keyed by a digest of the conversation up to and including that reply,
  bounded by a token budget, LRU). When a conversation comes back with that reply as its
  last assistant message, the new prompt is those tokens followed by the tokenized text the
  template renders *after* the reply (found by rendering with a sentinel in the reply's
  place). The slot then decodes only the new messages. A conversation it does not know (or
  a reply the client edited) is rendered and tokenized whole, which is what llama-server
  does; prefix reuse then is whatever the tokenizer leaves in common.

Trade-off, stated: for a remembered turn the prompt keeps the history exactly as the model
saw and wrote it, even where the template would render past turns differently (a template
that trims replies, or one that strips reasoning from earlier turns). That is what a mind
is; the template still renders everything new.

Templates that read the clock (`strftime_now`) are not prefix-stable across days; such a
conversation falls back to whole tokenization on the next turn.
"""

from __future__ import annotations

import collections
import contextvars
import datetime
import functools
import hashlib
import json
import re
import secrets
import sys
from array import array
from typing import Any, Awaitable, Callable

import msgspec

from actord.service.types import CompletionResult, GeneRef, SamplingFields
from actord.engine.jobs import ChatTemplateInfo as TemplateInfo
from actord.service.errors import ChatTemplateError, InvalidParams, NoChatTemplate, PromptTooLong
from actord.chat.tools import Tool, ToolCall

# -- request and result shapes ---------------------------------------------------------


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str = ""
    # Tool calling (actord.chat.tools): an assistant turn's calls, a `tool` result's call id,
    # and a message's name (a tool result's function, where the template reads it).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


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

    def check(self) -> "ChatRequest":
        if not self.messages:
            raise InvalidParams("messages is empty")
        for i, m in enumerate(self.messages):
            if not m.role:
                raise InvalidParams(f"messages[{i}].role is empty", index=i)
        if self.template is not None and not self.template.strip():
            raise InvalidParams("template is empty")
        return self


class ChatResult(msgspec.Struct, frozen=True):
    message: ChatMessage  # the reply, as the next turn should send it back
    completion: CompletionResult  # usage: n_prompt_tokens, n_cached, n_prompt_processed, ...
    reused_turn: bool  # the prompt began with the exact tokens of a turn this daemon served


# -- templates -------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


# -- bounded rendering ---------------------------------------------------------------
#
# A prompt is bounded in bytes (`max_prompt_bytes`) before it is tokenized; a template must
# not get past that bound by producing its output first. Two guards, both per render (the
# bound lives in a context variable: the compiled environment is shared):
#
# * the output is streamed (`Template.generate`) and counted in UTF-8 bytes as it comes;
#   past the bound the render stops with PromptTooLong, so a loop that writes a little many
#   times never builds the whole text;
# * the operations that make one big value at once are checked before they run: sequence
#   repetition (`*`), concatenation (`+`, `~`), `%` formatting, `**`, the padding string
#   methods and filters (`center`, `ljust`, `indent`, ...), `replace`, `join`, `format`;
#   and every string or list a call or filter returns is checked after. So no single
#   value a template builds is ever much larger than the bound (a 12 KB message `* 1500`
#   is refused before the 18 MB string exists).
#
# What is left: a template can still hold many values each under the bound (a list built
# by a long loop); the step budget of a client's template bounds that, and a render runs on
# a worker thread. Isolating the render in a process with a memory limit would close it.

_BOUND: "contextvars.ContextVar[int]" = contextvars.ContextVar("actord_template_bound", default=0)


def _size(x: Any) -> int:
    """Bytes a value stands for in a prompt, roughly (UTF-8 at most 4 per character)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, (bytes, bytearray)):
        return len(x)
    if isinstance(x, (list, tuple)):
        return len(x) + sum(len(v) for v in x if isinstance(v, (str, bytes)))
    if isinstance(x, dict):
        return len(x) + sum(len(v) for v in x.values() if isinstance(v, str))
    return 0


def _too_long(n: int, what: str) -> PromptTooLong:
    bound = _BOUND.get()
    return PromptTooLong(f"the chat template would {what} of about {n} bytes, over the prompt limit of {bound}",
                         n_prompt_bytes=n, max_prompt_bytes=bound)


def _check(n: int, what: str) -> None:
    bound = _BOUND.get()
    if bound and n > bound:
        raise _too_long(n, what)


def _checked(value: Any, what: str) -> Any:
    _check(_size(value), what)
    return value


_WIDTH = re.compile(r"%[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?|\{[^{}]*?:[^{}]*?(\d+)[^{}]*\}")


def _check_format(fmt: Any, args: Any = ()) -> None:
    """Refuse a format string whose widths or precisions alone pass the bound."""
    if not isinstance(fmt, str) or not _BOUND.get():
        return
    extra = 0
    for m in _WIDTH.finditer(fmt):
        for g in m.groups():
            if g == "*":
                raise ChatTemplateError("the chat template used a '*' width in a format string")
            if g:
                extra += int(g[:12])
    _check(len(fmt) + extra + _size(args), "format a string")


class _BoundedSandbox:
    """Mixed into the sandboxed environment: the single-step guards (see above)."""

    intercepted_binops = frozenset(["*", "+", "%", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and not isinstance(n, bool) and isinstance(seq, (str, bytes, list, tuple)):
                    _check(_size(seq) * max(0, n), "repeat a value")
        elif operator == "+":
            if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
                _check(_size(left) + _size(right), "concatenate a value")
        elif operator == "%":
            _check_format(left, right)
        elif operator == "**":
            if (isinstance(left, int) and isinstance(right, int) and right > 0
                    and abs(left) > 1 and right * max(1, abs(left).bit_length()) > 1 << 16):
                raise ChatTemplateError("the chat template computed a power too large")
        return _checked(super().call_binop(context, operator, left, right), "build a value")  # type: ignore[misc]

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        name = getattr(__obj, "__name__", "")
        owner = getattr(__obj, "__self__", None)
        if owner is None and name in ("format", "format_map"):  # the sandbox's own str.format wrapper
            owner = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
            if isinstance(owner, str):
                _check_format(owner, (*args, *kwargs.values()))
                owner = None
        if isinstance(owner, str):
            if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
                _check(max(len(owner), args[0]), "pad a string")
            elif name == "expandtabs":
                tab = args[0] if args and isinstance(args[0], int) else 8
                _check(len(owner) + owner.count("\t") * max(0, tab), "expand tabs")
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                _check(len(owner) + (owner.count(args[0]) if args[0] else len(owner) + 1) * len(args[1]),
                       "replace text")
            elif name == "join" and args:
                items = list(args[0]) if not isinstance(args[0], (str, list, tuple)) else args[0]
                args = (items, *args[1:])
                _check(_size(items) + len(owner) * len(items), "join strings")
        return _checked(super().call(__context, __obj, *args, **kwargs), "build a value")  # type: ignore[misc]

    def _actord_concat(self, parts: Any) -> str:
        _check(sum(len(p) if isinstance(p, str) else len(str(p)) for p in parts), "concatenate strings")
        return "".join(p if isinstance(p, str) else str(p) for p in parts)


def _bounded_filter(name: str, f: Any) -> Any:
    pre: Callable[..., None] | None = None
    if name == "center":
        def pre(value: Any, width: Any = 80, *_: Any, **__: Any) -> None:
            _check(max(len(str(value)), width if isinstance(width, int) else 0), "pad a string")
    elif name == "indent":
        def pre(value: Any, width: Any = 4, *_: Any, **__: Any) -> None:
            w = width if isinstance(width, int) else len(str(width))
            _check(len(str(value)) + (str(value).count("\n") + 1) * max(0, w), "indent text")
    elif name == "replace":
        def pre(value: Any, old: Any = "", new: Any = "", *_: Any, **__: Any) -> None:
            v = str(value)
            n = v.count(str(old)) if old else len(v) + 1
            _check(len(v) + n * len(str(new)), "replace text")
    elif name == "format":
        def pre(value: Any, *args: Any, **kwargs: Any) -> None:
            _check_format(value, args)

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if pre is not None and _BOUND.get():
            lead = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # a context/env argument first
            pre(*args[lead:], **kwargs)
        return _checked(f(*args, **kwargs), "build a value")

    return bounded


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node: Any, frame: Any) -> None:  # `a ~ b`: through the bounded join
            if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
                return super().visit_Concat(node, frame)
            self.write("environment._actord_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Env(_BoundedSandbox, ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# A template a request brings is code from a client: the sandbox stops it from reaching
# anything, but not from looping (nested `range`s, loops over a long content). It renders on
# a worker thread under a budget of traced Python events, so it can neither freeze the event
# loop nor run for long. The model's own template is trusted: no budget, no tracing cost.
REQUEST_TEMPLATE_BUDGET = 2_000_000


class ChatTemplate:
    """One compiled template plus the special-token texts it may refer to."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", budget: int = 0,
                 run_sync: Callable[..., Awaitable[Any]] | None = None, max_bytes: int = 0) -> None:
        import jinja2

        self.budget = budget  # 0: trusted, unbounded; else the most traced events one render may take
        self.max_bytes = max_bytes  # UTF-8 bytes a render may produce (0: unbounded); see above
        self._run_sync = run_sync  # anyio.to_thread.run_sync's signature (a dispatcher's, to count it)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.id = hashlib.sha256(source.encode()).hexdigest()[:16]
        # Compiling folds constant expressions (`'a' | center(10**9)`): under the same bound,
        # so a fold past it is left for the render, which refuses it.
        token = _BOUND.set(max_bytes)
        try:
            self._tpl = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        finally:
            _BOUND.reset(token)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        import jinja2

        previous = sys.gettrace()
        if self.budget:
            left = [self.budget]

            def tracer(frame: Any, event: str, arg: Any) -> Any:
                left[0] -= 1
                if left[0] < 0:
                    raise ChatTemplateError(f"the chat template took more than {self.budget} steps to render")
                return tracer

            sys.settrace(tracer)
        token = _BOUND.set(self.max_bytes)
        try:
            extra = {"tools": tools} if tools is not None else {}
            out: list[str] = []
            n = 0
            for chunk in self._tpl.generate(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra,
            ):
                n += len(chunk.encode("utf-8", "surrogatepass"))
                if self.max_bytes and n > self.max_bytes:
                    raise PromptTooLong(
                        f"the chat template rendered more than {self.max_bytes} bytes (the prompt limit); "
                        "stopped there", n_prompt_bytes=n, max_prompt_bytes=self.max_bytes)
                out.append(chunk)
            return "".join(out)
        except (ChatTemplateError, PromptTooLong):
            raise
        except jinja2.TemplateError as e:  # includes sandbox SecurityError
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError, OverflowError,
                MemoryError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        finally:
            _BOUND.reset(token)
            if self.budget:
                sys.settrace(previous)

    async def render_async(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                           tools: list[dict[str, Any]] | None = None) -> str:
        """A budgeted (client) template renders on a worker thread; the trusted one inline."""
        if not self.budget:
            return self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        import anyio

        return await (self._run_sync or anyio.to_thread.run_sync)(
            functools.partial(self.render, messages, add_generation_prompt=add_generation_prompt, tools=tools))


def as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def has_tools(messages: list[ChatMessage]) -> bool:
    """Whether a conversation holds tool calls or results (it then renders through actord.chat.tools)."""
    return any(m.tool_calls or m.role == "tool" for m in messages)


# -- prompts ---------------------------------------------------------------------------


class Prompt(msgspec.Struct):
    tokens: list[int]
    key_messages: list[ChatMessage]  # the conversation the tokens stand for (for remember)
    template_id: str
    reused_turn: bool


def _digest(template_id: str, messages: list[ChatMessage]) -> bytes:
    h = hashlib.sha256(template_id.encode())
    h.update(msgspec.msgpack.encode([(m.role, m.content) if not (m.tool_calls or m.tool_call_id) else
                                     (m.role, m.content, [(c.id, c.name, c.arguments) for c in m.tool_calls or []],
                                      m.tool_call_id) for m in messages]))
    return h.digest()


ENTRY_TOKENS = 64  # what one kept turn costs beside its tokens, in 4-byte tokens (~256 B)


class TurnMemory:
    """LRU of digest(conversation up to a reply) -> exact tokens of prompt + reply.

    Bounded in 4-byte token units across all entries: each entry is charged its tokens and
    `entry_tokens` more for its key, array header and LRU node (~220 B measured), so many
    short turns cannot hold several times the budget (16 MB by default: 1,868 turns of
    ~240 tokens each had cost 0.3 KB apiece uncounted). An entry larger than the whole budget
    is not kept.
    """

    def __init__(self, max_tokens: int, entry_tokens: int = ENTRY_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.entry_tokens = entry_tokens
        self.held = 0
        self._entries: collections.OrderedDict[bytes, array] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> list[int] | None:
        arr = self._entries.get(key)
        if arr is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return arr.tolist()

    def put(self, key: bytes, tokens: list[int]) -> None:
        cost = len(tokens) + self.entry_tokens
        if cost > self.max_tokens:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.held -= len(old) + self.entry_tokens
        self._entries[key] = array("i", tokens)
        self.held += cost
        while self.held > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self.held -= len(dropped) + self.entry_tokens


Tokenize = Callable[[str], Awaitable[list[int]]]


class ChatPrompter:
    """Builds a conversation's prompt tokens, reusing the exact tokens of turns it served."""

    def __init__(self, info: TemplateInfo, tokenize: Tokenize, *, memory_tokens: int = 1 << 22,
                 run_sync: Callable[..., Awaitable[Any]] | None = None, max_bytes: int = 0) -> None:
        self.info = info
        self.max_bytes = max_bytes  # the prompt limit: no render produces more
        self._tokenize = tokenize
        self._run_sync = run_sync  # for a request's template, which renders on a worker thread
        self.memory = TurnMemory(memory_tokens)
        self._default: ChatTemplate | None = None

    def template(self, source: str | None = None) -> ChatTemplate:
        if source is not None:
            return ChatTemplate(source, bos_token=self.info.bos_text, eos_token=self.info.eos_text,
                                budget=REQUEST_TEMPLATE_BUDGET, run_sync=self._run_sync, max_bytes=self.max_bytes)
        if self.info.template is None:
            raise NoChatTemplate("the model has no tokenizer.chat_template; name a template in the request")
        if self._default is None:
            self._default = ChatTemplate(self.info.template, bos_token=self.info.bos_text,
                                         eos_token=self.info.eos_text, max_bytes=self.max_bytes)
        return self._default

    async def tokens_of(self, text: str, *, first: bool) -> list[int]:
        """Tokenize rendered text: special-token text (e.g. <bos>) parses as the token; BOS
        is added only when the model wants one and the template did not write it."""
        tokens = await self._tokenize(text)
        if first and self.info.add_bos and self.info.bos >= 0 and (not tokens or tokens[0] != self.info.bos):
            tokens.insert(0, self.info.bos)
        return tokens

    async def build(self, messages: list[ChatMessage], *, template: str | None = None,
                    add_generation_prompt: bool = True, render: list[dict[str, Any]] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> Prompt:
        """`render`: the messages as the template gets them, when they differ from `messages`
        (actord.chat.tools rewrites a history for templates without tool support; each assistant
        message stays one assistant message); `tools`: the template's `tools`."""
        tpl = self.template(template)
        dicts = as_dicts(messages) if render is None else render
        k = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        kr = max((i for i, d in enumerate(dicts) if d["role"] == "assistant"), default=-1)
        if k > 0 and kr > 0 and add_generation_prompt:
            known = self.memory.get(_digest(tpl.id, messages[: k + 1]))
            if known is not None:
                tail = await self._tail_after(tpl, dicts, kr, tools)
                if tail is not None:
                    tokens = known + (await self.tokens_of(tail, first=False) if tail else [])
                    return Prompt(tokens=tokens, key_messages=list(messages), template_id=tpl.id,
                                  reused_turn=True)
        text = await tpl.render_async(dicts, add_generation_prompt=add_generation_prompt, tools=tools)
        if not text:
            raise ChatTemplateError("the chat template rendered an empty prompt")
        return Prompt(tokens=await self.tokens_of(text, first=True), key_messages=list(messages),
                      template_id=tpl.id, reused_turn=False)

    @staticmethod
    async def _tail_after(tpl: ChatTemplate, dicts: list[dict[str, Any]], k: int,
                          tools: list[dict[str, Any]] | None = None) -> str | None:
        """What the template renders after message k's content (its closing markup and every
        later message), found by rendering a sentinel in the content's place (a reply that
        made tool calls is probed as text: the tokens kept hold the calls as generated)."""
        sentinel = f"@@actord-reply-{secrets.token_hex(8)}@@"
        probe = [dict(d) for d in dicts]
        probe[k] = {"role": probe[k]["role"], "content": sentinel}
        text = await tpl.render_async(probe, add_generation_prompt=True, tools=tools)
        i = text.find(sentinel)
        if i < 0 or text.find(sentinel, i + 1) >= 0:
            return None  # the template does not place the reply verbatim, once
        return text[i + len(sentinel):]

    def remember(self, prompt: Prompt, reply: str | ChatMessage, result: CompletionResult) -> None:
        """Keep prompt + reply tokens for the conversation's next turn (`reply`: its text, or
        the message as the client will send it back, tool calls included)."""
        msg = reply if isinstance(reply, ChatMessage) else ChatMessage(role="assistant", content=reply)
        convo = [*prompt.key_messages, msg]
        self.memory.put(_digest(prompt.template_id, convo), prompt.tokens + result.tokens)
