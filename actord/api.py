"""Request and result shapes shared by the embedded API, the socket and the CLI.

Validation happens here, at decode, so everything inside can trust its types. New fields
get defaults, so older clients keep working.
"""

from __future__ import annotations

import msgspec


class GeneRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: int
    scale: float = 1.0


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

    def check(self) -> "CompletionRequest":
        from actord.errors import InvalidParams

        if isinstance(self.prompt, str) and not self.prompt:
            raise InvalidParams("prompt is empty")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidParams("prompt is empty")
        if self.n_predict < 0:
            raise InvalidParams("n_predict must be >= 0")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise InvalidParams("bad sampling parameters")
        if self.slot is not None and self.slot < 0:
            raise InvalidParams("slot must be >= 0")
        if self.slot is not None and self.mind is not None:
            raise InvalidParams("name a slot or a mind, not both")
        if self.mind is not None and (not self.mind or "/" in self.mind or self.mind.startswith(".")):
            raise InvalidParams("a mind name is a non-empty file-safe name", mind=self.mind)
        if len({g.id for g in self.genes}) != len(self.genes):
            raise InvalidParams("a gene is listed twice")
        return self


class Timings(msgspec.Struct, frozen=True):
    prompt_ms: float
    predicted_ms: float
    prompt_per_second: float
    predicted_per_second: float
    queued_ms: float = 0.0


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
