"""The Scheduler actor: runs the pure scheduling core (actord/serving/steps/core.py) against the engine.

The loop, one `RunStep` delivery at a time (its own tell, so every queued `Enroll`, `Abort`
and `Cells` is delivered between two steps):

    fill: while fewer than `depth` steps are in flight, core.schedule() and submit
    wait for the oldest step in flight
    core.update() -> events; fill again (the engine now holds the next step); route events

So while the engine runs step k+1, step k's events are routed: tokens to the requests'
stream sinks, final answers to their reply channels, `CheckpointTaken` and `Ended` to the
slots (control-lane tells: they never block). Nothing per token is an ask. A sink that
raises, or an output the core cannot handle, ends that request with a typed error; every
other request goes on.

KV cells are charged per slot (unified KV): the core counts an enrolled slot's tokens and
idle slots tell theirs (`Cells`). When the next step cannot get its cells, idle slots are
asked to `Evict` (least recently stepped first: to the mind's page, else its file, else
dropped); a slot with work refuses. When nothing can be freed and nothing can run, the
youngest request gives way: a generation stops with "context", a prompt fails with
`ContextFull`.

In the ask order the scheduler sits above the slots: it asks them only `Evict`; they tell it
(`Enroll`, `Abort`, `Cells`) and it tells them (`Ended`, `CheckpointTaken`).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from actord.serving.kernel import Actor, Dispatcher, Envelope, Reply
from actord.serving.messages import (
    Abort, Cells, CheckpointTaken, Enroll, Ended, Evict, MakeRoom, ReleaseRoom, Room, RunStep, SchedulerInbox,
    SlotInbox, SlotLost, Waiting,
)
from actord.vocabulary.types import CompletionResult, Timings
from actord.serving.steps.core import SchedulerCore
from actord.serving.steps.thought import Thought
from actord.serving.steps.records import Delta, Event, Finished, Plan, Progress, Request, StepCheckpoint
from actord.serving.stream_extras import LiveTimings, progress, timed
from actord.serving.steps.text import TextState
from actord.engine import jobs as J
from actord.vocabulary.errors import (
    ActordError, ActorFailed, ContextFull, EngineTimeExceeded, InternalError, KvCacheFull, SlotBusy, StepSkipped,
)
from actord.policy.engine_time import past_budget, step_shares
from actord.policy.yielding import YIELD, to_yield
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics

log = get("actord.scheduler")


@dataclass(slots=True)
class _Channel:
    """Where one request's output goes (never serialized: it lives beside the core)."""

    reply: Reply | None
    stream: Any
    t_start: float
    resumed: bool
    slot: int
    # The prompt as placed (its tokens, of them those the slot already held), told with the
    # request's first streamed chunk and then forgotten (0, 0): an API whose stream opens with
    # the prompt's usage (Anthropic's message_start) has it before the reply's first token.
    n_prompt: int = 0
    n_cached: int = 0
    live: LiveTimings | None = None  # timings_per_token: the stream's timings so far


def _placed(ch: _Channel, chunk: dict[str, Any]) -> None:
    """A request's first chunk says how its prompt was placed (TokenChunk's n_prompt, n_cached)."""
    chunk["n_prompt"], chunk["n_cached"] = ch.n_prompt, ch.n_cached
    ch.n_prompt = ch.n_cached = 0


class SchedulerStats(msgspec.Struct, frozen=True):
    enrolled: int
    groups: int
    steps: int
    group_switches: int
    in_flight: int


class Scheduler(Actor[SchedulerInbox]):
    rank = 20

    def __init__(
        self, dispatcher: Dispatcher, engine: Any, slots: Sequence[Actor[SlotInbox]], n_batch: int,
        metrics: Metrics, group_quantum: int = 4, capacity: int = 256, n_ctx: int = 0, piece_tile: int = 1,
        depth: int = 2, n_slots: int | None = None, engine_budget_s: float = 0.0, yield_after: int = 0,
    ) -> None:
        super().__init__(dispatcher, "scheduler", capacity)
        self.engine = engine
        self.slots = slots
        self.metrics = metrics
        self.core = SchedulerCore(n_batch, n_ctx=n_ctx, piece_tile=piece_tile, group_quantum=group_quantum,
                                  depth=depth)
        self.core.cells.update({i: 0 for i in range(len(slots) if n_slots is None else n_slots)})
        self.channels: dict[int, _Channel] = {}
        self.cells_seq: dict[int, int] = {}  # the newest Cells tell applied, per slot
        self._pending: collections.deque[tuple[Plan, Any]] = collections.deque()
        self.stepping = False
        # Parked: nothing runs and nothing could be freed, but a slot refused its eviction as
        # busy (its Enroll or end is still on its way here). Its next tell wakes the loop:
        # yielding now would end a request that its cells' owner was about to free or share.
        self.parked = False
        self._busy_victim = False
        self.lost: set[int] = set()  # slots whose actor crashed (SlotLost)
        self._tallied: list[Any] = [0, 0.0, 0]  # steps, busy seconds, sequences not yet in the registry
        self._n_tokens_max = 0  # the longest sequence a completion reached (llama-server's n_tokens_max)
        self._step_tokens: list[int] = []
        # Each request's share of engine time so far, and the most it may have (policy/engine_time.py).
        self.engine_budget_s = engine_budget_s
        self.engine_s: dict[int, float] = {}
        # Placements waiting for a slot, as the placer last told, less the generations that
        # gave theirs up since (policy/yielding.py); past how many tokens one may.
        self.waiting = 0
        self.yield_after = yield_after

    @property
    def n_ctx(self) -> int:
        return self.core.n_ctx

    @n_ctx.setter
    def n_ctx(self, n: int) -> None:
        self.core.n_ctx = n

    @property
    def free_cells(self) -> int:
        return self.core.free_cells

    def held(self, slot: int) -> int:
        return self.core.held(slot)

    @property
    def work(self) -> dict[int, Request]:
        """Enrolled requests by slot (what the simulation's invariants read)."""
        return {r.slot: r for r in self.core.reqs.values()}

    async def handle(self, msg: SchedulerInbox, env: Envelope[SchedulerInbox]) -> None:
        if not isinstance(msg, RunStep):
            self.parked = False
        match msg:
            case Enroll():
                self._enroll(msg, env)
            case Abort(rid=rid):
                self._route(self.core.abort(rid))
            case Cells(slot=slot, n=n, seq=seq, release=token):
                # A stale tell (queued before an eviction's answer) changes nothing.
                if slot not in self.lost and (not seq or seq > self.cells_seq.get(slot, 0)):
                    self.cells_seq[slot] = seq
                    self.core.set_cells(slot, n)
                    self.core.set_epoch(slot, msg.epoch)
                    if msg.shared:
                        self.core.link(slot, msg.shared_from, msg.shared_epoch, msg.epoch, msg.shared)
                if token:  # a page move's room: the count above stands for it now
                    self.core.release(token)
            case Waiting(n=n):
                self.waiting = n
            case SlotLost(slot=slot):
                self.lost.add(slot)
                rid = self.core.by_slot.get(slot)
                if rid is not None:
                    self._route(self.core.abort(rid, "error", ActorFailed(f"slot {slot} crashed", slot=slot)))
                await self._reclaim()
            case MakeRoom(slot=slot, cells=n, evict=evict):
                # The reply is the cells free for the slot (at most n), held for it until the
                # asker releases them: a caller that got fewer must not move a sequence in (it
                # would over-commit the cache that the steps in flight are counted against).
                room = Room(token=0, cells=n)
                # A slot with a request in flight is asked too: the move waits behind the
                # request (the slot defers it), and its room is held meanwhile (core.held).
                if self.n_ctx:
                    # The move replaces the slot's cells: it frees those only it holds (cells it
                    # shares with another sequence stay that one's, and count again once the
                    # share is broken: seed 97 x 60 steps charged 260 of 256 without this).
                    short = n - self.core.room_for(slot)
                    if short > 0 and evict:
                        await self._make_room(short, exclude=slot)
                    # Held for the slot until whoever asked releases it (ReleaseRoom).
                    granted = min(n, self.core.room_for(slot))
                    room = Room(token=self.core.reserve(slot, granted), cells=granted)
                if env.reply is not None:
                    env.reply.send(room)
                else:
                    self.core.release(room.token)
            case ReleaseRoom(token=token):
                self.core.release(token)
                if env.reply is not None:
                    env.reply.send(self.free_cells)
            case RunStep():
                self.stepping = False
                try:
                    await self._advance()
                    # While nothing else waits in the mailbox, go on stepping here (no hop).
                    while self._pending and self.dispatcher.go_on(self):
                        await self._advance()
                finally:
                    self._kick()
                return
        self._kick()

    def _enroll(self, m: Enroll, env: Envelope[Any]) -> None:
        r = Request(
            rid=m.rid, slot=m.slot, seq=m.seq, tokens=list(m.prompt), n_prompt=len(m.prompt), n_done=m.pos0,
            n_predict=m.n_predict, genes=m.genes, stop_tokens=frozenset(m.stop_tokens), ignore_eos=m.ignore_eos,
            checkpoint_at=list(m.checkpoint_at), text=TextState(m.stop, m.stream), n_cached=m.pos0,
            spec=m.spec, draft_done=min(m.draft_pos0, m.pos0),
            logprobs=[] if m.logprobs else None, progress=m.progress and m.stream,
            think=Thought(m.thought_budget) if m.thought_budget is not None else None,
            lineage=(m.genes, m.scope) if m.twin else None, memo=m.memo, yieldable=m.yieldable,
            continued=m.continued,
        )
        try:
            self.core.add(r)
            self.core.set_epoch(m.slot, m.epoch)
        except ValueError as e:  # a second request on one slot: a protocol error by the slot
            if env.reply is not None:
                env.reply.fail(InternalError(str(e), slot=m.slot))
            return
        t_start, stream, live = m.t_start or time.perf_counter(), env.stream if m.stream else None, None
        if stream is not None and m.timings:  # wrapped once: the route of a token stays the same
            live = LiveTimings(r, t_start)
            stream = timed(stream, live)
        self.channels[m.rid] = ch = _Channel(reply=env.reply, stream=stream, t_start=t_start,
                                             resumed=m.resumed_from_checkpoint, slot=m.slot, live=live,
                                             n_prompt=len(m.prompt), n_cached=m.pos0)
        if m.engine_s:  # a continuation: its request's account goes on
            self.engine_s[m.rid] = m.engine_s
        if r.progress:  # what the KV holds before the first step (llama-server's 0% report)
            self._route(self._progress(r, ch))

    def _kick(self) -> None:
        if (self.core.reqs or self._pending) and not self.stepping and not self.parked:
            try:
                self.tell_nowait(RunStep())
            except ActordError:
                return  # shutting down
            self.stepping = True

    # -- the loop ----------------------------------------------------------------------

    async def _twins(self) -> None:
        """Requests waiting for a twin whose KV now holds what both share take it by cells
        (a between-steps job: the twin's cells below it never change while it runs)."""
        for r, src, n in self.core.twins_ready():
            try:
                ok = bool(await self.engine.run(J.SeqShare(src=src, dst=r.seq, n=n)))
            except ActordError as e:
                log.info("scheduler.twin_share_failed", slot=r.slot, error=e.to_dict())
                ok = False
            took = self.core.twin_shared(r, ok)
            ch = self.channels.get(r.rid)
            if took and ch is not None:
                ch.n_cached = took
                self.metrics.prefix_hit_tokens_total.labels(source="twin").inc(took)
            log.info("scheduler.twin_shared" if took else "scheduler.twin_refused", slot=r.slot, n_tokens=n)

    async def _fill(self) -> None:
        core = self.core
        if core.waiting_for_twins():
            await self._twins()
        while len(self._pending) < core.depth:
            if core.n_ctx and not self._pending:
                want = core.wanted()
                if want and core.free_cells < want:
                    await self._make_room(want - core.free_cells)
            plan = core.schedule()
            if plan is None:
                break
            self._pending.append((plan, self.engine.submit(plan.step)))
        if not self._pending and core.runnable() and core.n_ctx and core.free_cells <= 0:
            self._yield_or_park()

    async def _advance(self) -> None:
        if len(self._pending) < self.core.depth:  # (a full pipeline: nothing to fill)
            await self._fill()
        if not self._pending:
            return
        plan, pending = self._pending.popleft()
        core = self.core
        try:
            out = await self.engine.wait(pending)
        except StepSkipped as e:
            self.metrics.engine_steps_skipped_total.inc()
            events = core.skipped(plan, int(e.data.get("epoch", core.epoch)))
        except KvCacheFull as e:
            # Our count said it fits; the cache disagreed (e.g. cells an SWA window still
            # holds). Make room as if the step had not fitted, and plan again.
            log.warning("scheduler.kv_full", error=e.to_dict(), free=self.free_cells)
            events = core.skipped(plan, int(e.data.get("epoch", core.epoch + 1)))
            self._route(events)
            if await self._make_room(sum(plan.fed)) == 0 and not self._pending:
                self._yield_or_park()
            return
        except ActordError as e:
            log.error("scheduler.step_failed", error=e.to_dict(), slots=[core.reqs[r].slot for r in plan.rids])
            self.metrics.engine_jobs_failed_total.inc()
            events = core.fail(plan, e)
        else:
            events = core.update(plan, out, time.perf_counter())
            self._tally(out)
            if self.engine_budget_s:
                events += self._charge(plan, out)
            if self.waiting and self.yield_after:
                events += self._give_way()
        if len(self._pending) < core.depth:
            await self._fill()  # the engine gets its next step before Python routes this one's output
        self._route(events)
        if not self._pending:
            self._flush_tally()
        if self.lost:
            await self._reclaim()

    async def _reclaim(self) -> None:
        """Clear the sequences of crashed slots once nothing of theirs is in flight."""
        for slot in sorted(self.lost):
            if slot in self.core.by_slot or self.core.cells.get(slot, 0) == 0:
                continue
            try:
                await self.engine.run(J.SeqRm(seq=slot, p0=-1, p1=-1))
            except ActordError as e:
                log.error("scheduler.reclaim_failed", slot=slot, error=e.to_dict())
                continue
            self.core.cells[slot] = 0
            log.warning("scheduler.slot_reclaimed", slot=slot)

    def _charge(self, plan: Plan, out: Any) -> list[Event]:
        """Charge each request its share of the step; end those past their budget."""
        fed = plan.fed
        if len(fed) == 1:  # one request had the whole step (step_shares' answer, without its lists)
            shares: Any = ((out.t_decode_ms + out.t_sample_ms) / 1e3,)
        else:
            shares = step_shares(out.t_decode_ms / 1e3, out.t_sample_ms / 1e3, fed,
                                 [e.token >= 0 for e in out.entries] if len(out.entries) == len(fed)
                                 else [True] * len(fed))
        events: list[Event] = []
        account = self.engine_s
        for rid, share in zip(plan.rids, shares):
            spent = account[rid] = account.get(rid, 0.0) + share
            if past_budget(spent, self.engine_budget_s) and rid in self.core.reqs:
                r = self.core.reqs[rid]
                log.warning("scheduler.engine_time_exceeded", slot=r.slot, spent_s=round(spent, 3),
                            budget_s=self.engine_budget_s)
                events += self.core.abort(rid, "error", EngineTimeExceeded(
                    f"the request had {spent:.1f} s of engine time, past its budget of {self.engine_budget_s:g} s "
                    "(request_engine_s)", slot=r.slot, budget_s=self.engine_budget_s))
        return events

    def _forget_accounts(self) -> None:
        """The engine-time accounts of requests drained with no answer to give (`_finish`
        closes the others): swept with the tally, not on every step."""
        for rid in [rid for rid in self.engine_s if rid not in self.core.reqs and rid not in self.channels]:
            del self.engine_s[rid]

    def _give_way(self) -> list[Event]:
        """A mind waits for a slot: the yieldable generation that has written most, past
        `yield_after` tokens, gives its slot up (policy/yielding.py; it ends its part as
        soon as its steps in flight are in and its text ends whole: core.py `give_way`)."""
        rid = to_yield([(r.rid, len(r.out)) for r in self.core.reqs.values()
                        if r.yieldable and not r.ended and not r.yielding], self.yield_after)
        if rid is None:
            return []
        self.waiting -= 1
        r = self.core.reqs[rid]
        log.info("scheduler.giving_way", slot=r.slot, rid=rid, n_out=len(r.out))
        return self.core.give_way(rid)

    def _tally(self, out: Any) -> None:
        """Per-step metrics are summed here and written to the registry every few steps
        (each registry write takes a lock: three per step showed in the profile)."""
        t = self._tallied
        t[0] += 1
        t[1] += (out.t_decode_ms + out.t_sample_ms) / 1e3
        t[2] += len(out.entries)
        self._step_tokens.append(out.n_tokens)
        if t[0] >= 32:
            self._flush_tally()

    def _flush_tally(self) -> None:
        t = self._tallied
        if len(self.engine_s) > len(self.core.reqs):
            self._forget_accounts()
        if t[0]:
            self.metrics.engine_steps_total.inc(t[0])
            self.metrics.engine_busy_seconds_total.inc(t[1])
            self.metrics.engine_step_seqs_total.inc(t[2])
            for n in self._step_tokens:
                self.metrics.engine_step_tokens.observe(n)
            self._tallied, self._step_tokens = [0, 0.0, 0], []

    # -- routing -----------------------------------------------------------------------

    def _route(self, events: list[Event]) -> None:
        queue = collections.deque(events)
        while queue:
            ev = queue.popleft()
            if isinstance(ev, Delta):
                ch = self.channels.get(ev.rid)
                if ch is None or ch.stream is None:
                    continue
                chunk: dict[str, Any] = {"slot": ch.slot, "content": ev.text, "tokens": [ev.token]}
                if ev.logprobs is not None:
                    chunk["logprobs"] = ev.logprobs
                if ch.n_prompt:
                    _placed(ch, chunk)
                try:
                    ch.stream(chunk)
                except Exception as e:  # the sink failed: this request ends, nobody else's
                    log.warning("scheduler.sink_failed", rid=ev.rid, error=repr(e))
                    queue.extend(self.core.fail_request(ev.rid, InternalError(f"stream sink failed: {e!r}")))
            elif isinstance(ev, StepCheckpoint):
                self._tell_slot(ev.slot, CheckpointTaken(rid=ev.rid, pos=ev.pos, data=ev.data))
            elif isinstance(ev, Finished):
                self._finish(ev)
            elif isinstance(ev, Progress):
                ch = self.channels.get(ev.req.rid)
                if ch is not None and ch.stream is not None and not ev.req.ended:
                    queue.extend(self._progress(ev.req, ch))

    def _progress(self, r: Request, ch: _Channel) -> list[Event]:
        """A prompt-progress chunk to the request's stream (stream_extras)."""
        now = time.perf_counter()
        if ch.live is not None:
            ch.live.prompt_step(now)
        try:
            ch.stream({"slot": ch.slot, "content": "", "tokens": [], "progress": progress(r, ch.t_start, now)})
        except Exception as e:  # the sink failed: this request ends, nobody else's
            log.warning("scheduler.sink_failed", rid=r.rid, error=repr(e))
            return self.core.fail_request(r.rid, InternalError(f"stream sink failed: {e!r}"))
        return []

    def _tell_slot(self, slot: int, msg: Any) -> None:
        try:
            self.slots[slot].tell_nowait(msg)
        except ActordError as e:  # a failed or stopped slot: nothing to tell
            log.info("scheduler.slot_gone", slot=slot, msg=type(msg).__name__, error=e.to_dict())

    def _finish(self, ev: Finished) -> None:
        """The final answer goes to the client through the slot: `Ended` carries it, and the
        slot hands it on after its own end-of-request work (gene lease, cells), so a client
        that hears back finds the slot, the residency and the cell count settled."""
        r = ev.req
        ch = self.channels.pop(r.rid, None)
        spent = self.engine_s.pop(r.rid, 0.0)
        m = self.metrics
        m.requests_in_flight.dec()
        if r.reason != YIELD:  # a part that gave its slot up is not the request's end
            m.requests_total.labels(outcome=r.reason).inc()
        else:
            m.generations_yielded_total.inc()
        m.prompt_tokens_processed_total.inc(r.n_prompt - r.n_cached)  # known here: a twin's share (core.py)
        if not r.continued:  # a continuation holds its request's prompt again: counted with its first part
            m.prompt_tokens_cached_total.inc(r.n_cached)
        if r.n_drafted:  # llama-server's counters, for every request that drafted
            m.spec_decode_num_draft_tokens_total.inc(r.n_drafted)
            m.spec_decode_num_accepted_tokens_total.inc(r.n_accepted)
            m.spec_decode_num_drafts_total.inc(r.n_spec_steps)
        answer: Any = None
        if r.reason == "error":
            answer = r.error if isinstance(r.error, ActordError) else InternalError(f"{r.error!r}")
        elif ch is not None:
            m.predicted_tokens_total.inc(len(r.out))
            rest = r.unsent_logprobs()
            if ch.stream is not None and (r.tail or rest):
                chunk: dict[str, Any] = {"slot": r.slot, "content": r.tail, "tokens": []}
                if rest is not None:
                    chunk["logprobs"] = rest
                if ch.n_prompt:
                    _placed(ch, chunk)
                try:
                    ch.stream(chunk)
                except Exception as e:
                    log.warning("scheduler.sink_failed", rid=r.rid, error=repr(e))
            answer = self._result(r, ch, spent)
            m.prompt_seconds_total.inc(answer.timings.prompt_ms / 1e3)
            m.predicted_seconds_total.inc(answer.timings.predicted_ms / 1e3)
            m.predicted_steps_total.inc(max(0, len(r.out) - 1))
            if r.n_prompt + len(r.out) > self._n_tokens_max:
                self._n_tokens_max = r.n_prompt + len(r.out)
                m.n_tokens_max.set(self._n_tokens_max)
        reply = ch.reply if ch is not None else None
        cut_back = r.reason == "error" and not isinstance(r.error, ContextFull)
        env = Envelope(Ended(rid=r.rid, kv_tokens=ev.kv_tokens, reason=r.reason or "", cut_back=cut_back,
                             draft_n=ev.draft_n), reply, answer=answer)
        try:
            if r.slot in self.lost:
                raise ActorFailed(f"slot {r.slot} crashed", slot=r.slot)
            self.slots[r.slot].put_nowait(env)
        except ActordError as e:  # a failed or stopped slot: answer here
            log.info("scheduler.slot_gone", slot=r.slot, error=e.to_dict())
            if reply is not None:
                if isinstance(answer, BaseException):
                    reply.fail(answer)
                elif answer is not None:
                    reply.send(answer)
                else:
                    reply.fail(e)

    def _result(self, r: Request, ch: _Channel, engine_s: float) -> CompletionResult:
        now = time.perf_counter()
        t_first = r.t_first or now
        prompt_ms = (t_first - ch.t_start) * 1e3
        predicted_ms = (now - t_first) * 1e3
        n_proc = r.n_prompt - r.n_cached
        assert r.text is not None
        return CompletionResult(
            content=r.text.text, tokens=list(r.out), n_prompt_tokens=r.n_prompt, n_prompt_processed=n_proc,
            n_cached=r.n_cached, slot=r.slot, stop_reason=r.reason or "", resumed_from_checkpoint=ch.resumed,
            logprobs=r.logprobs,
            timings=Timings(
                prompt_ms=prompt_ms, predicted_ms=predicted_ms,
                prompt_per_second=n_proc / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
                predicted_per_second=len(r.out) / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
                draft_n=r.n_drafted, draft_n_accepted=r.n_accepted, draft_steps=r.n_spec_steps,
                engine_ms=engine_s * 1e3,
            ),
        )

    # -- memory pressure ---------------------------------------------------------------

    async def _make_room(self, need: int, exclude: int | None = None) -> int:
        """Ask idle slots, least recently stepped first, to give up their cells."""
        core = self.core
        # Cells nobody else holds first: evicting a sequence whose cells another one shares
        # frees only its own part.
        victims = sorted((s for s, n in core.cells.items()
                          if n > 0 and s not in core.by_slot and s != exclude),
                         key=lambda s: (core.shared_of(s) > 0, core.last_use.get(s, 0), s))
        freed = 0
        self._busy_victim = False
        for s in victims:
            if freed >= need:
                break
            shared = core.shared_of(s)
            try:
                n, seq = await self.slots[s].ask(Evict(reason="kv"))
            except ActordError as e:  # it has work coming (busy), or it failed
                log.info("scheduler.evict_refused", slot=s, error=e.to_dict())
                self._busy_victim = self._busy_victim or isinstance(e, SlotBusy)
                continue
            if s not in core.by_slot and seq >= self.cells_seq.get(s, 0):
                # What the slot holds now (its Cells tell of this eviction is on its way;
                # anything it told before, still queued here, is older and is ignored).
                self.cells_seq[s] = seq
                core.cells[s] = 0
            freed += max(0, n - shared)
            self.metrics.kv_evictions_total.inc()
        if freed:
            log.info("scheduler.made_room", freed=freed, need=need, free=self.free_cells)
        return freed

    def _yield_or_park(self) -> None:
        if self._busy_victim:
            self.parked = True
            log.info("scheduler.parked", free=self.free_cells, cells=dict(self.core.cells))
        else:
            self._yield_youngest()

    def _yield_youngest(self) -> None:
        """Nothing can be freed and nothing can run: the youngest request gives way."""
        r = self.core.youngest()
        if r is None:
            return
        log.warning("scheduler.no_room", slot=r.slot, n_ctx=self.n_ctx, cells=dict(self.core.cells))
        if r.out:
            self._route(self.core.abort(r.rid, "context"))
        else:
            self._route(self.core.abort(r.rid, "error", ContextFull(
                f"no KV cells for slot {r.slot}'s prompt: the shared cache (n_ctx {self.n_ctx}) is held by "
                "requests in flight", slot=r.slot, n_ctx=self.n_ctx, n_prompt_tokens=r.n_prompt)))

    def on_crash(self, error: BaseException) -> None:
        """Every request the scheduler holds gets its one answer (the error)."""
        for ch in self.channels.values():
            if ch.reply is not None:
                ch.reply.fail(error)
        self.channels.clear()

    def stats(self) -> SchedulerStats:
        live = self.core.runnable()
        return SchedulerStats(
            enrolled=len(self.core.reqs), groups=len({r.genes for r in live}), steps=self.core.steps,
            group_switches=self.core.group_switches, in_flight=len(self._pending),
        )
