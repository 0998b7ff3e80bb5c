"""A small actor kernel: typed bounded mailboxes, tell/ask, supervision, one dispatch seam.

Prior art: pykka (tell and ask kept apart, an envelope carrying the reply channel, pending
asks failing when an actor stops) and anyio's memory object streams (bounded: backpressure
is a feature). What we leave out: unbounded inboxes, untyped receive, a global registry.

Messages are msgspec Structs and pure data. The reply channel (and a streaming sink) travel
beside the message in an `Envelope`, never inside it, so every delivery can be encoded into
a trace. Every delivery goes through the `Dispatcher`: it is the single seam through which a
deterministic, recording dispatcher can take over the order of deliveries. Actors do not
start tasks themselves.

Asks flow one way. Actors have ranks: the mind placer (10) above the scheduler (20) above
the slots (30) above the page store, the checkpoint budget and the gene residency (40),
which sit above the engine thread and the storage workers (not actors). An actor may await
a reply only from an actor of a strictly greater rank; upward it tells, and the upper actor
acts on its own turn. `ask` refuses an upward or sideways ask at once (`AskOrderViolated`),
so the order holds by construction, not by review. Clients (RPC connections, host calls)
are not actors and may ask anyone.

What the order cannot see, the wait-for graph does: the dispatcher records who is awaiting
whom (an ask's reply, or room in a full mailbox) and refuses the wait that would close a
cycle (`AskCycle`, with the chain), the moment it would close. Every ask also has a bound:
past it the asker gets `AskTimeout` with the wait-for chain, logged, never a silent hang.

Two lanes. What clients send (RPC connections, host calls) is bounded per actor
(`capacity`): a client meets backpressure. What actors send each other (the control lane)
is never refused and never waits for room: an actor's messages are bounded by what it was
asked to do (one tell per step, per request end, per eviction), and an actor blocked on a
peer's full mailbox turns backpressure into wait-for cycles under a burst (a slot telling
the scheduler while the scheduler asks it).

Delivery order (`Actor.pick`): arrival order, except that a control message may overtake
client messages that arrived before it, at most `OVERTAKE` times in a row while one waits.
So an actor's own work (the scheduler's next step, a slot's `Ended`) is never queued behind
a flood of client calls (a full lane of 256 `MakeRoom` asks once made every step wait for
all of them), and the clients still get every other turn however busy the actor keeps
itself. A client message never overtakes a control message, so a tell an actor sent before
answering a client is still delivered before that client's next message; a control
message overtaking an older client message is safe, as nothing an actor sends can depend
on a client message that has not been delivered yet.

Supervision: a handler that raises an `ActordError` simply answers that ask with the error
(a refusal is not a crash). Any other exception is a crash: it is logged and counted, the
failing ask and every queued ask get `ActorFailed`, later asks fail at once, and the rest of
the system keeps running.
"""

from __future__ import annotations

import collections
import collections.abc
import contextvars
import math
from typing import Any, Awaitable, Callable, Generic, TypeVar

import anyio
import msgspec
from anyio.abc import TaskGroup

from actord.service.errors import ActordError, ActorFailed, AskCycle, AskOrderViolated, AskTimeout, ShuttingDown
from actord.service.log import get

log = get("actord.serving")

M = TypeVar("M")
StreamSink = Callable[[Any], Awaitable[None]]


# The actor whose handler is running in this task (None for clients: RPC, host calls).
CURRENT: contextvars.ContextVar["Actor[Any] | None"] = contextvars.ContextVar("actord_actor", default=None)

# The default bound on an ask between actors, in seconds (Config.ask_timeout_s sets it per
# system through the dispatcher).
ASK_BOUND_S = 600.0

# Control messages delivered in a row ahead of an older waiting client message (see the
# module docstring): 1 alternates the lanes while both are busy.
OVERTAKE = 1

# Bumped at every instrumented step (mailbox put, delivery, reply); a deterministic
# dispatcher reads it to tell when the system has gone quiet.
PROGRESS = [0]


class Reply:
    """A one-shot reply channel: exactly one value or one error, then it is spent."""

    __slots__ = ("_event", "_value", "_error", "done")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self.done = False

    def send(self, value: Any) -> None:
        if not self.done:
            PROGRESS[0] += 1
            self.done = True
            self._value = value
            self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            PROGRESS[0] += 1
            self.done = True
            self._error = error
            self._event.set()

    async def wait(self) -> Any:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Envelope(Generic[M]):
    __slots__ = ("msg", "reply", "stream", "seq", "counted", "answer", "overtakes", "client")

    def __init__(self, msg: M, reply: Reply | None = None, stream: StreamSink | None = None,
                 answer: Any = None) -> None:
        self.msg = msg
        self.reply = reply
        self.stream = stream
        self.seq = 0
        self.counted = False  # it holds a place in the client lane (see Actor._put)
        self.overtakes = False  # picked ahead of an older client message (see Actor.pick)
        self.client = False  # it came on the client lane (kept after delivery, for observers)
        # A value (or an exception) for `reply` that the receiver hands on once it has done
        # its part; like the reply channel it is never part of the message, so a trace of
        # deliveries does not depend on it (a result's timings differ run to run).
        self.answer = answer


class ActorStats(msgspec.Struct, frozen=True):
    name: str
    queued: int
    capacity: int
    delivered: int
    deferred: int
    failed: bool


DeliveryHook = Callable[["Actor[Any]", Envelope[Any]], None]
EventHook = Callable[[str, dict[str, Any]], None]


class Dispatcher:
    """Owns the tasks that run actor loops and observes every delivery.

    Hooks cost nothing when none is installed; a hook that raises is removed and logged
    rather than crashing the run (as trio treats its instruments).
    """

    def __init__(self) -> None:
        self._tg: TaskGroup | None = None
        self.hooks: list[DeliveryHook] = []
        self.event_hooks: list[EventHook] = []
        self.deliveries = 0
        self.ask_bound_s = ASK_BOUND_S
        # May an actor go on with its own loop while its mailbox is empty, rather than tell
        # itself to continue? (The scheduler's step loop does: one mailbox hop less per
        # step.) A deterministic dispatcher says no: every step is then a delivery it orders.
        self.loop_in_handler = True
        # Wait-for graph: actor name -> (the actor it awaits, what for). An actor runs one
        # handler at a time, so it waits on at most one other actor.
        self.waits: dict[str, tuple[str, str]] = {}
        self.cycles: list[list[str]] = []  # every cycle refused, for simulations to report
        self.order_violations: list[str] = []  # every upward or sideways ask refused, likewise

    # -- the wait-for graph ------------------------------------------------------------

    def chain(self, start: str) -> list[str]:
        """Who `start` waits on, transitively: [start, a, b, ...] (stops at a repeat)."""
        out = [start]
        node = start
        while node in self.waits:
            node = self.waits[node][0]
            if node in out:
                out.append(node)
                break
            out.append(node)
        return out

    def wait_begin(self, waiter: str, target: str, what: str) -> None:
        if target == waiter or target in self.waits and waiter in self.chain(target):
            cycle = [waiter, *self.chain(target)]
            cycle = cycle[: cycle.index(waiter, 1) + 1] if waiter in cycle[1:] else cycle
            self.cycles.append(cycle)
            log.error("actor.ask_cycle", cycle=" -> ".join(cycle), what=what)
            raise AskCycle(f"{waiter} awaiting {target} ({what}) would close a cycle: {' -> '.join(cycle)}",
                           cycle=cycle)
        self.waits[waiter] = (target, what)

    def wait_end(self, waiter: str) -> None:
        self.waits.pop(waiter, None)

    def bind(self, tg: TaskGroup) -> None:
        self._tg = tg

    def spawn(self, actor: "Actor[Any]") -> None:
        assert self._tg is not None, "dispatcher not bound to a task group"
        self._tg.start_soon(actor._run, name=f"actor:{actor.name}")

    def delivered(self, actor: "Actor[Any]", env: Envelope[Any]) -> None:
        PROGRESS[0] += 1
        self.deliveries += 1
        env.seq = self.deliveries
        for hook in list(self.hooks):
            try:
                hook(actor, env)
            except Exception as e:
                self.hooks.remove(hook)
                log.error("dispatcher.hook_removed", hook=repr(hook), error=repr(e))

    def event(self, kind: str, **fields: Any) -> None:
        """An event that is not a delivery: engine result, worker completion, input."""
        for hook in list(self.event_hooks):
            try:
                hook(kind, fields)
            except Exception as e:
                self.event_hooks.remove(hook)
                log.error("dispatcher.hook_removed", hook=repr(hook), error=repr(e))

    # -- seams a deterministic dispatcher overrides ------------------------------------

    async def actor_loop(self, actor: "Actor[Any]") -> None:
        async with actor._recv:
            while True:
                env = actor.take_next()
                if env is None:
                    try:
                        actor._arrived.append(await actor._recv.receive())
                    except anyio.EndOfStream:
                        return
                    continue
                await actor.deliver(env)

    async def engine_done(self, job: Any, value: Any, error: BaseException | None, n: int = -1) -> None:
        """Called in the waiting task once the engine thread finished `job`, the `n`th it ran."""
        if self.event_hooks:
            self.event("engine", job=job, value=value, error=error, n=n)

    async def offload(self, op: str, fn: Callable[..., Any], *args: Any, limiter: Any = None) -> Any:
        """Run blocking disk work on a worker thread (never the engine thread or the loop)."""
        try:
            result = await anyio.to_thread.run_sync(fn, *args, limiter=limiter)
        except BaseException as e:
            if self.event_hooks:
                self.event("worker", op=op, value=None, error=e)
            raise
        if self.event_hooks:
            self.event("worker", op=op, value=result, error=None)
        return result

    async def input(self, method: str, params: Any) -> None:
        """An external input (RPC request or host call) is about to enter the system."""
        if self.event_hooks:
            self.event("input", method=method, params=params)


class Actor(Generic[M]):
    """Subclasses implement `handle(msg, env)`; they match on the message type."""

    rank: int | None = None  # None: outside the order (test actors); see the module docstring

    def __init__(self, dispatcher: Dispatcher, name: str, capacity: int = 64) -> None:
        self.dispatcher = dispatcher
        self.name = name
        self.capacity = capacity
        # The queue itself is unbounded; the client lane's bound is `_mailbox_used` vs capacity.
        self._send, self._recv = anyio.create_memory_object_stream[Envelope[M]](math.inf)
        self._mailbox_used = 0
        self._mailbox_room = anyio.Event()
        # Received from the queue, not yet delivered, in arrival order (see `pick`).
        self._arrived: collections.deque[Envelope[M]] = collections.deque()
        self._overtakes = 0
        self.delivered = 0
        self.failed = False
        self.failure: BaseException | None = None
        self.on_failure: Callable[["Actor[Any]", BaseException], None] | None = None

    # -- sending -----------------------------------------------------------------------

    async def tell(self, msg: M, stream: StreamSink | None = None) -> None:
        await self._put(Envelope(msg, None, stream))

    async def ask(self, msg: M, stream: StreamSink | None = None, *, timeout: float | None = None) -> Any:
        """Send `msg` and await the reply, within `timeout` seconds (default: the system's bound)."""
        caller = CURRENT.get()
        what = type(msg).__name__
        if caller is not None:
            if caller.rank is not None and self.rank is not None and self.rank <= caller.rank:
                log.error("actor.ask_order_violated", asker=caller.name, target=self.name, msg=what)
                self.dispatcher.order_violations.append(f"{caller.name} asked {self.name} {what}")
                raise AskOrderViolated(
                    f"{caller.name} (rank {caller.rank}) may not await {self.name} (rank {self.rank}): "
                    "asks flow down the order; tell upward", asker=caller.name, target=self.name, msg=what)
            self.dispatcher.wait_begin(caller.name, self.name, what)
        bound = self.dispatcher.ask_bound_s if timeout is None else timeout
        try:
            reply = Reply()
            await self._put(Envelope(msg, reply, stream), waiting=False)  # the ask is the edge
            with anyio.fail_after(bound):
                return await reply.wait()
        except TimeoutError:
            chain = self.dispatcher.chain(caller.name) if caller is not None else ["client", *self.dispatcher.chain(self.name)]
            log.error("actor.ask_timeout", target=self.name, msg=what, bound_s=bound, chain=" -> ".join(chain))
            raise AskTimeout(f"no reply from {self.name} to {what} within {bound} s; waits: {' -> '.join(chain)}",
                             target=self.name, msg=what, chain=chain) from None
        finally:
            if caller is not None:
                self.dispatcher.wait_end(caller.name)

    async def forward(self, env: Envelope[M]) -> None:
        """Hand on an envelope (its reply channel and stream travel with it)."""
        await self._put(env)

    def tell_nowait(self, msg: M, stream: StreamSink | None = None) -> None:
        """An actor's tell on the control lane: never blocks, never refused for room."""
        self.put_nowait(Envelope(msg, None, stream))

    def put_nowait(self, env: Envelope[M]) -> None:
        """Queue an envelope on the control lane (an actor's message: see the module docstring)."""
        PROGRESS[0] += 1
        if self.failed:
            raise ActorFailed(f"actor {self.name} has failed", actor=self.name)
        try:
            self._send.send_nowait(env)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise ShuttingDown(f"actor {self.name} is stopped", actor=self.name) from None

    async def _put(self, env: Envelope[M], waiting: bool = True) -> None:
        if CURRENT.get() is not None:
            # From an actor: the control lane. Still a checkpoint, so a sender in a loop
            # lets the receiver run.
            self.put_nowait(env)
            await anyio.lowlevel.checkpoint()
            return
        PROGRESS[0] += 1
        if self.failed:
            raise ActorFailed(f"actor {self.name} has failed", actor=self.name)
        while self._mailbox_used >= self.capacity:  # a client waits for room
            if self._send._closed:
                raise ShuttingDown(f"actor {self.name} is stopped", actor=self.name)
            self._mailbox_room = self._mailbox_room if not self._mailbox_room.is_set() else anyio.Event()
            await self._mailbox_room.wait()
            if self.failed:
                raise ActorFailed(f"actor {self.name} has failed", actor=self.name)
        env.counted = env.client = True
        self._mailbox_used += 1
        try:
            self._send.send_nowait(env)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._mailbox_used -= 1
            raise ShuttingDown(f"actor {self.name} is stopped", actor=self.name) from None
        await anyio.lowlevel.checkpoint()

    def _left_lane(self, env: Envelope[M]) -> None:
        if env.counted:
            env.counted = False
            self._mailbox_used -= 1
            self._mailbox_room.set()

    # -- receiving ---------------------------------------------------------------------

    def drain(self) -> bool:
        """Move what the queue holds into `_arrived`; True once the queue is closed."""
        while True:
            try:
                self._arrived.append(self._recv.receive_nowait())
            except anyio.WouldBlock:
                return False
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return True

    def pick(self, queued: "collections.abc.Sequence[Envelope[M]]") -> int:
        """Which of `queued` (arrival order) to deliver next: the oldest, unless it is a
        client message and a control message waits behind it that may overtake it (at most
        OVERTAKE in a row). Pure: a deterministic dispatcher may ask again before it delivers."""
        first_client = first_control = None
        for i, env in enumerate(queued):
            if env.counted:
                if first_client is None:
                    first_client = i
            elif first_control is None:
                first_control = i
            if first_client is not None and first_control is not None:
                break
        if first_client is None or first_control is None or first_control < first_client:
            i = 0 if first_client is None or first_control is None else first_control
            queued[i].overtakes = False
            return i
        if self._overtakes < OVERTAKE:
            queued[first_control].overtakes = True
            return first_control
        queued[first_client].overtakes = False
        return first_client

    def take_next(self) -> Envelope[M] | None:
        """The next envelope to deliver (taken out), or None when nothing is queued."""
        self.drain()
        if not self._arrived:
            return None
        i = self.pick(self._arrived)
        env = self._arrived[i]
        del self._arrived[i]
        return env

    async def handle(self, msg: M, env: Envelope[M]) -> None:
        raise NotImplementedError

    async def on_start(self) -> None:
        """Runs on the event loop before the first delivery."""

    def on_crash(self, error: BaseException) -> None:
        """Fail whatever the actor holds beyond its mailbox (deferred asks, a request)."""

    def on_stop(self) -> None:
        """The mailbox is closed and drained: fail what is still held with ShuttingDown."""
        self.on_crash(ShuttingDown(f"actor {self.name} stopped", actor=self.name))

    async def _run(self) -> None:
        try:
            await self.on_start()
            await self.dispatcher.actor_loop(self)
        except BaseException as e:
            if not isinstance(e, Exception):
                # Cancelled (the system is going down) or killed: nobody waits on us in vain.
                self._stopped(ShuttingDown(f"actor {self.name} stopped", actor=self.name))
                raise
            self._crash(e, None)
        else:
            self.on_stop()

    def _stopped(self, error: ActordError) -> None:
        """The loop ended without a crash of ours: close the mailbox, fail every ask still
        queued and whatever the actor holds, so askers hear at once instead of at their bound."""
        self._send.close()
        self.drain()
        while self._arrived:
            env = self._arrived.popleft()
            self._left_lane(env)
            if env.reply is not None:
                env.reply.fail(error)
        self._mailbox_room.set()
        try:
            self.on_crash(error)
        except Exception as e:  # noqa: BLE001 - stopping must not raise over the cancellation
            log.error("actor.stop_failed", actor=self.name, error=repr(e))

    async def deliver(self, env: Envelope[M]) -> None:
        """Deliver one envelope now. The real loop calls it; so can a deterministic one."""
        self.delivered += 1
        if env.overtakes:
            self._overtakes += 1
        elif env.counted:
            self._overtakes = 0
        self._left_lane(env)
        self.dispatcher.delivered(self, env)
        CURRENT.set(self)
        try:
            await self.handle(env.msg, env)
        except ActordError as e:
            if env.reply is not None:
                env.reply.fail(e)
            else:
                log.warning("actor.refused_tell", actor=self.name, msg=type(env.msg).__name__, error=e.to_dict())
        except Exception as e:
            self._crash(e, env)
            raise
        except BaseException:  # cancelled mid-handler (the system is going down)
            if env.reply is not None:
                env.reply.fail(ShuttingDown(f"actor {self.name} stopped", actor=self.name))
            raise

    def _crash(self, error: BaseException, env: Envelope[M] | None) -> None:
        if self.failed:
            return
        self.failed = True
        self.failure = error
        log.error("actor.crashed", actor=self.name, error=repr(error))
        failed = ActorFailed(f"actor {self.name} crashed: {error!r}", actor=self.name)
        if env is not None and env.reply is not None:
            env.reply.fail(failed)
        self.drain()
        while self._arrived:
            queued = self._arrived.popleft()
            self._left_lane(queued)
            if queued.reply is not None:
                queued.reply.fail(failed)
        self._mailbox_room.set()  # clients waiting for room see the failure
        try:
            self.on_crash(failed)
        finally:
            if self.on_failure is not None:
                self.on_failure(self, error)
        self._send.close()

    def close(self) -> None:
        self._send.close()
        self._mailbox_room.set()

    def statistics(self) -> ActorStats:
        st = self._send.statistics()
        return ActorStats(
            name=self.name,
            queued=st.current_buffer_used + len(self._arrived),
            capacity=self.capacity,
            delivered=self.delivered,
            deferred=self.deferred_count(),
            failed=self.failed,
        )

    def deferred_count(self) -> int:
        return 0

    def mail_waiting(self) -> bool:
        # The stream's own buffer when anyio shows it (a statistics() object per call showed
        # on the scheduler's per-step path); its statistics otherwise.
        state = getattr(self._recv, "_state", None)
        buffer = getattr(state, "buffer", None)
        if buffer is not None:
            return len(buffer) > 0
        return self._recv.statistics().current_buffer_used > 0
