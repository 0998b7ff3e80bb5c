"""The text verbs' bodies: the tokenizer, the chat template and embeddings, without generating.

Why apart from the façade: they are the engine's vocabulary and pooling jobs plus their
bounds, not actor work; the façade (service/system.py) keeps only their entries, which
record them for traces. `TextVerbs` is given the chat host (the façade, through the chat
package's own protocol) and the engine's door, and reads nothing else. Their sizes are bounded like a completion's prompt, by the
configured limits (`Config.request_limits()`), as the socket's text verbs always were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from actord.chat.host import ChatHost
from actord.chat.messages import ChatRequest
from actord.chat.turn import render_text, template_info
from actord.engine import jobs as J
from actord.vocabulary.errors import InvalidParams, PromptTooLong
from actord.service.protocol import Embedded, TemplateSource, Tokenized
from actord.vocabulary.types import RequestLimits, _utf8_len

if TYPE_CHECKING:
    from actord.chat.messages import ChatMessage


class _Jobs(Protocol):
    """The engine thread's door (actord/service/builder.py `engine_thread`)."""

    async def run(self, job: Any) -> Any: ...


def check_content(limits: RequestLimits, content: str, *_: Any, **__: Any) -> None:
    """`tokenize`'s bound, before it is recorded: the text's bytes."""
    limit = limits.max_prompt_bytes
    n = _utf8_len(content, "content")
    if n > limit:
        raise PromptTooLong(f"content of {n} bytes is over the limit of {limit}", field="content",
                            n_prompt_bytes=n, max_prompt_bytes=limit)


def check_apply(limits: RequestLimits, messages: list["ChatMessage"], template: str | None = None,
                *_: Any, **__: Any) -> None:
    """`apply_template`'s bounds, before it is recorded."""
    if not messages:
        raise InvalidParams("messages is empty", param="messages")
    limit = limits.max_prompt_bytes
    n = sum(len(m.role.encode()) + len(m.content.encode()) for m in messages)
    n += len(template.encode()) if template else 0
    if n > limit:
        raise PromptTooLong(f"chat of {n} bytes is over the limit of {limit}", n_prompt_bytes=n,
                            max_prompt_bytes=limit)
    if template is not None and not template.strip():
        raise InvalidParams("template is empty", param="template")


class TextVerbs:
    def __init__(self, host: ChatHost, engine: _Jobs) -> None:
        self.host = host
        self.engine = engine

    async def tokenize(self, content: str, add_special: bool, parse_special: bool, with_pieces: bool) -> Tokenized:
        tokens = await self.host.tokens_of(content, add_special=add_special, parse_special=parse_special) if content else []
        if not with_pieces:
            return Tokenized(tokens=tokens)
        return Tokenized(tokens=tokens, pieces=await self.engine.run(J.Pieces(tokens=tokens, special=True)))

    async def detokenize(self, tokens: list[int]) -> str:
        limits = self.host.request_limits()
        if len(tokens) > limits.max_prompt_tokens:
            raise PromptTooLong(f"{len(tokens)} tokens, at most {limits.max_prompt_tokens}", field="tokens",
                                n_tokens=len(tokens), max_tokens=limits.max_prompt_tokens)
        n_vocab = self.host.model_props().n_vocab
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise InvalidParams(f"token ids out of range [0, {n_vocab})", field="tokens", bad=bad[:8])
        pieces = await self.engine.run(J.Pieces(tokens=list(tokens), special=True))
        return b"".join(pieces).decode("utf-8", errors="replace")

    async def template_source(self) -> TemplateSource:
        """The chat template chats render with: --chat-template's, --chat-template-file, else the model's."""
        info, replaced = await template_info(self.host)
        origin = "builtin" if self.host.config.chat_template else "file" if replaced else "model"
        return TemplateSource(template=info.template, bos_token=info.bos_text, eos_token=info.eos_text, origin=origin)

    async def apply_template(self, messages: list["ChatMessage"], template: str | None, add_generation_prompt: bool,
                             tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The messages rendered as a chat turn would render them (its tools, its thinking on or
        off: actord.chat.turn.render_text), without generating."""
        request = ChatRequest(messages=messages, template=template, add_generation_prompt=add_generation_prompt,
                              tools=tools or [], template_kwargs=template_kwargs or {})
        return await render_text(self.host, request)

    async def count_prompt(self, messages: list["ChatMessage"], template: str | None, add_generation_prompt: bool,
                           tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None) -> int:
        """The prompt tokens a chat turn on these messages would decode: rendered as the turn
        renders, tokenized as it tokenizes (special tokens parsed), plus the model's BOS where it
        adds one and the template did not write it (llama-server's and Anthropic's input_tokens)."""
        text = await self.apply_template(messages, template, add_generation_prompt, tools, template_kwargs)
        tokens = await self.host.tokens_of(text, add_special=False, parse_special=True)
        info = await self.host.chat_info()
        return len(tokens) + (1 if info.add_bos and info.bos >= 0 and (not tokens or tokens[0] != info.bos) else 0)

    async def embed(self, inputs: list[str | list[int]]) -> Embedded:
        """Each text tokenized with the model's BOS and without parsing special tokens (a
        client's text is text); token lists are held to the vocabulary."""
        n_vocab = self.host.model_props().n_vocab
        toks: list[list[int]] = []
        for x in inputs:
            if isinstance(x, str):
                toks.append(await self.host.tokens_of(x, add_special=True, parse_special=False))
            else:
                if any(not 0 <= t < n_vocab for t in x):
                    raise InvalidParams(f"a token id is outside the vocab [0, {n_vocab})", param="input")
                toks.append(x)
        vectors = await self.engine.run(J.Embed(inputs=toks))
        return Embedded(vectors=vectors, n_tokens=sum(len(t) for t in toks))
