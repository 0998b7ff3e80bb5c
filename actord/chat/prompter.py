"""Chat messages -> the model's prompt tokens, prefix-stable: the prompter and its turn memory.

`ChatPrompter` turns a conversation into prompt *tokens* with the model's template
(actord/chat/template.py). The text render is prefix-stable by construction for
well-behaved templates (turn n+1's prompt extends turn n's prompt plus the reply), but
tokens are not: the tokens a model generated need not be the ones its tokenizer would give
for the same text, and a template may trim a reply's whitespace. So the prompter remembers,
for each turn it served, the exact tokens of prompt + reply (keyed by a chained digest of
the conversation up to and including that reply, `ConversationKeys`; bounded by a token
budget, LRU). When a
conversation comes back with that reply as its last assistant message, the new prompt is
those tokens followed by the tokenized text the template renders *after* the reply (found
by rendering with a sentinel in the reply's place). The slot then decodes only the new
messages. A conversation it does not know (or a reply the client edited) is rendered and
tokenized whole, which is what llama-server does; prefix reuse then is whatever the
tokenizer leaves in common.

Trade-off, stated: for a remembered turn the prompt keeps the history exactly as the model
saw and wrote it, even where the template would render past turns differently (a template
that trims replies, or one that strips reasoning from earlier turns). That is what a mind
is; the template still renders everything new.

Templates that read the clock (`strftime_now`) are not prefix-stable across days; such a
conversation falls back to whole tokenization on the next turn.
"""

from __future__ import annotations

import collections
import hashlib
import secrets
import weakref
from array import array
from typing import Any, Awaitable, Callable

import msgspec

from actord.chat.messages import ChatMessage, as_dicts
from actord.chat.template import REQUEST_TEMPLATE_BUDGET, ChatTemplate
from actord.engine.jobs import ChatTemplateInfo as TemplateInfo
from actord.vocabulary.errors import ChatTemplateError, NoChatTemplate
from actord.vocabulary.types import CompletionResult

class Prompt(msgspec.Struct):
    tokens: list[int]
    key: bytes  # the conversation's key (ConversationKeys): the reply folds onto it (remember)
    reused_turn: bool
    tail: str = ""  # the rendered text's last characters: whether it opened a thought (chat.reasoning)


_encode = msgspec.msgpack.Encoder().encode


def _fields(m: ChatMessage) -> Any:
    """What a message adds to its conversation's key: its role, text, and calls or call id."""
    if not (m.tool_calls or m.tool_call_id):
        return (m.role, m.content)
    return (m.role, m.content, [(c.id, c.name, c.arguments) for c in m.tool_calls or []], m.tool_call_id)


def prefills(messages: list[ChatMessage], add_generation_prompt: bool, continue_final: bool = False) -> bool:
    """Whether a turn continues its last message (llama-server's assistant prefill): a
    conversation ending with an assistant's text, with the generation prompt asked for
    (llama-server's heuristic: a reply is wanted, and it begins with that text) or with
    `continue_final_message` (then add_generation_prompt is off: ChatRequest.check)."""
    last = messages[-1] if messages else None
    return (last is not None and last.role == "assistant" and not last.tool_calls
            and (add_generation_prompt or continue_final))


class ConversationKeys:
    """The turn memory's keys, chained: a conversation's key is the digest of the key of
    the conversation before it and its last message (the template's id starts the chain).

    Why a chain: the key of every prefix falls out of one pass, and a prefix's key is known
    without its messages. A turn's prompt carries its conversation's key, so remembering the
    reply hashes the reply alone (one whole-conversation digest read every message twice a
    turn: once to look the last reply up, once to remember the new one). And a message
    object already keyed at the same place in a conversation is not hashed again: each step
    is kept by (the chain's value before it, the object), weakly, so the conversations that
    come back as the same objects (an embedded caller's list growing turn by turn, the
    Responses API's stored conversation) hash only their new messages. A message a client
    sends again as JSON is a new object: it is hashed again, which is reading it once, the
    least that checking it unchanged costs.

    Measured (2,000 messages of 500 B, this machine, noisy): a seen conversation keys in
    ~0.5-0.8 ms without reading its text; an unseen one in ~3-5 ms, one pass over its bytes
    plus ~1 us of Python per message, where the whole digest twice took ~1.5 ms (so a long
    conversation of many short messages resent as JSON costs more than before, ~1 ms per
    1,000 messages). The steps kept are bounded (`max_steps`, least recently used first;
    ~250 B each) and hold no message alive: a step whose message is gone never matches.
    """

    def __init__(self, max_steps: int = 8192) -> None:
        self.max_steps = max_steps
        self.hashed = 0  # messages digested so far (what the keeping saves is counted here)
        self._steps: dict[tuple[bytes, int], tuple[weakref.ref, bytes]] = {}

    @staticmethod
    def start(template_id: str) -> bytes:
        return hashlib.sha256(b"actord-chat\0" + template_id.encode()).digest()

    def step(self, key: bytes, m: ChatMessage) -> bytes:
        """The key of a conversation whose key was `key` with `m` appended: sha256 of `key`
        and the message's fields (msgpack frames them, so no two messages fold the same)."""
        at = (key, id(m))
        kept = self._steps.pop(at, None)
        if kept is None or kept[0]() is not m:
            self.hashed += 1
            h = hashlib.sha256(key)
            h.update(_encode(_fields(m)))
            kept = (weakref.ref(m), h.digest())
            if len(self._steps) >= self.max_steps:  # least recently used first (dicts keep order)
                del self._steps[next(iter(self._steps))]
        self._steps[at] = kept
        return kept[1]

    def of(self, template_id: str, messages: list[ChatMessage]) -> list[bytes]:
        """The key of every prefix: `[i]` is that of messages[:i]."""
        keys = [self.start(template_id)]
        for m in messages:
            keys.append(self.step(keys[-1], m))
        return keys


ENTRY_TOKENS = 64  # what one kept turn costs beside its tokens, in 4-byte tokens (~256 B)


class TurnMemory:
    """LRU of the key of a conversation up to a reply (ConversationKeys) -> exact tokens of
    prompt + reply.

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
                 run_sync: Callable[..., Awaitable[Any]] | None = None, limiter: Any = None,
                 max_bytes: int = 0) -> None:
        self.info = info
        self.max_bytes = max_bytes  # the prompt limit: no render produces more
        self._tokenize = tokenize
        self._run_sync = run_sync  # every render runs on a worker thread, through this seam
        self._limiter = limiter  # ... under the system's render limiter (template.RENDER_THREADS)
        self.memory = TurnMemory(memory_tokens)
        self.keys = ConversationKeys()
        self._default: ChatTemplate | None = None

    def template(self, source: str | None = None) -> ChatTemplate:
        if source is not None:
            return ChatTemplate(source, bos_token=self.info.bos_text, eos_token=self.info.eos_text,
                                budget=REQUEST_TEMPLATE_BUDGET, run_sync=self._run_sync, limiter=self._limiter,
                                max_bytes=self.max_bytes)
        if self.info.template is None:
            raise NoChatTemplate("the model has no tokenizer.chat_template; name a template in the request")
        if self._default is None:
            self._default = ChatTemplate(self.info.template, bos_token=self.info.bos_text,
                                         eos_token=self.info.eos_text, run_sync=self._run_sync,
                                         limiter=self._limiter, max_bytes=self.max_bytes)
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
                    tools: list[dict[str, Any]] | None = None, context: dict[str, Any] | None = None,
                    finish: Callable[[str], str] | None = None, continue_final: bool = False) -> Prompt:
        """`render`: the messages as the template gets them, when they differ from `messages`
        (actord.chat.tools rewrites a history for templates without tool support; each assistant
        message stays one assistant message); `tools`: the template's `tools`; `context`: more
        template variables; `finish`: what the rendered text's end becomes (an empty thought
        where thinking is off: actord.chat.reasoning.close_prompt)."""
        tpl = self.template(template)
        fin = finish or (lambda text: text)
        dicts = as_dicts(messages) if render is None else render
        keys = self.keys.of(tpl.id, messages)
        if prefills(messages, add_generation_prompt, continue_final):
            text = await self.continued(tpl, dicts, tools, context)
            return Prompt(tokens=await self.tokens_of(text, first=True), key=keys[-1], reused_turn=False,
                          tail=text[-64:])
        k = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        kr = max((i for i, d in enumerate(dicts) if d["role"] == "assistant"), default=-1)
        if k > 0 and kr > 0 and add_generation_prompt:
            known = self.memory.get(keys[k + 1])  # the conversation up to its last reply
            if known is not None:
                tail = await self._tail_after(tpl, dicts, kr, tools, context)
                if tail is not None:
                    tail = fin(tail)
                    tokens = known + (await self.tokens_of(tail, first=False) if tail else [])
                    return Prompt(tokens=tokens, key=keys[-1], reused_turn=True, tail=tail[-64:])
        text = await tpl.render_async(dicts, add_generation_prompt=add_generation_prompt, tools=tools,
                                      context=context)
        if not text:
            raise ChatTemplateError("the chat template rendered an empty prompt")
        text = fin(text) if add_generation_prompt else text
        return Prompt(tokens=await self.tokens_of(text, first=True), key=keys[-1], reused_turn=False,
                      tail=text[-64:])

    @staticmethod
    async def continued(tpl: ChatTemplate, dicts: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         context: dict[str, Any] | None) -> str:
        """The conversation rendered with its last (assistant) message left open: the text up
        to that message's content, and the content, unclosed (found, as `_tail_after` does,
        by rendering a sentinel in its place)."""
        sentinel = f"@@actord-prefill-{secrets.token_hex(8)}@@"
        probe = [*dicts[:-1], {**dicts[-1], "content": sentinel}]
        text = await tpl.render_async(probe, add_generation_prompt=False, tools=tools, context=context)
        i = text.find(sentinel)
        if i < 0 or text.find(sentinel, i + 1) >= 0:
            raise ChatTemplateError("the chat template does not place the last assistant message verbatim, "
                                    "so it cannot be continued (send add_generation_prompt without it)")
        return text[:i] + dicts[-1]["content"]

    @staticmethod
    async def _tail_after(tpl: ChatTemplate, dicts: list[dict[str, Any]], k: int,
                          tools: list[dict[str, Any]] | None = None,
                          context: dict[str, Any] | None = None) -> str | None:
        """What the template renders after message k's content (its closing markup and every
        later message), found by rendering a sentinel in the content's place (a reply that
        made tool calls is probed as text: the tokens kept hold the calls as generated)."""
        sentinel = f"@@actord-reply-{secrets.token_hex(8)}@@"
        probe = [dict(d) for d in dicts]
        probe[k] = {"role": probe[k]["role"], "content": sentinel}
        text = await tpl.render_async(probe, add_generation_prompt=True, tools=tools, context=context)
        i = text.find(sentinel)
        if i < 0 or text.find(sentinel, i + 1) >= 0:
            return None  # the template does not place the reply verbatim, once
        return text[i + len(sentinel):]

    def remember(self, prompt: Prompt, reply: str | ChatMessage, result: CompletionResult) -> None:
        """Keep prompt + reply tokens for the conversation's next turn (`reply`: its text, or
        the message as the client will send it back, tool calls included)."""
        msg = reply if isinstance(reply, ChatMessage) else ChatMessage(role="assistant", content=reply)
        self.memory.put(self.keys.step(prompt.key, msg), prompt.tokens + result.tokens)
