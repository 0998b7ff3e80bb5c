"""The Scheduler: forms each engine step (continuous batching), grouped by gene set.

Each step is ONE `llama_decode` batch: one decode token per generating slot first (they are
latency-bound), then prompt chunks in enrolment order until `n_batch` is full. A chunk is
cut at a checkpoint position the slot asked for, so the engine can snapshot the sequence
right after the decode that reaches it.

LoRA adapters are set per context, so a step holds only slots with the same gene set (same
ids, bit-identical scales). Groups take turns: a group keeps the engine for at most
`group_quantum` consecutive steps while another group waits (fewer adapter switches), then
the next group in round-robin order runs, so no group starves.

The step loop is message driven (`RunStep` to itself), so between two steps every queued
`Enroll` is delivered: a new request joins at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from actord.actors.base import Actor, Dispatcher, Envelope
from actord.actors.messages import Enroll, RunStep, SchedulerInbox, SlotNext, StepFailed, StepResult
from actord.engine import jobs as J
from actord.errors import ActordError
from actord.log import get
from actord.metrics import Metrics

log = get("actord.scheduler")

GeneKey = tuple[tuple[int, float], ...]


@dataclass
class _Work:
    slot: int
    seq: int
    pending: list[int]
    pos: int
    genes: GeneKey
    checkpoint_at: list[int] = field(default_factory=list)
    order: int = 0
    prompt: bool = True  # False once the slot feeds sampled tokens back


class SchedulerStats(msgspec.Struct, frozen=True):
    enrolled: int
    groups: int
    steps: int
    group_switches: int


class Scheduler(Actor[SchedulerInbox]):
    def __init__(
        self, dispatcher: Dispatcher, engine: Any, slots: list[Actor[Any]], n_batch: int,
        metrics: Metrics, group_quantum: int = 4, capacity: int = 256,
    ) -> None:
        super().__init__(dispatcher, "scheduler", capacity)
        self.engine = engine
        self.slots = slots
        self.n_batch = n_batch
        self.metrics = metrics
        self.group_quantum = group_quantum
        self.work: dict[int, _Work] = {}
        self.stepping = False
        self.steps = 0
        self.group_switches = 0
        self._enrolled = 0
        self._current: GeneKey | None = None
        self._run_length = 0
        self._last_served: dict[GeneKey, int] = {}

    async def handle(self, msg: SchedulerInbox, env: Envelope[SchedulerInbox]) -> None:
        match msg:
            case Enroll():
                self._enrolled += 1
                self.work[msg.slot] = _Work(
                    slot=msg.slot, seq=msg.seq, pending=list(msg.tokens), pos=msg.pos0,
                    genes=msg.genes, checkpoint_at=sorted(p for p in msg.checkpoint_at if p > msg.pos0),
                    order=self._enrolled,
                )
                if env.reply is not None:
                    env.reply.send(None)
                self._kick()
            case RunStep():
                self.stepping = False
                await self._step()
                self._kick()

    def _kick(self) -> None:
        if self.work and not self.stepping:
            self.stepping = True
            self.tell_nowait(RunStep())

    # -- planning (pure given the work table) ------------------------------------------

    def choose_group(self) -> GeneKey:
        groups = sorted({w.genes for w in self.work.values()})
        if self._current in groups and (self._run_length < self.group_quantum or len(groups) == 1):
            return self._current  # type: ignore[return-value]
        # The group served longest ago goes next; never-served groups first, in key order.
        groups.sort(key=lambda g: (self._last_served.get(g, -1), g))
        return groups[0]

    def plan(self, group: GeneKey) -> list[tuple[_Work, J.StepEntry]]:
        members = sorted((w for w in self.work.values() if w.genes == group), key=lambda w: (w.prompt, w.order))
        budget = self.n_batch
        plan: list[tuple[_Work, J.StepEntry]] = []
        for w in members:
            if budget <= 0:
                break
            n = min(len(w.pending), budget)
            ckpt = False
            for p in w.checkpoint_at:
                if w.pos < p <= w.pos + n:
                    n, ckpt = p - w.pos, True
                    break
            finishes = n == len(w.pending)
            plan.append((w, J.StepEntry(seq=w.seq, tokens=w.pending[:n], pos0=w.pos, sample=finishes, checkpoint=ckpt)))
            budget -= n
        return plan

    # -- one step ----------------------------------------------------------------------

    async def _step(self) -> None:
        if not self.work:
            return
        group = self.choose_group()
        if group != self._current:
            if self._current is not None:
                self.group_switches += 1
            self._current, self._run_length = group, 0
        self._run_length += 1
        self.steps += 1
        self._last_served[group] = self.steps
        plan = self.plan(group)
        try:
            out: J.StepOut = await self.engine.run(J.Step(entries=[e for _, e in plan], genes=group))
        except ActordError as e:
            log.error("scheduler.step_failed", error=e.to_dict(), slots=[w.slot for w, _ in plan])
            self.metrics.engine_jobs_failed_total.inc()
            for w, _ in plan:
                del self.work[w.slot]
                await self.slots[w.slot].ask(StepFailed(error_type=e.type, message=e.message))
            return
        self.metrics.engine_steps_total.inc()
        self.metrics.engine_step_tokens.observe(out.n_tokens)
        for (w, entry), res in zip(plan, out.entries):
            n = len(entry.tokens)
            w.pos += n
            del w.pending[:n]
            w.checkpoint_at = [p for p in w.checkpoint_at if p > w.pos]
            nxt: SlotNext = await self.slots[w.slot].ask(StepResult(
                step=out.step, fed=entry.tokens, token=res.token, piece=res.piece, eog=res.eog,
                checkpoint=res.checkpoint, checkpoint_pos=res.checkpoint_pos,
            ))
            if nxt.action == "feed":
                w.pending, w.prompt = [nxt.token], False
            elif nxt.action == "done":
                del self.work[w.slot]
            elif not w.pending:  # "continue" with nothing left: a protocol error by the slot
                del self.work[w.slot]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            enrolled=len(self.work), groups=len({w.genes for w in self.work.values()}),
            steps=self.steps, group_switches=self.group_switches,
        )
