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
import datetime
import functools
import hashlib
import json
import secrets
import sys
from array import array
from typing import Any, Awaitable, Callable

import msgspec

from actord.api import CompletionResult, GeneRef, SamplingFields
from actord.engine.jobs import ChatTemplateInfo as TemplateInfo
from actord.errors import ChatTemplateError, InvalidParams, NoChatTemplate

# -- request and result shapes ---------------------------------------------------------


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str = ""


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


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
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
                 run_sync: Callable[..., Awaitable[Any]] | None = None) -> None:
        import jinja2

        self.budget = budget  # 0: trusted, unbounded; else the most traced events one render may take
        self._run_sync = run_sync  # anyio.to_thread.run_sync's signature (a dispatcher's, to count it)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.id = hashlib.sha256(source.encode()).hexdigest()[:16]
        try:
            self._tpl = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
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
        try:
            return self._tpl.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # includes sandbox SecurityError
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError, OverflowError,
                MemoryError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        finally:
            if self.budget:
                sys.settrace(previous)

    async def render_async(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """A budgeted (client) template renders on a worker thread; the trusted one inline."""
        if not self.budget:
            return self.render(messages, add_generation_prompt=add_generation_prompt)
        import anyio

        return await (self._run_sync or anyio.to_thread.run_sync)(
            functools.partial(self.render, messages, add_generation_prompt=add_generation_prompt))


def as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} for m in messages]


# -- prompts ---------------------------------------------------------------------------


class Prompt(msgspec.Struct):
    tokens: list[int]
    key_messages: list[ChatMessage]  # the conversation the tokens stand for (for remember)
    template_id: str
    reused_turn: bool


def _digest(template_id: str, messages: list[ChatMessage]) -> bytes:
    h = hashlib.sha256(template_id.encode())
    h.update(msgspec.msgpack.encode([(m.role, m.content) for m in messages]))
    return h.digest()


class TurnMemory:
    """LRU of digest(conversation up to a reply) -> exact tokens of prompt + reply.

    Bounded by the number of tokens held across all entries (4 bytes each); an entry larger
    than the whole budget is not kept.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
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
        if len(tokens) > self.max_tokens:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.held -= len(old)
        self._entries[key] = array("i", tokens)
        self.held += len(tokens)
        while self.held > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self.held -= len(dropped)


Tokenize = Callable[[str], Awaitable[list[int]]]


class ChatPrompter:
    """Builds a conversation's prompt tokens, reusing the exact tokens of turns it served."""

    def __init__(self, info: TemplateInfo, tokenize: Tokenize, *, memory_tokens: int = 1 << 22,
                 run_sync: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.info = info
        self._tokenize = tokenize
        self._run_sync = run_sync  # for a request's template, which renders on a worker thread
        self.memory = TurnMemory(memory_tokens)
        self._default: ChatTemplate | None = None

    def template(self, source: str | None = None) -> ChatTemplate:
        if source is not None:
            return ChatTemplate(source, bos_token=self.info.bos_text, eos_token=self.info.eos_text,
                                budget=REQUEST_TEMPLATE_BUDGET, run_sync=self._run_sync)
        if self.info.template is None:
            raise NoChatTemplate("the model has no tokenizer.chat_template; name a template in the request")
        if self._default is None:
            self._default = ChatTemplate(self.info.template, bos_token=self.info.bos_text,
                                         eos_token=self.info.eos_text)
        return self._default

    async def tokens_of(self, text: str, *, first: bool) -> list[int]:
        """Tokenize rendered text: special-token text (e.g. <bos>) parses as the token; BOS
        is added only when the model wants one and the template did not write it."""
        tokens = await self._tokenize(text)
        if first and self.info.add_bos and self.info.bos >= 0 and (not tokens or tokens[0] != self.info.bos):
            tokens.insert(0, self.info.bos)
        return tokens

    async def build(self, messages: list[ChatMessage], *, template: str | None = None,
                    add_generation_prompt: bool = True) -> Prompt:
        tpl = self.template(template)
        dicts = as_dicts(messages)
        k = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        if k > 0 and add_generation_prompt:
            known = self.memory.get(_digest(tpl.id, messages[: k + 1]))
            if known is not None:
                tail = await self._tail_after(tpl, dicts, k)
                if tail is not None:
                    tokens = known + (await self.tokens_of(tail, first=False) if tail else [])
                    return Prompt(tokens=tokens, key_messages=list(messages), template_id=tpl.id,
                                  reused_turn=True)
        text = await tpl.render_async(dicts, add_generation_prompt=add_generation_prompt)
        if not text:
            raise ChatTemplateError("the chat template rendered an empty prompt")
        return Prompt(tokens=await self.tokens_of(text, first=True), key_messages=list(messages),
                      template_id=tpl.id, reused_turn=False)

    @staticmethod
    async def _tail_after(tpl: ChatTemplate, dicts: list[dict[str, Any]], k: int) -> str | None:
        """What the template renders after message k's content (its closing markup and every
        later message), found by rendering a sentinel in the content's place."""
        sentinel = f"@@actord-reply-{secrets.token_hex(8)}@@"
        probe = [dict(d) for d in dicts]
        probe[k]["content"] = sentinel
        text = await tpl.render_async(probe, add_generation_prompt=True)
        i = text.find(sentinel)
        if i < 0 or text.find(sentinel, i + 1) >= 0:
            return None  # the template does not place the reply verbatim, once
        return text[i + len(sentinel):]

    def remember(self, prompt: Prompt, reply_text: str, result: CompletionResult) -> None:
        """Keep prompt + reply tokens for the conversation's next turn."""
        convo = [*prompt.key_messages, ChatMessage(role="assistant", content=reply_text)]
        self.memory.put(_digest(prompt.template_id, convo), prompt.tokens + result.tokens)
