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

KV cells are charged per slot: a slot's sequence holds one cell per token (unified KV), the
scheduler counts what it feeds, and slots tell it (`Cells`) when their sequence changes
outside a step. A step is planned within the free cells, so a prompt chunk is admitted
knowing it fits. When work cannot get a cell, idle slots are asked to `Evict` (least
recently stepped first: to the mind's page, else its file, else dropped); a slot with work
refuses. When nothing can be freed and nothing can run, the youngest blocked request gets
`NoRoom`: a generation stops with reason "context", a prompt fails with `ContextFull`.

In the ask order the scheduler sits above the slots: it asks them (`StepResult`, `Evict`,
`NoRoom`); they only tell it (`Enroll`, `Cells`). A slot whose ask fails loses its work
here; the step loop goes on for everyone else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

import anyio

from actord.actors.base import Actor, Dispatcher, Envelope
from actord.actors.messages import (
    Cells, Enroll, Evict, MakeRoom, NoRoom, RunStep, SchedulerInbox, SlotNext, StepFailed, StepResult,
)
from actord.engine import jobs as J
from actord.errors import ActordError, KvCacheFull
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
    rank = 20

    def __init__(
        self, dispatcher: Dispatcher, engine: Any, slots: list[Actor[Any]], n_batch: int,
        metrics: Metrics, group_quantum: int = 4, capacity: int = 256, n_ctx: int = 0, piece_tile: int = 1,
    ) -> None:
        super().__init__(dispatcher, "scheduler", capacity)
        self.engine = engine
        self.slots = slots
        self.n_batch = n_batch
        self.piece_tile = max(1, piece_tile)
        self.n_ctx = n_ctx  # 0: cells are not charged (a test engine without a KV cache)
        self.cells: dict[int, int] = {i: 0 for i in range(len(slots))}
        self.last_use: dict[int, int] = {i: 0 for i in range(len(slots))}
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
                self.cells[msg.slot] = msg.pos0
                self.work[msg.slot] = _Work(
                    slot=msg.slot, seq=msg.seq, pending=list(msg.tokens), pos=msg.pos0,
                    genes=msg.genes, checkpoint_at=sorted(p for p in msg.checkpoint_at if p > msg.pos0),
                    order=self._enrolled,
                )
                if env.reply is not None:
                    env.reply.send(None)
            case Cells(slot=slot, n=n):
                if slot not in self.work:  # while enrolled, the steps are the count
                    self.cells[slot] = n
            case MakeRoom(slot=slot, cells=n):
                if self.n_ctx and slot not in self.work:
                    short = n - (self.free_cells + self.cells.get(slot, 0))
                    if short > 0:
                        await self._make_room(short, exclude=slot)
                    # Held for the slot until it tells what it really holds (Cells).
                    self.cells[slot] = min(n, self.free_cells + self.cells.get(slot, 0))
                if env.reply is not None:
                    env.reply.send(self.free_cells)
            case RunStep():
                self.stepping = False
                try:
                    await self._step()
                finally:
                    self._kick()
                return
        self._kick()

    def _kick(self) -> None:
        if self.work and not self.stepping:
            try:
                self.tell_nowait(RunStep())
            except anyio.WouldBlock:
                return  # a full mailbox: the next delivery kicks again
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, ActordError):
                return  # shutting down
            self.stepping = True

    @property
    def free_cells(self) -> int:
        return self.n_ctx - sum(self.cells.values()) if self.n_ctx else 1 << 30

    # -- planning (pure given the work table) ------------------------------------------

    def choose_group(self) -> GeneKey:
        groups = sorted({w.genes for w in self.work.values()})
        if self._current in groups and (self._run_length < self.group_quantum or len(groups) == 1):
            return self._current  # type: ignore[return-value]
        # The group served longest ago goes next; never-served groups first, in key order.
        groups.sort(key=lambda g: (self._last_served.get(g, -1), g))
        return groups[0]

    def plan(self, group: GeneKey, free: int | None = None) -> list[tuple[_Work, J.StepEntry]]:
        """The group's next step within n_batch tokens and `free` KV cells: decodes first."""
        members = sorted((w for w in self.work.values() if w.genes == group), key=lambda w: (w.prompt, w.order))
        budget = self.n_batch if free is None else min(self.n_batch, free)
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
            if not ckpt and self.piece_tile <= n < len(w.pending):
                # A piece cut short by the budget ends on a tile boundary, so the pieces
                # after it (and grid checkpoints) are whole tiles, decoded at full speed.
                aligned = (w.pos + n) // self.piece_tile * self.piece_tile - w.pos
                if aligned > 0:
                    n = aligned
            finishes = n == len(w.pending)
            plan.append((w, J.StepEntry(seq=w.seq, tokens=w.pending[:n], pos0=w.pos, sample=finishes, checkpoint=ckpt)))
            budget -= n
        return plan

    # -- one step ----------------------------------------------------------------------

    async def _step(self) -> None:
        if not self.work:
            return
        group = self.choose_group()
        if self.n_ctx:
            want = min(self.n_batch, sum(len(w.pending) for w in self.work.values() if w.genes == group))
            if self.free_cells < want:
                await self._make_room(want - self.free_cells)
            if self.free_cells <= 0:
                await self._yield_youngest()
                return
        if group != self._current:
            if self._current is not None:
                self.group_switches += 1
            self._current, self._run_length = group, 0
        self._run_length += 1
        self.steps += 1
        self._last_served[group] = self.steps
        plan = self.plan(group, self.free_cells if self.n_ctx else None)
        try:
            out: J.StepOut = await self.engine.run(J.Step(entries=[e for _, e in plan], genes=group))
        except KvCacheFull as e:
            # Our count said it fits; the cache disagreed (e.g. cells an SWA window still
            # holds). Make room as if the step had not fitted, and try again next step.
            log.warning("scheduler.kv_full", error=e.to_dict(), free=self.free_cells)
            if await self._make_room(sum(len(en.tokens) for _, en in plan)) == 0:
                await self._yield_youngest()
            return
        except ActordError as e:
            log.error("scheduler.step_failed", error=e.to_dict(), slots=[w.slot for w, _ in plan])
            self.metrics.engine_jobs_failed_total.inc()
            for w, _ in plan:
                del self.work[w.slot]
                await self._ask_slot(w.slot, StepFailed(error_type=e.type, message=e.message))
            return
        self.metrics.engine_steps_total.inc()
        self.metrics.engine_step_tokens.observe(out.n_tokens)
        for (w, entry), res in zip(plan, out.entries):
            n = len(entry.tokens)
            w.pos += n
            del w.pending[:n]
            w.checkpoint_at = [p for p in w.checkpoint_at if p > w.pos]
            self.cells[w.slot] = self.cells.get(w.slot, 0) + n
            self.last_use[w.slot] = self.steps
            nxt: SlotNext | None = await self._ask_slot(w.slot, StepResult(
                step=out.step, fed=entry.tokens, token=res.token, piece=res.piece, eog=res.eog,
                checkpoint=res.checkpoint, checkpoint_pos=res.checkpoint_pos,
            ))
            if nxt is None:
                self.work.pop(w.slot, None)
            elif nxt.action == "feed":
                w.pending, w.prompt = [nxt.token], False
            elif nxt.action == "done":
                del self.work[w.slot]
            elif not w.pending:  # "continue" with nothing left: a protocol error by the slot
                del self.work[w.slot]

    async def _ask_slot(self, slot: int, msg: Any) -> Any:
        """Ask a slot; a failure costs that slot its work, never the step loop."""
        try:
            return await self.slots[slot].ask(msg)
        except ActordError as e:
            log.error("scheduler.slot_failed", slot=slot, msg=type(msg).__name__, error=e.to_dict())
            self.work.pop(slot, None)
            return None

    async def _make_room(self, need: int, exclude: int | None = None) -> int:
        """Ask idle slots, least recently stepped first, to give up their cells."""
        victims = sorted((s for s, n in self.cells.items() if n > 0 and s not in self.work and s != exclude),
                         key=lambda s: (self.last_use.get(s, 0), s))
        freed = 0
        for s in victims:
            if freed >= need:
                break
            try:
                n = await self.slots[s].ask(Evict(reason="kv"))
            except ActordError as e:  # it has work coming (busy), or it failed
                log.info("scheduler.evict_refused", slot=s, error=e.to_dict())
                continue
            self.cells[s] = 0
            freed += n
            self.metrics.kv_evictions_total.inc()
        if freed:
            log.info("scheduler.made_room", freed=freed, need=need, free=self.free_cells)
        return freed

    async def _yield_youngest(self) -> None:
        """Nothing can be freed and nothing can run: the youngest request gives way."""
        w = max(self.work.values(), key=lambda w: w.order)
        log.warning("scheduler.no_room", slot=w.slot, n_ctx=self.n_ctx, cells=dict(self.cells))
        del self.work[w.slot]
        await self._ask_slot(w.slot, NoRoom())

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            enrolled=len(self.work), groups=len({w.genes for w in self.work.values()}),
            steps=self.steps, group_switches=self.group_switches,
        )
