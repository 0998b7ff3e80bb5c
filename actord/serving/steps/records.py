"""The records the scheduling core works on: a running `Request`, a planned step (`Plan`),
and the events a step's results turn into (`Delta`, `StepCheckpoint`, `Finished`, `Progress`).

Plain dataclasses kept apart from `core.py` (the logic) so a reader meets the data first; pure
like the core (no anyio, no threads, no actors: the layering test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actord.engine import jobs as J
from actord.vocabulary.types import TokenLogprob
from actord.serving.steps.text import TextState
from actord.serving.steps.thought import Thought

GeneKey = tuple[tuple[int, float], ...]


@dataclass(slots=True)
class Request:
    """One running request: everything a step needs (the core's docstring)."""

    rid: int
    slot: int
    seq: int
    tokens: list[int]  # the prompt, then every token sampled (fed or to be fed)
    n_prompt: int
    n_done: int  # tokens[:n_done] are in the KV
    n_predict: int
    genes: GeneKey = ()
    stop_tokens: frozenset[int] = frozenset()
    ignore_eos: bool = False
    checkpoint_at: list[int] = field(default_factory=list)  # absolute positions, ascending
    text: TextState | None = None
    order: int = 0
    n_sched: int = 0  # tokens in steps in flight
    samples: int = 0  # steps in flight that sample for this request
    out: list[int] = field(default_factory=list)
    reason: str | None = None  # why it ended ("eos", "stop", "length", "context", "cancelled", "error")
    error: Any = None  # the typed error when reason == "error"
    tail: str = ""  # text not streamed yet, fixed when it ended
    t_first: float = 0.0
    n_cached: int = 0
    logprobs: list[TokenLogprob] | None = None  # asked for: one per token of `out`
    lp_sent: int = 0  # logprobs[:lp_sent] went out with a Delta
    # Speculation: at most `spec` draft tokens per step (0: none); the draft context's
    # sequence holds tokens[:draft_done]; what was drafted and accepted, and in how many steps.
    spec: int = 0
    draft_done: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_spec_steps: int = 0
    spec_misses: int = 0  # verifies in a row that accepted nothing
    spec_pause: int = 0  # steps left without drafting (policy/speculation.py `pause_after`)
    progress: bool = False  # report each decoded piece of the prompt (a `Progress` event)
    # A reasoning budget's watch (steps/thought.py; None: no budget), and how long the output
    # may grow by samples planned blind (feed_last): n_predict, or less where a forced end
    # of a thought may come first (the forced tokens are fed after the sample that is due).
    think: Thought | None = None
    feed_until: int = 0
    # Twins (core.py `add`): the lineage (gene set, scope) under which this request may take
    # another running request's prompt cells (None: never), and the one it waits for: (its
    # rid, the prompt tokens both share), until that one's KV holds them.
    lineage: Any = None
    twin: tuple[int, int] | None = None
    memo: int = 0  # the prompt's last logits: Enroll.memo
    yieldable: bool = False  # Enroll.yieldable
    yielding: bool = False  # giving its slot up: no step planned past those in flight (core.py `give_way`)
    continued: bool = False  # Enroll.continued

    @property
    def ended(self) -> bool:
        return self.reason is not None

    @property
    def n_kv(self) -> int:
        """Cells the sequence holds: tokens[:n_done], and a MEMO_REUSE request's kept last
        prompt cell until the step that samples from it has run."""
        return self.n_done + (self.memo == J.MEMO_REUSE and self.n_done == self.n_prompt - 1)

    @property
    def n_held(self) -> int:
        """Cells charged to the request: those it holds and those its steps in flight write."""
        return max(self.n_done + self.n_sched, self.n_kv)

    def unsent_logprobs(self) -> list[TokenLogprob] | None:
        if self.logprobs is None:
            return None
        out = self.logprobs[self.lp_sent:]
        self.lp_sent = len(self.logprobs)
        return out


@dataclass(slots=True)
class Plan:
    """A step submitted to the engine, and which request each of its entries serves."""

    step: J.Step
    rids: list[int]
    fed: list[int]  # tokens each entry decodes


# ---- events (the actor routes them) -----------------------------------------------------


@dataclass(slots=True)
class Delta:
    rid: int
    text: str
    token: int
    # The logprobs of the tokens since the last Delta (a delta's text may hold several
    # tokens: the text state holds back a partial stop string or UTF-8 sequence); None
    # when the request did not ask for them.
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class StepCheckpoint:
    """A step decoded up to a planned checkpoint position: the slot keeps `data` (told as
    `CheckpointTaken`)."""

    rid: int
    slot: int
    pos: int
    data: Any


@dataclass(slots=True)
class Finished:
    """The request ended and nothing of it is in flight: its answer is due and its slot is
    told (the answer waits for a speculative step in flight, so a client that hears back
    finds its slot idle)."""

    req: Request
    kv_tokens: list[int]  # exactly what the sequence's KV holds
    draft_n: int = 0  # how much of kv_tokens the draft context's sequence holds


@dataclass(slots=True)
class Progress:
    """A step decoded a piece of the request's prompt (it asked for progress): `req.n_done`
    of its `n_prompt` tokens are in the KV now."""

    req: Request


Event = Delta | StepCheckpoint | Finished | Progress
