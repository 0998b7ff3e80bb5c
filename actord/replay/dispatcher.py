"""A deterministic dispatcher: one event at a time, in an order a policy chooses.

Events are the only places where an actor system's interleaving can differ between runs:
a message delivered to an idle actor, an engine result handed back to its waiter, a worker
(disk) completion handed back, an external input let in. This dispatcher holds every one
of them until the system is quiet (no task can run, no engine or worker job is in flight),
then lets exactly one go, chosen by a policy: the recorded order (replay) or a seeded
random pick among the ready events (exploration, the way trio shuffles its run queue on
purpose so no code relies on an accidental order). Everything between two events runs
single-threaded on the loop, so a seed fixes the whole run.

Nor does trio's own shuffle of each batch of runnable tasks change it, and nothing here
seeds trio's generator (no public API does, python-trio/trio#2022): what one event sets
off is ordered at the next quiet point by what it is (held events sort by content, a
mailbox by the kernel's own pick). Measured: seeds 0-47, each run 3 to 10 times in one
process with trio's generator in a fresh random state, gave one trace per seed, except
seeds 1, 13 and 47, which vary as much on asyncio (a worker result that digests a page
file's inode and mtime: storage/files.py `signature`).

Quiet is detected exactly, in two halves.

- The loop: no task can run. On trio, `wait_all_tasks_blocked` is exact (trio wakes it only
  when its run queue is empty after an I/O poll). On asyncio anyio's version polls with
  0.1 s sleeps, so we yield one loop pass at a time and count what the loop has ready
  (`_ReadyCount`): a task that can run always has a callback queued through the loop's
  `call_soon` (its next step or its wakeup), and so does a callback that is about to wake
  one (a finished task's done callbacks, anyio's cancellation delivery), so none queued
  while we run means nothing else can. The count wraps the running loop's public
  `call_soon` when the system starts; it reads nothing private of the loop's.
- The threads: a task blocked on a thread looks exactly like an idle one, so every thread
  job the system awaits is counted from submit until its waiting task has resumed: engine
  jobs (`EngineThread.inflight`), disk work (`offload`) and untraced thread work such as a
  gene file read or a client's chat template (`run_sync`, which the system routes through
  here). Each resumption calls `_settle`, which sets the event quiesce waits on while a job
  is out, so no time passes between a job's end and the next look.

Timers are not activity: nothing in a run waits on a short timer (asks have bounds of
seconds), so a step that finds the system quiet with nothing ready returns False at once,
for nothing ever will be.

This replaced a progress counter (six `sleep(0)` rounds without an instrumented step, 0.2 ms
sleeps while a job was out, a 20 ms "longer look" when nothing was ready). It gave the same
event order, but it guessed that the counter saw every step, a simulation spent more than
half its wall time asleep in it, and its longer look hid the thread jobs nobody counted.
"""

from __future__ import annotations

import collections
import contextvars
import random
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import anyio
import sniffio

from actord.serving.kernel import Actor, Dispatcher, Envelope
from actord.vocabulary.errors import ShuttingDown
from actord.vocabulary.trace import (Deliver, EngineDone, Event, Header, Input, Loop, WorkerDone, canonical,
                                     deliver_event, digest)


# Who is asking: a simulated client sets it, so two identical inputs stay distinguishable.
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("actord_client", default="-")


class ReplayDiverged(Exception):
    """A replay reached an event its trace does not have next: the run diverged from the recording."""

    def __init__(self, position: int, expected: Any, available: list[Any]) -> None:
        super().__init__(f"divergence at event {position}: expected {expected}, available {available}")
        self.position, self.expected, self.available = position, expected, available


@dataclass
class Ready:
    kind: str  # "deliver" | "engine" | "worker" | "input"
    key: str  # actor name, job seq, op seq, client id: a stable sort key
    event: Event | None  # what it will look like in a trace (for matching)
    release: Callable[[], None]


class SeededPolicy:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def choose(self, ready: list[Ready], position: int) -> Ready:
        return ready[self.rng.randrange(len(ready))]

    def mail(self, actor: str, queued: bool) -> bool:
        """Does mail wait for `actor` (Dispatcher.go_on)? Here what is queued for it says."""
        return queued


class RecordedPolicy:
    """Follow a recorded trace; the first event that cannot be matched is a divergence."""

    def __init__(self, events: list[Event]) -> None:
        self.events = [e for e in events if isinstance(e, (Deliver, EngineDone, WorkerDone, Input))]
        self.i = 0
        # Each actor's recorded answers to go_on, in the order it asked: the asks are its
        # own program order, the same in a faithful replay whatever ran beside them.
        self.loops: dict[str, collections.deque[bool]] = {}
        for e in events:
            if isinstance(e, Loop):
                self.loops.setdefault(e.actor, collections.deque()).append(e.mail)
        header = events[0] if events else None
        # A version 2 trace was recorded with the in-handler loop off: mail always "waited".
        self.loop_off = isinstance(header, Header) and header.version < 3

    def mail(self, actor: str, queued: bool) -> bool:
        if self.loop_off:
            return True
        answers = self.loops.get(actor)
        return answers.popleft() if answers else queued

    @property
    def done(self) -> bool:
        return self.i >= len(self.events)

    def peek(self) -> Event | None:
        return self.events[self.i] if self.i < len(self.events) else None

    def choose(self, ready: list[Ready], position: int) -> Ready:
        want = self.peek()
        for r in ready:
            if want is not None and _matches(r, want):
                if isinstance(want, (EngineDone, WorkerDone)) and r.event.result != want.result:  # type: ignore[union-attr]
                    raise ReplayDiverged(position, want, [r.event])
                self.i += 1
                return r
        raise ReplayDiverged(position, want, [r.event for r in ready])


def _matches(r: Ready, want: Event) -> bool:
    ev = r.event
    if isinstance(want, Deliver):
        return isinstance(ev, Deliver) and ev == want
    if isinstance(want, EngineDone):  # the job must match; its result is checked on release
        return isinstance(ev, EngineDone) and ev.job == want.job and ev.digest == want.digest
    if isinstance(want, WorkerDone):
        return isinstance(ev, WorkerDone) and ev.op == want.op
    if isinstance(want, Input):
        return isinstance(ev, Input) and ev.method == want.method and ev.params == want.params
    return False


class EngineOrder:
    """A replay runs engine jobs in the order the recorded engine thread ran them.

    Cells go where the jobs before put them, and a sequence's state lists its cells in
    cell order: a page taken after two slots' steps and an erase ran in another order holds
    the same tokens in another layout, a different digest. The trace's engine events carry
    their execution order (`EngineDone.n`); a job submitted here takes the first unclaimed
    recorded place of the same job (name and digest) and is queued only once every
    recorded job before it has run and reached its waiter, one at a time, so the engine's
    own between-steps lane cannot reorder them either. A job the trace has no place for
    (its result never reached a waiter there, or it diverged) is queued at once; one whose
    predecessor never comes is never queued, and the policy reports the divergence.
    """

    def __init__(self, events: list[Event]) -> None:
        done = sorted((e for e in events if isinstance(e, EngineDone) and e.n >= 0), key=lambda e: e.n)
        self.places: dict[tuple[str, str], list[int]] = {}
        for i, e in enumerate(done):
            self.places.setdefault((e.job, e.digest), []).append(i)
        for v in self.places.values():
            v.reverse()  # popped from the end: the earliest first
        self.next = 0  # the next place to run
        self.parked: dict[int, tuple[Any, Any]] = {}
        self.running: Any = None  # the ordered job out on the engine thread
        self.engine: Any = None

    def admit(self, job: Any, p: Any) -> bool:
        free = self.places.get((type(job).__name__, digest(job)))
        if not free:
            return True
        self.parked[free.pop()] = (job, p)
        self._admit()
        return False

    def settled(self) -> None:
        if self.running is not None and self.running.settled:
            self.running = None
            self.next += 1
            self._admit()

    def _admit(self) -> None:
        if self.running is None and self.next in self.parked:
            job, p = self.parked.pop(self.next)
            self.running = p
            self.engine.enqueue(job, p)

    def drop(self) -> list[tuple[Any, Any]]:
        out, self.parked = list(self.parked.values()), {}
        return out


class _ReadyCount:
    """The callbacks an asyncio loop holds ready, counted through its public `call_soon`
    (every task step and wakeup, every future's done callback is queued through it). Timers
    and thread-safe callbacks are not counted: nothing waits on a short timer here, and
    thread jobs are counted from their submit (see the module docstring). One per loop
    (`of`): every dispatcher on it shares it, or a loop running many simulations would
    pass each callback through one wrapper per simulation."""

    _by_loop: "weakref.WeakKeyDictionary[Any, _ReadyCount]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, loop: Any) -> "_ReadyCount":
        count = cls._by_loop.get(loop)
        if count is None:
            count = cls._by_loop[loop] = cls(loop)
        return count

    def __init__(self, loop: Any) -> None:
        self.pending: set[Any] = set()  # handles queued and not yet run
        plain = loop.call_soon

        def call_soon(callback: Any, *args: Any, context: Any = None) -> Any:
            box: list[Any] = []
            handle = plain(self._run, box, callback, *args, context=context)
            box.append(handle)
            self.pending.add(handle)
            return handle

        loop.call_soon = call_soon

    def _run(self, box: list[Any], callback: Any, *args: Any) -> None:
        self.pending.discard(box[0])
        callback(*args)

    def busy(self) -> bool:
        """Is a callback other than the running one queued? (A cancelled one never runs.)"""
        if any(h.cancelled() for h in self.pending):
            self.pending = {h for h in self.pending if not h.cancelled()}
        return bool(self.pending)


class DeterministicDispatcher(Dispatcher):
    def __init__(self, policy: Any) -> None:
        super().__init__()
        self.policy = policy
        self.engine: Any = None  # EngineThread: its in-flight count (`attach_engine`)
        self.workers_inflight = 0  # thread jobs through offload and run_sync
        self._settled: anyio.Event | None = None  # set when a thread job's waiter resumes
        self._loop_callbacks: _ReadyCount | None = None  # asyncio's ready callbacks (None on trio)
        self._gates: dict[str, tuple[Actor[Any], anyio.Event]] = {}
        self._closed = False  # close_actors ran: the system is going
        self._handoff: dict[str, Envelope[Any] | None] = {}
        self.any_queued = isinstance(policy, RecordedPolicy)
        self._held: list[Ready] = []
        self.position = 0
        self.stopped = False
        self.live = False  # until the driver starts stepping, engine/worker/input events pass
        self.choices: list[str] = []
        self._shut = 0  # actors released because their mailbox closed (not a choice)
        self.order: EngineOrder | None = None  # a replay's engine execution order (set before the engine)

    def attach_engine(self, engine: Any) -> None:
        # The system hands us its engine thread; its waiters tell us when they resume.
        self.engine = engine
        engine.on_settled = self._settle
        if self.order is not None:
            self.order.engine = engine
            engine.gate = self.order

    def bind(self, tg: Any) -> None:
        super().bind(tg)
        if self._loop_callbacks is None and sniffio.current_async_library() == "asyncio":
            import asyncio

            self._loop_callbacks = _ReadyCount.of(asyncio.get_running_loop())

    def go_on(self, actor: Actor[Any]) -> bool:
        # Mail waiting here is what is queued for the actor, drained or not (ready() moves
        # a mailbox's contents aside at every quiet point); a replay's is the recorded answer.
        mail = self.policy.mail(actor.name, actor.statistics().queued > 0)
        if self.event_hooks:
            self.event("loop", actor=actor.name, mail=mail)
        return not mail

    # -- seams -------------------------------------------------------------------------

    async def actor_loop(self, actor: Actor[Any]) -> None:
        try:
            while True:
                ev = anyio.Event()
                self._gates[actor.name] = (actor, ev)
                if self._closed and actor.drain() and not actor.mail_queued():
                    # Back at its gate after close_actors (its last delivery was under way
                    # then), its mailbox closed and empty: nobody steps any more to let it go,
                    # and the system's exit would wait out its deadline (shutdown_grace_s + 5).
                    self._release_actor(actor.name, None)
                await ev.wait()
                env = self._handoff.pop(actor.name)
                if env is None:
                    return
                await actor.deliver(env)
        except BaseException:
            # Killed at the gate (a simulated crash, a cancelled system): an envelope released
            # to us and not delivered still gets its answer.
            self._gates.pop(actor.name, None)
            env = self._handoff.pop(actor.name, None)
            if env is not None and env.reply is not None:
                env.reply.fail(ShuttingDown(f"actor {actor.name} stopped", actor=actor.name))
            raise

    async def _hold(self, kind: str, event: Event | None) -> None:
        if not self.live:
            return
        gate = anyio.Event()
        # The key is what the event is (and who asks), never when it arrived: arrival order
        # within one step can depend on a backend's run-queue order.
        key = f"{CLIENT.get()}:{digest(event)}"
        self._held.append(Ready(kind, key, event, gate.set))
        await gate.wait()

    async def engine_done(self, job: Any, value: Any, error: BaseException | None, n: int = -1) -> None:
        ev = EngineDone(job=type(job).__name__, digest=digest(job),
                        result=digest(error if error is not None else value))
        await self._hold("engine", ev)
        await super().engine_done(job, value, error, n)

    async def offload(self, op: str, fn: Callable[..., Any], *args: Any, limiter: Any = None) -> Any:
        try:
            result, error = await self.run_sync(fn, *args, limiter=limiter), None
        except Exception as e:
            result, error = None, e
        await self._hold("worker", WorkerDone(op=op, result=digest(error if error is not None else result)))
        if self.event_hooks:
            self.event("worker", op=op, value=result, error=error)
        if error is not None:
            raise error
        return result

    async def run_sync(self, fn: Callable[..., Any], *args: Any, limiter: Any = None,
                       abandon_on_cancel: bool = False) -> Any:
        """Thread work that is no event of its own (a gene file read, a client's chat
        template): it leaves no trace line, but quiet must wait for it all the same."""
        self.workers_inflight += 1
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=abandon_on_cancel)
        finally:
            self.workers_inflight -= 1
            self._settle()

    async def input(self, method: str, params: Any, tenant: str | None = None) -> None:
        import msgspec

        # As the recorder writes it (paths relative to their folders), or a replay could never
        # match an input that names a file beside the model (a gene.load).
        await self._hold("input", Input(method=method, params=canonical(msgspec.to_builtins(params)), tenant=tenant))
        await super().input(method, params, tenant)

    # -- the loop ------------------------------------------------------------------------

    async def quiesce(self) -> None:
        """Return once no task can run and no thread job is in flight."""
        while True:
            await self._loop_blocked()
            if not (self.workers_inflight or (self.engine is not None and self.engine.inflight)):
                return
            # Only a job's end can change anything now: its waiter resumes on the loop and
            # calls _settle (no await between this check and the wait, so none is missed).
            self._settled = anyio.Event()
            await self._settled.wait()

    def _settle(self) -> None:
        if self.order is not None:
            self.order.settled()
        if self._settled is not None:
            self._settled.set()

    async def _loop_blocked(self) -> None:
        """Return when every other task on the loop is blocked (see the module docstring)."""
        ready = self._loop_callbacks
        if ready is None:  # trio
            await anyio.wait_all_tasks_blocked()
            return
        await anyio.lowlevel.checkpoint()
        # The loop took our own callback off the queue to run us: whatever is left is another
        # task's step or wakeup, or a callback that leads to one.
        while ready.busy():
            await anyio.lowlevel.checkpoint()

    def ready(self) -> list[Ready]:
        out = list(self._held)
        for name in sorted(self._gates):
            actor, gate = self._gates[name]
            closed = actor.drain()  # everything already queued for this actor, in arrival order
            queue = actor.mail_queued()
            if not queue:
                if closed:
                    self._release_actor(name, None)  # shutdown is not a choice
                    self._shut += 1
                continue
            # Seeded exploration delivers in the kernel's own order (Actor.pick). A replay may
            # take any queued message: in the recorded run, puts from concurrent handlers
            # could land in another order.
            picks = range(len(queue)) if self.any_queued else [actor.pick(queue)]
            for idx in picks:
                env = queue[idx]
                out.append(Ready("deliver", f"{name}:{idx:04d}", deliver_event(actor, env),
                                 lambda n=name, e=env: self._deliver(n, e)))
        out.sort(key=lambda r: (r.kind, r.key))
        return out

    def _release_actor(self, name: str, env: Envelope[Any] | None) -> None:
        _, gate = self._gates.pop(name)
        self._handoff[name] = env
        gate.set()

    def _deliver(self, name: str, env: Envelope[Any]) -> None:
        self._gates[name][0].mail_taken(env)
        self._release_actor(name, env)

    async def step(self) -> bool:
        """Let one event go. False when the system is quiet and nothing is ready: then
        nothing ever will be."""
        while True:
            await self.quiesce()
            shut = self._shut
            ready = self.ready()
            # An actor let go because its mailbox closed runs its stop (failing what it
            # held, answering clients): that can make events, so look again once it is done.
            if ready or self._shut == shut:
                break
        if not ready:
            return False
        pick = self.policy.choose(ready, self.position)
        if pick.kind != "deliver":
            self._held.remove(pick)
        self.position += 1
        self.choices.append(f"{pick.kind}:{pick.key}")
        pick.release()
        return True

    def close_actors(self) -> None:
        """Shutdown: end every actor loop parked at its gate (and, in `actor_loop`, each one
        that comes back to it with nothing left to deliver)."""
        self._closed = True
        for name in list(self._gates):
            self._release_actor(name, None)
