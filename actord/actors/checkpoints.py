"""CheckpointBudget: one byte budget for the context checkpoints of all slots.

It keeps a mirror of each slot's checkpoint list (positions and sizes, never the bytes) and
each slot's last raw lcp, which the slots keep current by message. Before a slot stores a
new checkpoint it asks for admission; the budget plans with the pure
`plan_budget_admission` (the fullest holder gives up its divergence-aware victim, again and
again, until the new one fits; a checkpoint larger than the whole budget drops nothing and
is skipped) and tells each victim's slot to drop it. The requester's own victims come back
in the reply instead: a slot waiting for this reply cannot read its mailbox, and asking it
would deadlock. Every eviction and skip is logged and counted.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.actors.base import Actor, Dispatcher, Envelope
from actord.actors.messages import DropCheckpoint, Msg
from actord.errors import InvalidParams
from actord.log import get
from actord.metrics import Metrics
from actord.policy.checkpoints import CheckpointMeta, plan_budget_admission

log = get("actord.checkpoints")


class AdmitCheckpoint(Msg):
    slot: int
    pos: int
    n_bytes: int
    raw_lcp: int | None


class SlotCheckpoints(Msg):
    """A slot's list changed by itself (resume, erase, page move): replace the mirror."""

    slot: int
    metas: list[CheckpointMeta]
    raw_lcp: int | None


class BudgetStats(Msg):
    pass


CheckpointInbox = AdmitCheckpoint | SlotCheckpoints | BudgetStats


class Decision(msgspec.Struct, frozen=True):
    admit: bool
    drop_own: list[int] = []  # positions the requester must drop itself


class CheckpointBudgetStats(msgspec.Struct, frozen=True):
    used: int
    budget: int
    per_slot: dict[int, int]
    evicted: int
    skipped: int


class CheckpointBudget(Actor[CheckpointInbox]):
    rank = 40

    def __init__(self, dispatcher: Dispatcher, budget: int, slots: list[Actor[Any]], metrics: Metrics,
                 capacity: int = 256) -> None:
        super().__init__(dispatcher, "ckpt_budget", capacity)
        self.budget = budget
        self.slots = slots
        self.metrics = metrics
        self.lists: dict[int, list[CheckpointMeta]] = {i: [] for i in range(len(slots))}
        self.raw: dict[int, int | None] = {i: None for i in range(len(slots))}
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
            case SlotCheckpoints(slot=slot, metas=metas, raw_lcp=raw):
                self.lists[slot] = list(metas)
                self.raw[slot] = raw
            case BudgetStats():
                out = CheckpointBudgetStats(
                    used=self.used, budget=self.budget,
                    per_slot={k: sum(m.n_bytes for m in v) for k, v in self.lists.items()},
                    evicted=self.evicted, skipped=self.skipped,
                )
            case _:
                raise InvalidParams(f"checkpoint budget cannot handle {type(msg).__name__}")
        self.metrics.ctx_checkpoint_bytes.set(self.used)
        if env.reply is not None:
            env.reply.send(out)

    async def _admit(self, msg: AdmitCheckpoint) -> Decision:
        self.raw[msg.slot] = msg.raw_lcp
        plan = plan_budget_admission(
            {k: self.lists[k] for k in sorted(self.lists)}, self.raw, self.used, self.budget, msg.n_bytes,
        )
        if plan.skipped:
            self.skipped += 1
            self.metrics.ctx_checkpoints_skipped_budget_total.inc()
            log.info("checkpoint.skipped", slot=msg.slot, pos=msg.pos, n_bytes=msg.n_bytes,
                     used=self.used, budget=self.budget)
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
        self.lists[msg.slot].append(CheckpointMeta(pos=msg.pos, n_bytes=msg.n_bytes))
        return Decision(admit=True, drop_own=own)
