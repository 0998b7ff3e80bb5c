"""Request and result shapes shared by the embedded API, the socket and the CLI.

Validation happens here, at decode, so everything inside can trust its types. New fields
get defaults, so older clients keep working.
"""

from __future__ import annotations

import math

import msgspec


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


DEFAULT_LIMITS = RequestLimits()


class CompletionRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
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

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> "CompletionRequest":
        from actord.errors import InvalidParams, PromptTooLong
        from actord.storage.paths import check_part

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
        if len(self.stop) > limits.max_stop:
            raise InvalidParams(f"{len(self.stop)} stop strings, at most {limits.max_stop}",
                                field="stop", max=limits.max_stop)
        for s in self.stop:
            if len(s) > limits.max_stop_bytes or _utf8_len(s, "stop") > limits.max_stop_bytes:
                raise InvalidParams(f"a stop string is over {limits.max_stop_bytes} bytes",
                                    field="stop", max_bytes=limits.max_stop_bytes)
        if len(self.stop_tokens) > limits.max_stop_tokens:
            raise InvalidParams(f"{len(self.stop_tokens)} stop tokens, at most {limits.max_stop_tokens}",
                                field="stop_tokens", max=limits.max_stop_tokens)
        if len(self.genes) > limits.max_genes:
            raise InvalidParams(f"{len(self.genes)} genes, at most {limits.max_genes}",
                                field="genes", max=limits.max_genes)
        if self.n_predict < 0:
            raise InvalidParams("n_predict must be >= 0")
        if not (0 <= self.temperature < math.inf and 0 < self.top_p <= 1 and 0 <= self.top_k < 2**31):
            raise InvalidParams("bad sampling parameters: 0 <= temperature < inf, 0 < top_p <= 1, "
                                "0 <= top_k < 2^31")
        if any(not math.isfinite(g.scale) for g in self.genes):
            raise InvalidParams("a gene scale must be finite", field="genes")
        if self.slot is not None and self.slot < 0:
            raise InvalidParams("slot must be >= 0")
        if self.slot is not None and self.mind is not None:
            raise InvalidParams("name a slot or a mind, not both")
        if self.mind is not None:
            why = check_part(self.mind)
            if why is not None:
                raise InvalidParams(f"a mind name is one page-name component: {why}", mind=self.mind[:64])
        if len({g.id for g in self.genes}) != len(self.genes):
            raise InvalidParams("a gene is listed twice")
        return self


def _utf8_len(s: str, field: str) -> int:
    """Bytes of `s` in UTF-8; text JSON can carry but UTF-8 cannot (a lone surrogate) is refused."""
    from actord.errors import InvalidParams

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
