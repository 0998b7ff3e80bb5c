"""A deterministic dispatcher: one event at a time, in an order a policy chooses.

Events are the only places where an actor system's interleaving can differ between runs:
a message delivered to an idle actor, an engine result handed back to its waiter, a worker
(disk) completion handed back, an external input let in. This dispatcher holds every one
of them until the system is quiet (no task can run, no engine or worker job is in flight),
then lets exactly one go, chosen by a policy: the recorded order (replay) or a seeded
random pick among the ready events (exploration, the way trio shuffles its run queue on
purpose so no code relies on an accidental order). Everything between two events runs
single-threaded on the loop, so a seed fixes the whole run.

Quiet is detected with a progress counter bumped at every instrumented step (mailbox put,
delivery, reply) and the engine/worker in-flight counts: the loop is yielded until the
counter stops moving for a few rounds with nothing in flight.
"""

from __future__ import annotations

import contextvars
import random
from dataclasses import dataclass
from typing import Any, Callable

import anyio

from actord.actors.base import PROGRESS, Actor, Dispatcher, Envelope
from actord.replay.trace import Deliver, EngineDone, Event, Input, WorkerDone, deliver_event, digest


# Who is asking: a simulated client sets it, so two identical inputs stay distinguishable.
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("actord_client", default="-")


class Divergence(Exception):
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


class RecordedPolicy:
    """Follow a recorded trace; the first event that cannot be matched is a divergence."""

    def __init__(self, events: list[Event]) -> None:
        self.events = [e for e in events if isinstance(e, (Deliver, EngineDone, WorkerDone, Input))]
        self.i = 0

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
                    raise Divergence(position, want, [r.event])
                self.i += 1
                return r
        raise Divergence(position, want, [r.event for r in ready])


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


class DeterministicDispatcher(Dispatcher):
    def __init__(self, policy: Any, *, quiet_rounds: int = 6) -> None:
        super().__init__()
        self.policy = policy
        self.quiet_rounds = quiet_rounds
        self.engine: Any = None  # EngineThread: its in-flight count
        self.workers_inflight = 0
        self._gates: dict[str, tuple[Actor[Any], anyio.Event]] = {}
        self._handoff: dict[str, Envelope[Any] | None] = {}
        self._peeked: dict[str, list[Envelope[Any]]] = {}
        self.any_queued = isinstance(policy, RecordedPolicy)
        self._held: list[Ready] = []
        self._seq = 0
        self.position = 0
        self.stopped = False
        self.live = False  # until the driver starts stepping, engine/worker/input events pass
        self.reseed: Callable[[int], None] | None = None  # per-step reseed of a backend's shuffle
        self.choices: list[str] = []

    # -- seams -------------------------------------------------------------------------

    async def actor_loop(self, actor: Actor[Any]) -> None:
        while True:
            ev = anyio.Event()
            self._gates[actor.name] = (actor, ev)
            await ev.wait()
            env = self._handoff.pop(actor.name)
            if env is None:
                return
            await actor.deliver(env)
            PROGRESS[0] += 1

    async def _hold(self, kind: str, event: Event | None) -> None:
        if not self.live:
            return
        gate = anyio.Event()
        # The key is what the event is (and who asks), never when it arrived: arrival order
        # within one step can depend on a backend's run-queue order.
        key = f"{CLIENT.get()}:{digest(event)}"
        self._held.append(Ready(kind, key, event, gate.set))
        PROGRESS[0] += 1
        await gate.wait()

    async def engine_done(self, job: Any, value: Any, error: BaseException | None) -> None:
        ev = EngineDone(job=type(job).__name__, digest=digest(job),
                        result=digest(error if error is not None else value))
        await self._hold("engine", ev)
        await super().engine_done(job, value, error)

    async def offload(self, op: str, fn: Callable[..., Any], *args: Any, limiter: Any = None) -> Any:
        self.workers_inflight += 1
        try:
            try:
                result, error = await anyio.to_thread.run_sync(fn, *args, limiter=limiter), None
            except Exception as e:
                result, error = None, e
        finally:
            self.workers_inflight -= 1
        await self._hold("worker", WorkerDone(op=op, result=digest(error if error is not None else result)))
        if self.event_hooks:
            self.event("worker", op=op, value=result, error=error)
        if error is not None:
            raise error
        return result

    async def input(self, method: str, params: Any) -> None:
        import msgspec

        await self._hold("input", Input(method=method, params=msgspec.to_builtins(params)))
        await super().input(method, params)

    # -- the loop ------------------------------------------------------------------------

    async def quiesce(self) -> None:
        quiet = 0
        while quiet < self.quiet_rounds:
            before = PROGRESS[0]
            busy = self.workers_inflight or (self.engine is not None and self.engine.inflight)
            if busy:
                quiet = 0
                await anyio.sleep(0.0002)
                continue
            await anyio.sleep(0)
            quiet = quiet + 1 if PROGRESS[0] == before else 0

    def ready(self) -> list[Ready]:
        out = list(self._held)
        for name in sorted(self._gates):
            actor, gate = self._gates[name]
            queue = self._peeked.setdefault(name, [])
            closed = False
            while True:  # everything already queued for this actor, in arrival order
                try:
                    queue.append(actor._recv.receive_nowait())
                except anyio.WouldBlock:
                    break
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    closed = True
                    break
            if not queue:
                if closed:
                    self._release_actor(name, None)  # shutdown is not a choice
                continue
            # Seeded exploration keeps mailboxes FIFO. A replay may take any queued message:
            # in the recorded run, puts from concurrent handlers could land in another order.
            for idx, env in enumerate(queue if self.any_queued else queue[:1]):
                out.append(Ready("deliver", f"{name}:{idx:04d}", deliver_event(actor, env),
                                 lambda n=name, e=env: self._deliver(n, e)))
        out.sort(key=lambda r: (r.kind, r.key))
        return out

    def _release_actor(self, name: str, env: Envelope[Any] | None) -> None:
        _, gate = self._gates.pop(name)
        self._handoff[name] = env
        gate.set()

    def _deliver(self, name: str, env: Envelope[Any]) -> None:
        self._peeked[name].remove(env)
        self._release_actor(name, env)

    async def step(self) -> bool:
        """Let one event go. False when nothing is ready (after a longer look)."""
        if self.reseed is not None:
            self.reseed(self.position)
        await self.quiesce()
        ready = self.ready()
        for _ in range(20):
            if ready:
                break
            await anyio.sleep(0.001)
            await self.quiesce()
            ready = self.ready()
        if not ready:
            return False
        pick = self.policy.choose(ready, self.position)
        if pick.kind != "deliver":
            self._held.remove(pick)
        self.position += 1
        self.choices.append(f"{pick.kind}:{pick.key}")
        pick.release()
        return True

    async def run_until_idle(self) -> None:
        while await self.step():
            pass

    def close_actors(self) -> None:
        """Shutdown: end every actor loop parked at its gate."""
        for name in list(self._gates):
            self._release_actor(name, None)
