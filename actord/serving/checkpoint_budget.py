"""CheckpointBudget: one byte budget for the context checkpoints of all slots.

It keeps a mirror of each slot's checkpoint list (positions and sizes, never the bytes),
each slot's last raw lcp and its mind's divergence history, which the slots keep current
by message. Before a slot stores a new checkpoint it asks for admission. Under the default
"placement" policy the budget plans with the pure `checkpoint_placement.plan_admission`: the
checkpoint whose loss raises its slot's expected re-prefill least per byte freed goes,
across slots, until the new one fits (and a slot holds at most the count cap); a trade
that would not lower the total expected re-prefill is refused, so more checkpoints never
cost more than fewer. Under "divergence"/"oldest" it plans with the original C++ server's
rule, `plan_budget_admission` (the fullest holder gives up its count-rule victim). Either way a
checkpoint larger than the whole budget drops nothing and is skipped, and the budget tells
each victim's slot to drop it. The requester's own victims come back
in the reply instead: a slot waiting for this reply cannot read its mailbox, and asking it
would deadlock. Every eviction and skip is logged and counted.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from actord.serving.kernel import Actor, Dispatcher, Envelope
from actord.serving.messages import DropCheckpoint, Msg
from actord.vocabulary.errors import InvalidParams
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics
from actord.policy.checkpoint_records import CheckpointSize
from actord.policy.checkpoint_select import plan_budget_admission
from actord.policy.checkpoint_placement import Divergence, Forecast, expected_cost, forecast, plan_admission

log = get("actord.checkpoints")


class AdmitCheckpoint(Msg):
    slot: int
    pos: int
    n_bytes: int
    raw_lcp: int | None
    history: list[Divergence] = []  # the slot's mind's divergences, oldest first
    n_tokens: int = 0  # its prompt's length: the forecast's range
    population: list[float] = []  # where the slot's other minds diverged (fractions)


class AdmitCheckpoints(Msg):
    """Several checkpoints arriving at once (a page_in's): admitted in order, one reply."""

    items: list[AdmitCheckpoint]


class SlotCheckpoints(Msg):
    """A slot's list changed by itself (resume, erase, page move): replace the mirror."""

    slot: int
    metas: list[CheckpointSize]
    raw_lcp: int | None
    history: list[Divergence] = []
    n_tokens: int = 0
    population: list[float] = []


class BudgetStats(Msg):
    pass


CheckpointInbox = AdmitCheckpoint | AdmitCheckpoints | SlotCheckpoints | BudgetStats


class Decision(msgspec.Struct, frozen=True):
    admit: bool
    drop_own: list[int] = []  # positions the requester must drop itself


class CheckpointBudgetStats(msgspec.Struct, frozen=True):
    used: int
    budget: int
    per_slot: dict[int, int]
    evicted: int
    skipped: int
    expected: dict[int, float] = {}  # placement: each slot's expected re-prefill (tokens)


class CheckpointBudget(Actor[CheckpointInbox]):
    rank = 40

    def __init__(self, dispatcher: Dispatcher, budget: int, slots: Sequence[Actor[Any]], metrics: Metrics,
                 capacity: int = 256, policy: str = "placement", cap: int | None = None,
                 n_slots: int | None = None) -> None:
        super().__init__(dispatcher, "ckpt_budget", capacity)
        self.budget = budget
        self.policy = policy
        # At most this many per slot (placement; the original C++ server's rules cap pages only).
        self.cap = cap
        self.forecasts: dict[int, Forecast] = {}
        self.slots = slots
        self.metrics = metrics
        n = len(slots) if n_slots is None else n_slots
        self.lists: dict[int, list[CheckpointSize]] = {i: [] for i in range(n)}
        self.raw: dict[int, int | None] = {i: None for i in range(n)}
        self.evicted = 0
        self.skipped = 0

    @property
    def used(self) -> int:
        return sum(m.n_bytes for lst in self.lists.values() for m in lst)

    async def handle(self, msg: CheckpointInbox, env: Envelope[CheckpointInbox]) -> None:
        out: Any = None
        match msg:
            case AdmitCheckpoint():
                out = await self._admit(msg)
            case AdmitCheckpoints(items=items):
                out = [await self._admit(m) for m in items]
            case SlotCheckpoints(slot=slot, metas=metas, raw_lcp=raw):
                self.lists[slot] = list(metas)
                self.raw[slot] = raw
                self._forecast(slot, msg.history, msg.n_tokens, msg.population)
            case BudgetStats():
                out = CheckpointBudgetStats(
                    used=self.used, budget=self.budget,
                    per_slot={k: sum(m.n_bytes for m in v) for k, v in self.lists.items()},
                    evicted=self.evicted, skipped=self.skipped,
                    expected={k: round(expected_cost(f, [m.pos for m in self.lists[k]]), 1)
                              for k, f in self.forecasts.items() if self.lists[k]},
                )
            case _:
                raise InvalidParams(f"checkpoint budget cannot handle {type(msg).__name__}")
        self.metrics.ctx_checkpoint_bytes.set(self.used)
        if env.reply is not None:
            env.reply.send(out)

    def _forecast(self, slot: int, history: list[Divergence], n_tokens: int, population: list[float]) -> None:
        if self.policy == "placement":
            top = max((m.pos for m in self.lists[slot]), default=0) + 1
            self.forecasts[slot] = forecast(history, max(n_tokens, top), population=population)

    async def _admit(self, msg: AdmitCheckpoint) -> Decision:
        self.raw[msg.slot] = msg.raw_lcp
        holdings = {k: self.lists[k] for k in sorted(self.lists)}
        new = CheckpointSize(pos=msg.pos, n_bytes=msg.n_bytes)
        if self.policy == "placement":
            self._forecast(msg.slot, msg.history, max(msg.n_tokens, msg.pos + 1), msg.population)
            plan = plan_admission(holdings, self.forecasts, self.used, self.budget, msg.slot, new, cap=self.cap)
        else:
            plan = plan_budget_admission(holdings, self.raw, self.used, self.budget, msg.n_bytes)
        if plan.skipped:
            self.skipped += 1
            self.metrics.ctx_checkpoints_skipped_budget_total.inc()
            log.info("checkpoint.skipped", slot=msg.slot, pos=msg.pos, n_bytes=msg.n_bytes,
                     used=self.used, budget=self.budget,
                     why="larger than the budget" if msg.n_bytes > self.budget else "worth less than what it would evict")
            return Decision(admit=False)
        own: list[int] = []
        for key, idx in plan.evictions:
            gone = self.lists[key].pop(idx)
            self.evicted += 1
            self.metrics.ctx_checkpoints_evicted_budget_total.inc()
            log.info("checkpoint.evicted", slot=key, pos=gone.pos, n_bytes=gone.n_bytes,
                     for_slot=msg.slot, raw_lcp=self.raw.get(key))
            if key == msg.slot:
                own.append(gone.pos)
            else:
                await self.slots[key].tell(DropCheckpoint(pos=gone.pos))
        self.lists[msg.slot].append(new)
        return Decision(admit=True, drop_own=own)
