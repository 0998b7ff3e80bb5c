"""The Dispatcher: the one seam every delivery goes through, and the wait-for graph.

A deterministic, recording dispatcher (actord/replay/dispatcher.py) subclasses it to take over
the order of deliveries, engine completions, worker results and inputs. The wait-for graph
(who awaits whom) lets it refuse the wait that would close a cycle (`AskCycle`).

Every seam it overrides is a real member here, doing the plain thing (`attach_engine`,
`run_sync`, `go_on`, `close_actors`): the system calls them alike under either dispatcher,
never asking which one it holds. Tracing changes no path: a recorder is a hook, and the
one decision the timing of a run makes inside a handler (`go_on`: does mail wait?) is
recorded as the loop's input, so a replay answers it the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import anyio
from anyio.abc import TaskGroup

from actord.vocabulary.errors import AskCycle
from actord.vocabulary.log import get
from actord.serving.kernel.mailbox import Envelope


class Mailed(Protocol):
    """What a dispatcher is given of an actor (actor.py `Actor`): its name, its life to
    start, its plain mail loop, and whether mail waits for it."""

    name: str

    async def run(self) -> None: ...
    async def serve_mail(self) -> None: ...
    def mail_waiting(self) -> bool: ...


log = get("actord.serving")

# The default bound on an ask between actors, in seconds (Config.ask_timeout_s sets it per
# system through the dispatcher).
ASK_BOUND_S = 600.0

DeliveryHook = Callable[[Mailed, Envelope[Any]], None]
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

    def spawn(self, actor: Mailed) -> None:
        assert self._tg is not None, "dispatcher not bound to a task group"
        self._tg.start_soon(actor.run, name=f"actor:{actor.name}")

    def delivered(self, actor: Mailed, env: Envelope[Any]) -> None:
        self.deliveries += 1
        env.seq = self.deliveries
        if self.hooks:
            _run_hooks(self.hooks, actor, env)

    def event(self, kind: str, **fields: Any) -> None:
        """An event that is not a delivery: engine result, worker completion, input."""
        _run_hooks(self.event_hooks, kind, fields)

    # -- seams a deterministic dispatcher overrides ------------------------------------

    def attach_engine(self, engine: Any) -> None:
        """The system's engine thread, once made. A dispatcher that orders engine results
        counts its jobs in flight (replay/dispatcher.py); this one needs nothing of it."""

    async def run_sync(self, fn: Callable[..., Any], *args: Any, limiter: Any = None,
                       abandon_on_cancel: bool = False) -> Any:
        """Thread work that is no event of its own (a gene file read, a client's chat
        template): anyio.to_thread.run_sync here; a deterministic dispatcher counts it."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=abandon_on_cancel)

    def go_on(self, actor: Mailed) -> bool:
        """May `actor`, inside its handler, go on with its own loop (the scheduler's next
        step: one mailbox hop less per step) rather than tell itself to continue? Yes while
        no mail waits for it. Whether mail waits is the run's timing: a recorder writes the
        answer down (a `Loop` event), the input a replay gives back at the same turn."""
        waiting = actor.mail_waiting()
        if self.event_hooks:
            self.event("loop", actor=actor.name, mail=waiting)
        return not waiting

    def close_actors(self) -> None:
        """Shutdown: actor loops this dispatcher holds parked are let go (it parks none)."""

    async def actor_loop(self, actor: Mailed) -> None:
        await actor.serve_mail()

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
