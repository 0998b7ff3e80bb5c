"""The Dispatcher: the one seam every delivery goes through, and the wait-for graph.

A deterministic, recording dispatcher (actord/replay/dispatcher.py) subclasses it to take over
the order of deliveries, engine completions, worker results and inputs. The wait-for graph
(who awaits whom) lets it refuse the wait that would close a cycle (`AskCycle`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import anyio
from anyio.abc import TaskGroup

from actord.service.errors import AskCycle
from actord.service.log import get
from actord.serving.kernel.mailbox import Envelope

if TYPE_CHECKING:
    from actord.serving.kernel.actor import Actor

log = get("actord.serving")

# The default bound on an ask between actors, in seconds (Config.ask_timeout_s sets it per
# system through the dispatcher).
ASK_BOUND_S = 600.0

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
        self.deliveries += 1
        env.seq = self.deliveries
        if self.hooks:
            _run_hooks(self.hooks, actor, env)

    def event(self, kind: str, **fields: Any) -> None:
        """An event that is not a delivery: engine result, worker completion, input."""
        _run_hooks(self.event_hooks, kind, fields)

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

    async def input(self, method: str, params: Any, tenant: str | None = None) -> None:
        """An external input (RPC request or host call) is about to enter the system, asked by
        `tenant` (the one a front vouched for; None: an embedded host's call)."""
        if self.event_hooks:
            self.event("input", method=method, params=params, tenant=tenant)


def _run_hooks(hooks: list[Any], *args: Any) -> None:
    """Call each hook; one that raises is removed and logged, never the run's end."""
    for hook in list(hooks):
        try:
            hook(*args)
        except Exception as e:
            hooks.remove(hook)
            log.error("dispatcher.hook_removed", hook=repr(hook), error=repr(e))
