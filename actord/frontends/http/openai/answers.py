"""OpenAI's answer shapes: a chat.completion or text_completion body and the streamed chunks,
for one choice or n (OpenAI's `n`: actord/chat/choices.py).

Pure functions, no I/O (`wire.py`'s docstring draws the fields' lines).
With n choices: `choices[i]` has `index` i, its own finish_reason, logprobs and (chat) tool
calls; `usage` counts the prompt once and sums the choices' completion tokens
(`choices.merge_usage`). Several prompts (completions): choice p x n + i is prompt p's
choice i, as OpenAI numbers them, and usage is the prompts' summed. Streamed, every chunk
carries one choice, by its index: first each choice's role delta (chat), then the choices'
deltas as they come (interleaved), then each choice's last chunk with its finish_reason,
then one usage chunk when asked.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from actord.vocabulary.types import CompletionResult, TokenLogprob


def finish_reason(stop_reason: str, calls: bool = False, functions: bool = False) -> str:
    if calls and stop_reason in ("eos", "stop"):
        return "function_call" if functions else "tool_calls"
    return {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}.get(stop_reason, "stop")


def _split(r: Any) -> tuple[CompletionResult, Any]:
    """(completion, reply message or None): a chat's run returns its ChatResult."""
    if isinstance(r, CompletionResult):
        return r, None
    return r.completion, r.message


def _many(r: Any) -> list[Any]:
    """Every choice, by index: `r` is one result, n choices' list, or (several prompts)
    a list of each prompt's list (prompt p's choice i is choice p x n + i)."""
    if not isinstance(r, (list, tuple)):
        return [r]
    return [x for one in r for x in _many(one)]


def _prompts(r: Any) -> list[list[Any]]:
    """The choices grouped by prompt (each group shares its prompt's prefill)."""
    if isinstance(r, (list, tuple)) and r and all(isinstance(g, (list, tuple)) for g in r):
        return [list(g) for g in r]
    return [_many(r)]


def chat_message(msg: Any, content: str, functions: bool = False) -> dict[str, Any]:
    """The answer's `message`: with tool calls, `tool_calls` (and `content` null when the
    model wrote no text), or the legacy `function_call` (the first call)."""
    from actord.frontends.http.openai.tools_wire import call_to_openai

    calls = msg.tool_calls if msg is not None else None
    # A reasoning model's thought (actord.chat.reasoning): `reasoning_content`, as DeepSeek's
    # API and llama-server write it; absent for a reply without one.
    thought = {"reasoning_content": msg.reasoning_content} if msg is not None and msg.reasoning_content is not None \
        else {}
    if not calls:
        return {"role": "assistant", "content": content, **thought}
    text = msg.content or None
    if functions:
        return {"role": "assistant", "content": text, **thought,
                "function_call": {"name": calls[0].name, "arguments": calls[0].arguments}}
    return {"role": "assistant", "content": text, **thought, "tool_calls": [call_to_openai(c) for c in calls]}


def llama_timings(r: CompletionResult) -> dict[str, Any]:
    """llama-server's `timings` object of one completion (its native answers' and its chats').
    The generation rate is over the tokens after the first, as llama-server's: the first
    comes from the prompt's last step, so one token generated has no rate (0)."""
    t, n_gen, n_proc = r.timings, len(r.tokens), r.n_prompt_processed
    steps = max(0, n_gen - 1)
    spec = {"draft_n": t.draft_n, "draft_n_accepted": t.draft_n_accepted} if t.draft_n else {}  # as llama-server
    return {
        "cache_n": r.n_cached,
        "prompt_n": n_proc,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": t.prompt_ms / n_proc if n_proc else 0.0,
        "prompt_per_second": t.prompt_per_second,
        "predicted_n": n_gen,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": t.predicted_ms / steps if steps else 0.0,
        "predicted_per_second": 1e3 / t.predicted_ms * steps if steps and t.predicted_ms > 0 else 0.0,
        **spec,
    }


def verbose_object(model: str, r: Any, prompt: str) -> dict[str, Any]:
    """llama-server's `__verbose` (its native answer's fields for choice 0, `prompt` the text
    the model was given), which its OpenAI answers carry when asked for: a debugging aid."""
    c, _ = _split(_many(r)[0])
    n_gen = len(c.tokens)
    kind = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit"}.get(c.stop_reason, "none")
    return {"index": 0, "content": c.content, "tokens": list(c.tokens), "id_slot": c.slot, "stop": True,
            "model": model, "tokens_predicted": n_gen, "tokens_evaluated": c.n_prompt_tokens, "prompt": prompt,
            "has_new_line": "\n" in c.content, "truncated": c.stop_reason == "context", "stop_type": kind,
            "stopping_word": "", "tokens_cached": c.n_prompt_tokens + max(0, n_gen - 1),
            "timings": llama_timings(c)}


def timings(r: Any) -> dict[str, Any]:
    """llama-server's `timings` of a chat answer (choice 0's: it carries the shared prefill),
    beside OpenAI's usage: an extra field OpenAI's clients ignore and llama-server's UIs read."""
    return llama_timings(_split(_many(r)[0])[0])


def usage(r: Any) -> dict[str, Any]:
    """`r`: one result, the n choices', or several prompts' (each prompt counted once, its
    completions summed; the prompts' usages summed)."""
    from actord.chat.choices import merge_usage

    u: dict[str, int] = {}
    for group in _prompts(r):
        for k, v in merge_usage([_split(x)[0] for x in group]).items():
            u[k] = u.get(k, 0) + v
    cached = u.pop("cached_tokens")
    return {**u, "prompt_tokens_details": {"cached_tokens": cached}}


def new_id(prefix: str, sep: str = "-") -> str:
    """A fresh id: `chatcmpl-<hex>` as OpenAI's Chat Completions writes them; the Responses
    API's ids take `_` (`resp_`, `msg_`, `fc_`), so it passes `sep="_"`."""
    return f"{prefix}{sep}{secrets.token_hex(12)}"


def chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any]:
    """OpenAI's chat `choices[].logprobs`: `content[]` with token, logprob, bytes and top_logprobs."""
    return {"content": [{
        "token": t.text, "logprob": t.logprob, "bytes": t.bytes,
        "top_logprobs": [{"token": a.text, "logprob": a.logprob, "bytes": a.bytes} for a in t.top],
    } for t in lps or []], "refusal": None}


def text_logprobs(lps: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any]:
    """Legacy completions' `logprobs`: parallel lists, alternatives as {text: logprob}
    (text_offset counts characters of the generated text, from `offset`)."""
    offsets = []
    for t in lps or []:
        offsets.append(offset)
        offset += len(t.text)
    return {
        "tokens": [t.text for t in lps or []],
        "token_logprobs": [t.logprob for t in lps or []],
        "top_logprobs": [{a.text: a.logprob for a in t.top} for t in lps or []],
        "text_offset": offsets,
    }


def chat_completion(rid: str, model: str, r: Any, created: int, fingerprint: str,
                    logprobs: bool = False, functions: bool = False) -> dict[str, Any]:
    """`r`: the chat's ChatResult (a CompletionResult: its text only), or a list of n."""
    choices = []
    for i, one in enumerate(_many(r)):
        c, msg = _split(one)
        calls = bool(msg is not None and msg.tool_calls)
        choices.append({
            "index": i, "message": chat_message(msg, msg.content if msg is not None else c.content, functions),
            "finish_reason": finish_reason(c.stop_reason, calls, functions),
            "logprobs": chat_logprobs(c.logprobs) if logprobs else None,
        })
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": usage(r), "timings": timings(r)}


def text_completion(rid: str, model: str, r: Any, created: int, fingerprint: str,
                    logprobs: bool = False) -> dict[str, Any]:
    choices = []
    for i, one in enumerate(_many(r)):
        c, _ = _split(one)
        choices.append({"index": i, "text": c.content, "finish_reason": finish_reason(c.stop_reason),
                        "logprobs": text_logprobs(c.logprobs) if logprobs else None})
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": usage(r)}


class Chunks:
    """Builds the SSE `data:` payloads of one streamed answer, in OpenAI's chunk format, for
    `n` choices (each chunk one choice, by its index)."""

    def __init__(self, chat: bool, model: str, fingerprint: str = "", logprobs: bool = False,
                 functions: bool = False, n: int = 1, llama: bool = False) -> None:
        self.chat = chat
        self.llama = llama  # llama-server's first delta: content null (OpenAI's: "")
        self.functions = functions  # legacy function calling: `function_call` deltas
        self.n = n
        self.n_calls = 0
        self.model = model
        self.fingerprint = fingerprint
        self.logprobs = logprobs
        self.offsets = [0] * n  # text_offset so far, per choice (completions)
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    @property
    def offset(self) -> int:
        return self.offsets[0]

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [choice] if choice is not None else [], **extra}

    def first(self) -> dict[str, Any] | None:
        """Choice 0's role delta (chat); `firsts` gives every choice's."""
        return self.firsts()[0] if self.chat else None

    def firsts(self) -> list[dict[str, Any]]:
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": None if self.llama else ""},
                             "finish_reason": None})
                for i in range(self.n)]

    def progress(self, progress: dict[str, Any], timings: dict[str, Any] | None, index: int = 0) -> dict[str, Any]:
        """A prompt-progress chunk (llama-server's `return_progress`): chat, the role delta."""
        choice = {"index": index, "delta": {"role": "assistant", "content": None}, "finish_reason": None} \
            if self.chat else {"index": index, "text": "", "finish_reason": None}
        return self._chunk(choice, prompt_progress=progress, **({"timings": timings} if timings is not None else {}))

    def delta(self, text: str, lps: list[TokenLogprob] | None = None,
              tool_calls: list[dict[str, Any]] | None = None, index: int = 0,
              reasoning: str = "") -> dict[str, Any]:
        """One chunk of choice `index`: `text` and, when asked, the logprobs of the tokens it
        holds; a chat's `tool_calls` deltas (tools_wire.call_deltas: each call whole,
        by index within the choice) and thought (`reasoning_content`)."""
        if self.chat:
            choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "finish_reason": None}
            if reasoning:
                choice["delta"] = {"content": text or None, "reasoning_content": reasoning}
            if tool_calls:
                self.n_calls += len(tool_calls)
                if self.functions:  # legacy: the first call only, as `function_call`
                    first = tool_calls[0]
                    choice["delta"] = {"content": text or None, "function_call": dict(first["function"])} \
                        if first["index"] == 0 else {"content": text or None}
                else:
                    choice["delta"] = {"content": text or None, "tool_calls": tool_calls}
            if self.logprobs:
                choice["logprobs"] = chat_logprobs(lps)
            return self._chunk(choice)
        choice = {"index": index, "text": text, "finish_reason": None}
        if self.logprobs:
            choice["logprobs"] = text_logprobs(lps, self.offsets[index])
            self.offsets[index] += sum(len(t.text) for t in lps or [])
        return self._chunk(choice)

    def last(self, r: Any, index: int = 0) -> dict[str, Any]:
        r, msg = _split(r)
        reason = finish_reason(r.stop_reason, bool(msg is not None and msg.tool_calls), self.functions)
        if self.chat:  # llama-server's timings with each choice's last chunk (its own)
            return self._chunk({"index": index, "delta": {}, "finish_reason": reason}, timings=timings(r))
        return self._chunk({"index": index, "text": "", "finish_reason": reason})

    def lasts(self, r: Any) -> list[dict[str, Any]]:
        """Each choice's last chunk, by index (`r`: one result or the n choices')."""
        return [self.last(one, i) for i, one in enumerate(_many(r))]

    def usage(self, r: Any) -> dict[str, Any]:
        return self._chunk(None, usage=usage(r), **({"timings": timings(r)} if self.chat else {}))
