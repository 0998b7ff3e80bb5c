"""Reasoning ("thinking") models: thinking rendered as the template and the request ask, and
parsed out of the output into `reasoning_content`.

Why a module of its own: thinking is a property of the template family, not of a wire. The
families llama.cpp's server tests name write it between two markers: `<think>...</think>`
(Qwen3, QwQ, DeepSeek-R1 and their distills) or `<|START_THINKING|>...<|END_THINKING|>`
(Command-R7B). Some templates open the thinking themselves (DeepSeek-R1's and QwQ's
generation prompt ends with `<think>\\n`), so the output holds only its end marker; others
(Qwen3) leave the opening to the model. Which case a turn is in is read off the rendered
prompt's end (`opens_thinking`), not guessed from the template's name.

Thinking on or off: `--reasoning on|off|auto` (llama-server's flag), overridden per request
by `chat_template_kwargs.enable_thinking` or `reasoning_budget: 0`; the template gets
`enable_thinking` (Qwen3's reads it). Where the template cannot turn thinking off itself,
the prompt gets an empty thought, as llama-server renders it (`close_prompt`): a generation
prompt ending in `<think>\\n` gets `</think>`, Command-R7B's chatbot turn gets
`<|START_THINKING|><|END_THINKING|>`.

The budget (`--reasoning-budget N`, per request `reasoning_budget` or llama-server's
`reasoning_budget_tokens`; -1: no limit, 0: thinking off): a thought that has N generated
tokens without its end marker is closed by force, the budget message's tokens
(`reasoning_budget_message`, none by default) and the end marker's following as if the
model wrote them, and sampling goes on after them, so the answer comes as content. This
module decides the policy (`TurnReasoning.thought_budget`: the markers' tokens, whether the
prompt opened the thought) and the scheduling core counts and forces
(actord/serving/steps/thought.py). A turn with a budget does not speculate, and a budget
with a grammar that holds from the first token is refused (the forced tokens would
bypass it).

Parsing (`reasoning_format`, llama-server's values): `none` leaves the output whole in
`content`; `deepseek` and `auto` (the default) put the thought in `reasoning_content` and
the rest in `content`. One incremental `ReasoningParser` serves the stream and the whole
answer, so a streamed answer's deltas always add up to the whole one whatever the chunking:
text that may be the start of a marker, and whitespace at a thought's edges, is held back
until what follows decides it. A thought never closed (n_predict ran out inside it) stays
reasoning, as llama-server leaves it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.chat.messages import check_reasoning
from actord.chat.stream import carry
from actord.vocabulary.errors import InvalidParams
from actord.vocabulary.types import ThoughtBudget



class Markers(msgspec.Struct, frozen=True):
    """What opens and closes a thought in one template family."""

    family: str
    open: str
    close: str


THINK = Markers("think", "<think>", "</think>")
COMMAND_R7B = Markers("command-r7b", "<|START_THINKING|>", "<|END_THINKING|>")
_CHATBOT_TURN = "<|CHATBOT_TOKEN|>"  # Command-R7B's generation prompt ends with it
_WS = " \t\r\n"


def markers_of(template: str | None) -> Markers | None:
    """The thinking markers a template's family writes (None: the template knows none)."""
    if not template:
        return None
    if COMMAND_R7B.open in template:
        return COMMAND_R7B
    if THINK.open in template or THINK.close in template:
        return THINK
    return None


def thinking_enabled(mode: str, kwargs: dict[str, Any], budget: int | None) -> bool:
    """Whether this turn thinks: the request's `enable_thinking`, else budget 0 turns it off,
    else the daemon's --reasoning (auto: the template's default, which is on)."""
    asked = kwargs.get("enable_thinking")
    if isinstance(asked, bool):
        return asked
    if budget == 0:
        return False
    return mode != "off"


def close_prompt(text: str, markers: Markers | None, enabled: bool) -> str:
    """The rendered prompt with an empty thought where thinking is off and the template opened
    one or cannot say (see the module docstring); unchanged otherwise."""
    if enabled or markers is None:
        return text
    if markers is COMMAND_R7B:
        return text + markers.open + markers.close if text.endswith(_CHATBOT_TURN) else text
    return text + markers.close if text.rstrip(_WS).endswith(markers.open) else text


def opens_thinking(text: str, markers: Markers | None) -> bool:
    """Whether the prompt leaves the model inside a thought (the template opened it)."""
    return markers is not None and text.rstrip(_WS).endswith(markers.open)


def _partial(buf: str, marker: str) -> int:
    """The length of the longest end of `buf` that is a proper start of `marker`."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits one output into thought and content as it streams: `feed` text, `finish` at
    the end; each returns (reasoning, content) text released by this call. `reasoning` and
    `content` hold everything released so far."""

    def __init__(self, markers: Markers, *, thinking: bool = False) -> None:
        self.markers = markers
        # start: a thought may open (leading whitespace held); think: inside one; after: the
        # whitespace after a thought drops; content: the rest is content.
        self.state = "think" if thinking else "start"
        self.buf = ""
        self.ws = ""  # whitespace inside a thought, held until text follows it
        self.reasoning = ""
        self.content = ""
        self.opened = thinking
        self.begun = False  # some thought released (its leading whitespace is gone)

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        r, c = self._run(final=False)
        self.reasoning += r
        self.content += c
        return r, c

    def finish(self) -> tuple[str, str]:
        r, c = self._run(final=True)
        self.reasoning += r
        self.content += c
        return r, c

    def _run(self, final: bool) -> tuple[str, str]:
        m = self.markers
        r: list[str] = []
        c: list[str] = []
        while self.buf:
            if self.state == "start":
                body = self.buf.lstrip(_WS)
                if body.startswith(m.open):
                    self.buf, self.state, self.opened = body[len(m.open):], "think", True
                    continue
                if not final and (not body or m.open.startswith(body)):
                    break  # a thought may be opening
                self.state = "content"
            elif self.state == "think":
                i = self.buf.find(m.close)
                if i >= 0:
                    r.append(self._thought(self.buf[:i], end=True))
                    self.buf, self.state = self.buf[i + len(m.close):], "after"
                    continue
                keep = 0 if final else _partial(self.buf, m.close)
                r.append(self._thought(self.buf[:len(self.buf) - keep], end=final))
                self.buf = self.buf[len(self.buf) - keep:]
                break
            elif self.state == "after":
                self.buf = self.buf.lstrip(_WS)
                if self.buf:
                    self.state = "content"
            else:
                c.append(self.buf)
                self.buf = ""
        return "".join(r), "".join(c)

    def _thought(self, text: str, end: bool) -> str:
        """Thought text with its edges' whitespace dropped: leading before any is released,
        trailing held until more text follows (`end`: none will)."""
        if not self.begun:
            text = text.lstrip(_WS)
        body = text.rstrip(_WS)
        if not body:
            self.ws = "" if end else self.ws + text
            return ""
        out, self.begun = self.ws + body, True
        self.ws = "" if end else text[len(body):]
        return out


def split(text: str, markers: Markers | None, *, thinking: bool, fmt: str) -> tuple[str | None, str]:
    """A whole output as (reasoning_content or None, content) under `reasoning_format`."""
    if markers is None or fmt == "none":
        return None, text
    p = ReasoningParser(markers, thinking=thinking)
    p.feed(text)
    p.finish()
    return (p.reasoning if p.opened else None), p.content


class ReasoningSink:
    """A chat's stream sink seen through a ReasoningParser: each chunk goes on with its
    content parsed, the thought it released under `reasoning` (the fronts write it as
    `delta.reasoning_content`)."""

    def __init__(self, parser: ReasoningParser, sink: Any) -> None:
        self.parser, self.sink = parser, sink
        self.held: dict[str, Any] = {}  # a held-back chunk's PLACED fields (actord.chat.stream.carry)

    def __call__(self, chunk: dict[str, Any]) -> None:
        if "progress" in chunk:  # the prompt's progress: no text to parse
            self.sink(chunk)
            return
        self._send(chunk, *self.parser.feed(chunk.get("content", "")))

    def finish(self, slot: int) -> None:
        self._send({"slot": slot, "content": "", "tokens": []}, *self.parser.finish())

    def _send(self, chunk: dict[str, Any], reasoning: str, content: str) -> None:
        if not (reasoning or content or chunk.get("logprobs")):
            self.held = carry(self.held, chunk)
            return  # held back (a marker may be starting)
        out = {**self.held, **chunk, "content": content}
        self.held = {}
        if reasoning:
            out["reasoning"] = reasoning
        self.sink(out)


class TurnReasoning:
    """One chat turn's reasoning: whether it thinks, what the template gets, and how its
    output is parsed (made by `for_turn`; `start` once the prompt is rendered)."""

    def __init__(self, markers: Markers | None, enabled: bool, fmt: str, kwargs: dict[str, Any],
                 budget: int = -1, message: str = "") -> None:
        self.markers, self.enabled, self.fmt = markers, enabled, fmt
        self.budget, self.message = budget, message
        self.context = {**kwargs, "enable_thinking": enabled}  # the template's variables
        self.thinking = False  # the prompt left the model inside a thought

    @property
    def parses(self) -> bool:
        return self.markers is not None and self.fmt != "none"

    def finish(self, text: str) -> str:
        return close_prompt(text, self.markers, self.enabled)

    def start(self, prompt_tail: str) -> None:
        self.thinking = opens_thinking(prompt_tail, self.markers)

    def sink(self, sink: Any) -> Any:
        """`sink` seen through a parser of its own (unchanged when nothing parses)."""
        if sink is None or not self.parses:
            return sink
        assert self.markers is not None
        return ReasoningSink(ReasoningParser(self.markers, thinking=self.thinking), sink)

    def split(self, text: str) -> tuple[str | None, str]:
        return split(text, self.markers, thinking=self.thinking, fmt=self.fmt)

    @property
    def forces(self) -> bool:
        """Whether a budget may cut this turn's thought."""
        return self.budget > 0 and self.enabled and self.markers is not None

    async def thought_budget(self, host: Any) -> ThoughtBudget | None:
        """The budget the scheduling core keeps for this turn (None: none), its markers and
        message tokenized by `host` (a ChatHost), after `start`."""
        if not self.forces:
            return None
        assert self.markers is not None

        async def tokens(text: str) -> list[int]:
            return await host.tokens_of(text, add_special=False, parse_special=True) if text else []

        end = await tokens(self.markers.close)
        forced = await tokens(self.message) + end
        return ThoughtBudget(budget=self.budget, start=await tokens(self.markers.open), end=end, forced=forced,
                             pieces=await host.pieces_of(forced), opened=self.thinking)


def for_turn(template: str | None, mode: str, fmt: str, kwargs: dict[str, Any], budget: int | None,
             message: str = "") -> TurnReasoning:
    """A turn's reasoning from its template's source, the daemon's --reasoning and the
    request's fields (its format, budget and budget message already resolved against the
    daemon's)."""
    check_reasoning(mode, fmt, budget)
    return TurnReasoning(markers_of(template), thinking_enabled(mode, kwargs, budget), fmt, kwargs,
                         -1 if budget is None else budget, message)
