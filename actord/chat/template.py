"""The chat template: a Jinja2 template the model ships, compiled in a bounded sandbox.

Every system a user might pick instead of actord (llama-server, vLLM, SGLang, Ollama)
takes `[{role, content}]` messages and renders them with the chat template the model ships
(`tokenizer.chat_template` in the GGUF). `ChatTemplate` does the same: a Jinja2 template
compiled in `jinja2.sandbox.ImmutableSandboxedEnvironment` with the environment Hugging
Face's `apply_chat_template` gives templates (trim_blocks, lstrip_blocks, the loopcontrols
extension, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), so a
template renders the way its authors tested it. Turning the rendered text into prompt
tokens, and reusing a turn's exact tokens, is actord/chat/prompter.py's.

Why jinja2 directly rather than the formatter llama-cpp-python ships
(`llama_cpp.llama_chat_format.Jinja2ChatFormatter`): that formatter is a thin wrapper over
this same sandboxed environment, but it lives in the `llama_cpp` package, and only the
engine package may import that (the engine thread is the only caller of libllama, and
rendering runs on worker threads). Why not llama.cpp's own `llama_chat_apply_template`: it
recognises a fixed list of built-in formats by heuristics rather than running the
template, so an unknown template silently renders wrong. The sandbox (immutable: no
`list.append` games either) matters because a request may name its own template.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import hashlib
import json
import re
import sys
from typing import Any, Awaitable, Callable

from actord.vocabulary.errors import ChatTemplateError, PromptTooLong

# -- templates -------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    # The template refused the messages (their roles, their order): a 400 naming them.
    raise ChatTemplateError(f"the chat template refused the conversation: {message}", param="messages")


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
# anything, but not from looping (nested `range`s, loops over a long content). It renders
# under a budget of traced Python events, so it cannot run for long. The model's own
# template is trusted: no budget, no tracing cost.
REQUEST_TEMPLATE_BUDGET = 2_000_000

# Every render, trusted or not, runs on a worker thread (`render_async`): a trusted template
# over a long conversation is tens of milliseconds of Python per turn (Gemma 3's template
# over 2,000 messages, 1 MB: ~30 ms measured), and on the event loop that is every other
# request's stall; the hop to a thread costs ~0.2 ms. The threads come through the caller's
# `run_sync` seam (a deterministic dispatcher counts the work, so a replay knows when the
# system is quiet) and under one limiter per system, so renders cannot take every worker
# thread the disk and gene reads need; more than a few would only queue on the GIL anyway.
RENDER_THREADS = 4


class ChatTemplate:
    """One compiled template plus the special-token texts it may refer to."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", budget: int = 0,
                 run_sync: Callable[..., Awaitable[Any]] | None = None, limiter: Any = None,
                 max_bytes: int = 0) -> None:
        import jinja2

        self.budget = budget  # 0: trusted, unbounded; else the most traced events one render may take
        self.max_bytes = max_bytes  # UTF-8 bytes a render may produce (0: unbounded); see above
        self._run_sync = run_sync  # anyio.to_thread.run_sync's signature (a dispatcher's, to count it)
        self._limiter = limiter  # the system's render threads (RENDER_THREADS); None: anyio's default
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
               tools: list[dict[str, Any]] | None = None, context: dict[str, Any] | None = None) -> str:
        """`context`: more template variables (a request's `chat_template_kwargs`,
        `enable_thinking`); over llama-server's own (`llama_server_context`)."""
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
            extra = {**llama_server_context(tools), **(context or {})}
            if tools is not None:
                extra["tools"] = tools
            out: list[str] = []
            n = 0
            for chunk in self._tpl.generate({
                **extra, "messages": messages, "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token, "eos_token": self.eos_token,
            }):
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
                           tools: list[dict[str, Any]] | None = None, context: dict[str, Any] | None = None) -> str:
        """`render` on a worker thread, whoever wrote the template (see RENDER_THREADS)."""
        import anyio

        return await (self._run_sync or anyio.to_thread.run_sync)(
            functools.partial(self.render, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                              context=context),
            limiter=self._limiter)


def llama_server_context(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The variables llama-server gives every template besides the messages, so templates
    that read them render as they do there: today's date (`date_string` as Llama 3.x's
    templates print it, `datetime` as firefunction's) and `functions`, the tools as JSON text
    (firefunction's); a template's own default for a date makes prompts day-dependent, as
    llama-server's are."""
    now = datetime.datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y"),
            "functions": json.dumps(tools, indent=2, ensure_ascii=False) if tools else ""}
