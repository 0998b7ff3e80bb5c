"""Request and result shapes shared by the embedded API, the socket and the CLI.

Validation happens here, at decode, so everything inside can trust its types. New fields
get defaults, so older clients keep working.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from actord.vocabulary.errors import InvalidParams, PromptTooLong
from actord.vocabulary.kv_identity import MAX_TENANT, SCOPE_MARK, check_salt, scope_of, scoped_mind
from actord.vocabulary.names import check_mind


class GeneRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: int
    scale: float = 1.0


class RequestLimits(msgspec.Struct, frozen=True):
    """Bounds on one completion request, checked before any work (tokenizing included).

    The defaults are `Config`'s for its default ctx; a system passes its own
    (`Config.request_limits()`)."""

    max_prompt_bytes: int = 32 * 4096
    max_prompt_tokens: int = 4096
    max_stop: int = 32
    max_stop_bytes: int = 256
    max_stop_tokens: int = 1024
    max_genes: int = 64
    max_logit_bias: int = 1024
    max_top_logprobs: int = 20


DEFAULT_LIMITS = RequestLimits()


BAN = -100.0  # a logit bias at or below this bans the token (OpenAI's -100), as -inf


class Trigger(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a lazy grammar starts applying: at the first occurrence of `text` in the
    output, or (`at_start`) only where it opens the output (after whitespace). The grammar's
    sentences start with the trigger's text."""

    text: str
    at_start: bool = False


MAX_TRIGGERS = 8
MAX_TRIGGER_BYTES = 64


class ThoughtBudget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A reasoning budget, decided by the chat layer (actord.chat.reasoning) and kept by the
    scheduling core (actord/serving/steps/thought.py): once a thought holds `budget`
    generated tokens without its `end` marker's, the `forced` tokens (a message's, then the
    end marker's; `pieces`: each one's bytes, as the output shows it) follow as if generated,
    and sampling goes on after them. A thought opens after the `start` marker's tokens in
    the output, or at once when `opened` (the prompt left the model inside one)."""

    budget: int
    start: list[int]
    end: list[int]
    forced: list[int]
    pieces: list[bytes]
    opened: bool = False

    @property
    def tokens(self) -> list[int]:
        return [*self.start, *self.end, *self.forced]

    def check(self, limits: "RequestLimits") -> None:
        toks = self.tokens
        if isinstance(self.budget, bool) or self.budget < 1:
            raise InvalidParams("thought_budget.budget is a number of tokens, >= 1", param="thought_budget")
        if not self.end or not self.forced or len(self.pieces) != len(self.forced) or not (self.start or self.opened):
            raise InvalidParams("thought_budget needs its end marker, the forced tokens with one piece each, and a "
                                "start marker or an opened thought", param="thought_budget")
        if len(toks) > limits.max_stop_tokens or any(not 0 <= t < 2**31 for t in toks):
            raise InvalidParams(f"thought_budget: at most {limits.max_stop_tokens} token ids", param="thought_budget")


class SamplingFields(msgspec.Struct, kw_only=True, frozen=True):
    """Samplers beyond temperature/top_k/top_p, shared by `completion` and `chat` (names as
    llama-server's /completion and OpenAI's, where they exist).

    - `grammar`: GBNF (root rule `root`); `json_schema`: a JSON schema, turned into GBNF by
      llama-cpp-python's converter (actord.engine.grammar) at `check`. At most one.
    - `logit_bias`: token id -> bias added to its logit (`{"42": -100}` as OpenAI sends it, or
      `[[42, -100]]` as llama-server takes it); a bias <= -100 bans the token.
    - `presence_penalty`, `frequency_penalty` (OpenAI's), `repeat_penalty` (llama-server's,
      1 = off): counted over the tokens this request generated, the last `repeat_last_n` of
      them (-1: all of them).
    - `min_p`: llama-server's min-p (with temperature > 0).
    - `logprobs`: each generated token's log probability under the model, with the
      `top_logprobs` likeliest tokens' (CompletionResult.logprobs; chunks carry theirs).
      With `post_sampling_probs` (llama-server's): the log of each one's probability among
      the candidates the sampler chain left (top_k, top_p, min_p, temperature), read from
      libllama's own candidate array, the likeliest first and none with probability 0.
    - `grammar_triggers`: the grammar is lazy: the output is free until one of these
      texts appears in it, and held to the grammar from there (tool calls: actord.chat.tools).
    - `preserve`: texts of control tokens the output keeps (a control token's text is
      otherwise left out of the content), so markers such as `[TOOL_CALLS]` can be parsed.
    """

    grammar: str = ""
    json_schema: dict | None = None
    logit_bias: dict[str, float] | list[tuple[int, float]] = []
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = -1
    min_p: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    post_sampling_probs: bool = False
    grammar_triggers: list[Trigger] = []
    preserve: list[str] = []
    # Whose cells this request may reuse (vocabulary/kv_identity.py). `cache_salt` is the
    # client's (vLLM's field): it narrows reuse to requests with the same salt. `tenant` is
    # the front's, never the client's: the socket and the HTTP front overwrite it with the
    # peer's uid or the API key's index; an embedded host may name tenants itself.
    cache_salt: str | None = None
    tenant: str = ""

    def kv_scope(self) -> str:
        """The scope this request's cells belong to (vocabulary/kv_identity.py `scope_of`)."""
        return scope_of(self.tenant, self.cache_salt)

    def check_scope(self) -> None:
        if self.cache_salt is not None:
            why = check_salt(self.cache_salt)
            if why is not None:
                raise InvalidParams(why, param="cache_salt", field="cache_salt")
        if len(self.tenant) > MAX_TENANT:
            raise InvalidParams(f"tenant is over {MAX_TENANT} characters", param="tenant", field="tenant")

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """The logit biases as (token, bias), a ban as -inf; checked (`check_sampling`)."""
        items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        out: dict[int, float] = {}
        for tok, bias in items:
            out[int(tok)] = -math.inf if bias <= BAN else float(bias)
        return tuple(sorted(out.items()))

    def check_sampling(self, limits: "RequestLimits") -> None:
        self.check_scope()
        n = len(self.logit_bias)
        if n > limits.max_logit_bias:
            raise InvalidParams(f"{n} logit biases, at most {limits.max_logit_bias}", param="logit_bias",
                                max=limits.max_logit_bias)
        items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        for tok, bias in items:
            if isinstance(tok, str) and not (tok.isascii() and tok.isdigit() and len(tok) <= 10):
                raise InvalidParams(f"logit_bias key {tok[:20]!r} is not a token id", param="logit_bias")
            if int(tok) < 0 or int(tok) >= 2**31:
                raise InvalidParams(f"logit_bias names token {tok}, not a token id", param="logit_bias")
            if math.isnan(bias) or bias == math.inf:
                raise InvalidParams("a logit bias must be a number (<= -100 bans the token)", param="logit_bias")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidParams(f"{name} must be finite", param=name)
        if not (0 < self.repeat_penalty < math.inf):
            raise InvalidParams("repeat_penalty must be > 0 (1 = off)", param="repeat_penalty")
        if self.repeat_last_n < -1:
            raise InvalidParams("repeat_last_n must be >= -1 (-1: every generated token)", param="repeat_last_n")
        if not 0 <= self.min_p <= 1:
            raise InvalidParams("min_p must be in [0, 1]", param="min_p")
        if not 0 <= self.top_logprobs <= limits.max_top_logprobs:
            raise InvalidParams(f"top_logprobs must be in [0, {limits.max_top_logprobs}]", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise InvalidParams("top_logprobs needs logprobs", param="top_logprobs")
        if self.post_sampling_probs and not self.logprobs:
            raise InvalidParams("post_sampling_probs needs logprobs", param="post_sampling_probs")
        if self.grammar and self.json_schema is not None:
            raise InvalidParams("name a grammar or a json_schema, not both", param="json_schema")
        if self.grammar_triggers and not (self.grammar or self.json_schema is not None):
            raise InvalidParams("grammar_triggers need a grammar", param="grammar_triggers")
        for name, texts in (("grammar_triggers", [t.text for t in self.grammar_triggers]), ("preserve", self.preserve)):
            if len(texts) > MAX_TRIGGERS or any(not t or len(t.encode("utf-8", "surrogatepass")) > MAX_TRIGGER_BYTES
                                                for t in texts):
                raise InvalidParams(f"{name}: at most {MAX_TRIGGERS} non-empty texts of at most "
                                    f"{MAX_TRIGGER_BYTES} bytes", param=name)


class CompletionRequest(SamplingFields, kw_only=True, frozen=True, forbid_unknown_fields=True):
    prompt: str | list[int]
    n_predict: int = 16
    slot: int | None = None
    mind: str | None = None  # a named session: the daemon places it in a slot (page in/out as needed)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_tokens: list[int] = []
    ignore_eos: bool = False
    stream: bool = False
    genes: list[GeneRef] = []
    # Streamed only: a chunk per decoded piece of the prompt with its progress, and every
    # chunk with the timings so far (llama-server's fields: actord/serving/stream_extras.py).
    return_progress: bool = False
    timings_per_token: bool = False
    # A reasoning budget (the chat layer's: actord.chat.reasoning); None: none.
    thought_budget: ThoughtBudget | None = None

    def with_scoped_mind(self) -> "CompletionRequest":
        """This request with its mind named as the daemon keeps it under its scope
        (vocabulary/kv_identity.py `scoped_mind`); applied once, after the request is recorded,
        so a replay applies it to the same recorded request again."""
        if self.mind is None:
            return self
        scope = self.kv_scope()
        return self if not scope else msgspec.structs.replace(self, mind=scoped_mind(self.mind, scope))

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> "CompletionRequest":
        if isinstance(self.prompt, str) and not self.prompt:
            raise InvalidParams("prompt is empty")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidParams("prompt is empty")
        # Sizes first, before anything costs time in proportion to them (a text prompt is
        # never tokenized, nor a token list scanned, when it cannot fit).
        if isinstance(self.prompt, str):
            n = _utf8_len(self.prompt, "prompt")
            if n > limits.max_prompt_bytes:
                raise PromptTooLong(f"prompt of {n} bytes is over the limit of {limits.max_prompt_bytes}",
                                    n_prompt_bytes=n, max_prompt_bytes=limits.max_prompt_bytes)
        if isinstance(self.prompt, list) and len(self.prompt) > limits.max_prompt_tokens:
            raise PromptTooLong(f"prompt of {len(self.prompt)} tokens does not fit n_ctx {limits.max_prompt_tokens}",
                                n_prompt_tokens=len(self.prompt), n_ctx=limits.max_prompt_tokens)
        if len(self.stop_tokens) > limits.max_stop_tokens:
            raise InvalidParams(f"{len(self.stop_tokens)} stop tokens, at most {limits.max_stop_tokens}",
                                field="stop_tokens", max=limits.max_stop_tokens)
        check_generation(self, limits)
        if self.thought_budget is not None:
            self.thought_budget.check(limits)
        return self  # its grammar or json_schema: engine/grammar.py `compiled`



def check_generation(r: Any, limits: RequestLimits) -> None:
    """The checks of what a generation asks for beside its prompt (stop strings, genes, the
    budget, sampling, the slot or mind), shared by `CompletionRequest.check` and a chat turn's
    precheck (actord/chat/turn.py), which runs them on the ChatRequest's own same-named
    fields before anything renders."""
    if len(r.stop) > limits.max_stop:
        raise InvalidParams(f"{len(r.stop)} stop strings, at most {limits.max_stop}",
                            field="stop", max=limits.max_stop)
    for s in r.stop:
        if len(s) > limits.max_stop_bytes or _utf8_len(s, "stop") > limits.max_stop_bytes:
            raise InvalidParams(f"a stop string is over {limits.max_stop_bytes} bytes",
                                field="stop", max_bytes=limits.max_stop_bytes)
    if len(r.genes) > limits.max_genes:
        raise InvalidParams(f"{len(r.genes)} genes, at most {limits.max_genes}",
                            field="genes", max=limits.max_genes)
    if r.n_predict < 0:
        raise InvalidParams("n_predict must be >= 0")
    if not (0 <= r.temperature < math.inf and 0 < r.top_p <= 1 and 0 <= r.top_k < 2**31):
        raise InvalidParams("bad sampling parameters: 0 <= temperature < inf, 0 < top_p <= 1, "
                            "0 <= top_k < 2^31")
    if any(not math.isfinite(g.scale) for g in r.genes):
        raise InvalidParams("a gene scale must be finite", field="genes")
    if r.slot is not None and r.slot < 0:
        raise InvalidParams("slot must be >= 0")
    if r.slot is not None and r.mind is not None:
        raise InvalidParams("name a slot or a mind, not both")
    if r.mind is not None:
        why = check_mind(r.mind)
        if why is None and SCOPE_MARK in r.mind:
            why = f"{SCOPE_MARK!r} is kept for the daemon's scoped names"
        if why is None and check_mind(scoped_mind(r.mind, r.kv_scope())) is not None:
            why = f"too long to be kept under its scope (cache_salt or tenant)"
        if why is not None:
            raise InvalidParams(f"a mind name is one page-name component: {why}", mind=r.mind[:64])
    if len({g.id for g in r.genes}) != len(r.genes):
        raise InvalidParams("a gene is listed twice")
    r.check_sampling(limits)


def _utf8_len(s: str, field: str) -> int:
    """Bytes of `s` in UTF-8; text JSON can carry but UTF-8 cannot (a lone surrogate) is refused."""
    if s.isascii():
        return len(s)
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidParams(f"{field} is not valid Unicode (a lone surrogate)", field=field) from None


class Timings(msgspec.Struct, frozen=True):
    prompt_ms: float
    predicted_ms: float
    prompt_per_second: float
    predicted_per_second: float
    queued_ms: float = 0.0
    # Speculative decoding (llama-server's timings.draft_n / draft_n_accepted): tokens the
    # draft model proposed for this request, how many the target accepted, in how many steps.
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft_steps: int = 0
    # The request's share of the engine's time (policy/engine_time.py), as `request_engine_s`
    # counts it: every part of a generation that gave its slot up included. 0 with no budget.
    engine_ms: float = 0.0


class TopLogprob(msgspec.Struct, frozen=True):
    token: int
    text: str  # the token's piece, decoded (a partial UTF-8 sequence shows U+FFFD)
    bytes: list[int]  # the piece's exact bytes
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True):
    """One generated token's log probability under the model (log-softmax of the step's
    raw logits, before any sampler) and the likeliest tokens', most likely first."""

    token: int
    text: str
    bytes: list[int]
    logprob: float
    top: list[TopLogprob] = []


class CompletionResult(msgspec.Struct, frozen=True):
    content: str
    tokens: list[int]
    n_prompt_tokens: int
    n_prompt_processed: int
    n_cached: int
    slot: int
    stop_reason: str  # "length" | "eos" | "stop" | "context" | "cancelled"
    timings: Timings
    resumed_from_checkpoint: bool = False
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens`, when asked


class SlotInfo(msgspec.Struct, frozen=True):
    id: int
    state: str  # "idle" | "processing"
    n_tokens: int
    resume_raw_lcp: int | None
    n_checkpoints: int
    checkpoint_bytes: int
    genes: list[GeneRef]
    deferred: int
    mind: str | None = None
    checkpoint_positions: list[int] = []  # what the slot holds, oldest first
    checkpoint_plan: list[int] = []  # where its last prompt was planned to be snapshotted
