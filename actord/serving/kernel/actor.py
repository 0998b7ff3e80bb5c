"""The Actor: a mailbox with two lanes, delivery in a fair order, tell/ask, supervision.

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

Asks flow down the ranks (the kernel's docstring, `actord/serving/kernel/`): `ask` refuses
an upward or sideways one at once, and every ask has a bound.

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
from typing import Any, Callable, Generic

import anyio
import msgspec

from actord.vocabulary.errors import ActordError, ActorFailed, AskOrderViolated, AskTimeout, ShuttingDown
from actord.vocabulary.log import get
from actord.serving.kernel.dispatcher import Dispatcher
from actord.serving.kernel.mailbox import Envelope, M, Reply, StreamSink

log = get("actord.serving")

# The actor whose handler is running in this task (None for clients: RPC, host calls).
CURRENT: contextvars.ContextVar["Actor[Any] | None"] = contextvars.ContextVar("actord_actor", default=None)

# Control messages delivered in a row ahead of an older waiting client message (see the
# module docstring): 1 alternates the lanes while both are busy.
OVERTAKE = 1


class ActorStats(msgspec.Struct, frozen=True):
    name: str
    queued: int
    capacity: int
    delivered: int
    deferred: int
    failed: bool



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

    def mail_queued(self) -> "collections.abc.Sequence[Envelope[M]]":
        """What arrived and is not delivered yet, in arrival order (after `drain`): a
        deterministic dispatcher chooses among it (`pick`, `mail_taken`)."""
        return self._arrived

    def mail_taken(self, env: Envelope[M]) -> None:
        """`env`, one of `mail_queued()`, is being delivered: out of the queue."""
        self._arrived.remove(env)

    async def serve_mail(self) -> None:
        """The plain loop (kernel dispatcher's `actor_loop`): deliver in `pick` order, waiting
        for the next arrival when none is queued, until the mailbox is closed and drained."""
        async with self._recv:
            while True:
                env = self.take_next()
                if env is None:
                    try:
                        self._arrived.append(await self._recv.receive())
                    except anyio.EndOfStream:
                        return
                    continue
                await self.deliver(env)

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

    async def run(self) -> None:
        """The actor's life, started by its dispatcher (`spawn`): its start, its loop, its end."""
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
        self._fail_queued(error)
        try:
            self.on_crash(error)
        except Exception as e:  # noqa: BLE001 - stopping must not raise over the cancellation
            log.error("actor.stop_failed", actor=self.name, error=repr(e))

    def _fail_queued(self, error: ActordError) -> None:
        """Fail every ask still in the mailbox with `error`; clients waiting for room see it too."""
        self.drain()
        while self._arrived:
            env = self._arrived.popleft()
            self._left_lane(env)
            if env.reply is not None:
                env.reply.fail(error)
        self._mailbox_room.set()

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
        self._fail_queued(failed)
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

