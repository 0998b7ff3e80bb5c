"""The engine thread: one dedicated OS thread that owns libllama, fed by a job queue.

Why not `anyio.to_thread.run_sync`: its threads are pooled, so two jobs could land on two
threads. We own one `threading.Thread` instead. The event loop never blocks on it: a job is
queued with a completion handle, the thread runs it and rings the loop's doorbell
(engine/doorbell.py: on asyncio an eventfd the loop reads, written without letting the GIL go;
on trio the token's `run_sync_soon`), without waiting for the loop to run the callback.
One ring serves however many jobs finished before the loop drained them.

A job whose class says `between_steps` runs at the next step boundary, ahead of steps
already queued: a slot's work on its own idle sequence (page_in, page_out, restore, a
resume's cut and sampler) and vocabulary lookups. A mind's page moves in, and a request
starts, while another slot's step runs, instead of after every step the scheduler had
planned before each of its jobs (up to `--pipeline-depth` steps per job: measured here, a
turn starting beside a decoding mind waited ~4 steps for its cut, sampler and page-in).
Safe because such a job touches only a sequence that no queued step holds, within cells the
scheduler granted before it was sent; everything else keeps submission order.

A finished decode step is announced to the loop right before the next step's decode, or,
at pipeline depth >= 3 on a fast device, goes with a later ring (`_announce`). The thread
runs on the CPUs actord/policy/cpus.py chose (by default, off the loop's).

Shutdown drains nothing it cannot finish: queued jobs behind the stop marker fail with
`ShuttingDown`, the engine frees its context and model on its own thread, and the thread
exits.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from typing import Any, Awaitable, Callable, Protocol

import anyio
import sniffio

from actord.engine.doorbell import Doorbell
from actord.engine.jobs import QUIET, Job, Sleep, Step
from actord.vocabulary.errors import ActordError, EngineError, ShuttingDown
from actord.vocabulary.log import get

log = get("actord.engine")

_STOP = object()
_WAKE = object()  # a between-steps job is waiting in `_urgent`


def _one_token_each(step: Step) -> bool:
    """A decode step: one token per entry (fed or sampled last step), no draft."""
    for e in step.entries:
        if len(e.tokens) + e.feed_last > 1 or e.draft:
            return False
    return True


class Announced(Protocol):
    """What the engine thread asks of the engine its factory builds: a hook the thread sets
    and the engine calls right before each llama_decode (`EngineThread._announce`)."""

    before_decode: Callable[[], None] | None


class _SubmittedJob:
    """One submitted job: the engine thread fills it, the loop side awaits it.

    The waiter is made only when someone waits before the job is done (most steps: the
    scheduler waits on the oldest one in flight), and on asyncio it is a bare future: an
    anyio.Event per job (a backend lookup and an asyncio.Event, then a future in its wait)
    showed on the per-step path."""

    __slots__ = ("job", "value", "error", "owner", "settled", "waiter", "n")

    def __init__(self, job: Job, owner: "EngineThread") -> None:
        self.job = job
        self.value: Any = None
        self.error: BaseException | None = None
        self.owner = owner
        self.settled = False  # its completion reached the loop
        self.n = -1  # its place in the engine thread's execution order (set as it starts)
        self.waiter: Any = None  # an asyncio future, else an anyio.Event

    def finish(self) -> None:  # engine thread
        self.owner._bell.ring(self)

    def _done(self) -> None:  # on the loop
        owner = self.owner
        self.settled = True
        owner.inflight -= 1
        w = self.waiter
        if w is not None:
            if owner._loop is None:
                w.set()
            elif not w.done():  # a cancelled waiter's future is done
                w.set_result(None)
        if owner.on_settled is not None:
            owner.on_settled()


class EngineThread:
    """Runs `factory()` on its own thread to build the engine, then serves jobs.

    `runner(engine, job)` executes one job; `closer(engine)` frees it at shutdown.
    """

    def __init__(
        self,
        factory: Callable[[], Announced],
        runner: Callable[[Any, Any], Any],
        closer: Callable[[Any], None],
        name: str = "actord-engine",
        defer_s: float = 0.0,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self._factory = factory
        self._runner = runner
        self._closer = closer
        # Two lanes under one condition: jobs in submission order, and between-steps jobs
        # (taken first at each job boundary).
        # Jobs in order on a C queue (cheap to put and to wake on); between-steps jobs also
        # go to `_urgent` (deque appends and pops are atomic) with a wake-up token in the
        # queue, and are taken first. A threading.Condition here cost ~10 us per step.
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._urgent: collections.deque[Any] = collections.deque()
        self._stash: collections.deque[Any] = collections.deque()  # engine side: jobs put aside for urgent ones
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._cpus = cpus  # the engine thread's CPU mask (actord/policy/cpus.py); None: inherited
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False
        self.ident: int | None = None
        self._held: _SubmittedJob | None = None  # a finished step whose completion waits (see _main)
        # How long a finished decode step's result may wait unannounced (`_announce`); 0: never.
        self._defer_s = defer_s
        self._unannounced_since = 0.0  # when the oldest deferred result was deferred (0: none)
        self._last_step_s = 0.0  # the last step's wall time: what the next one is expected to take
        self._running: Any = None  # the job the engine thread runs now
        self.deferred = 0  # results handed over without a ring of their own (a count)
        self.jobs_done = 0
        # Read by the loop (service/sleep.py), written only here: jobs that were not QUIET
        # (the idle clock's activity), and whether the engine sleeps after the last job.
        self.busy_jobs = 0
        self.asleep = False
        self.inflight = 0  # submitted jobs whose completion has not reached the loop yet
        self.started = 0  # jobs the engine thread has begun (their order: `_SubmittedJob.n`)
        # A replay's hold on the execution order (actord/replay/dispatcher.py, EngineOrder):
        # `gate.admit(job, p)` False keeps a job out of the queue until the gate enqueues
        # it; at the stop, `gate.drop()` hands back what it still holds.
        self.gate: Any = None
        self.on_done: Callable[[Any, Any, BaseException | None], Awaitable[None]] | None = None
        # Called on the loop as each job's completion arrives, however it ended and whether
        # or not anyone waits for it yet: a deterministic dispatcher waits on it for quiet.
        self.on_settled: Callable[[], None] | None = None
        self._loop: Any = None  # asyncio's running loop (its futures are the waiters), else None
        self._sleep0: Any = None  # asyncio.sleep on asyncio, else None (anyio's checkpoint)
        self._bell: Doorbell | None = None  # made by `start`, on the loop it wakes

    # -- loop side ---------------------------------------------------------------------

    async def start(self) -> None:
        # The loop that started the thread is the one its jobs wake (looked up once: a
        # step's hand-off is on the per-token path).
        self._bell = Doorbell(self._drain)
        if sniffio.current_async_library() == "asyncio":
            import asyncio

            self._loop, self._sleep0 = asyncio.get_running_loop(), asyncio.sleep
        self._thread.start()
        await anyio.to_thread.run_sync(self._ready.wait)
        if self._start_error is not None:
            self._bell.close()
            raise self._start_error

    def _drain(self) -> None:
        """On the loop: every job the engine thread has finished reaches its waiter."""
        bell = self._bell
        bell.armed = False  # before the pops: a job finished after this rings again
        done = bell.done
        while done:
            done.popleft()._done()

    async def run(self, job: Job) -> Any:
        return await self.wait(self.submit(job))

    def submit(self, job: Job) -> _SubmittedJob:
        """Queue a job without waiting: the scheduler keeps the next step queued behind the
        running one, so the engine thread goes from one step to the next without a loop
        round trip in between. Await it with `wait`, exactly once."""
        if self._stopping:
            raise ShuttingDown("engine is shutting down")
        p = _SubmittedJob(job, self)
        if self.gate is None or self.gate.admit(job, p):
            self.enqueue(job, p)
        return p

    def enqueue(self, job: Job, p: _SubmittedJob) -> None:
        """On the loop: put a job in the engine thread's queue (`submit`, or a gate later)."""
        self.inflight += 1
        if self._stopping:  # a gate letting a job go as the engine stops: answered, never run
            p.error = ShuttingDown("engine is shutting down")
            p._done()
            return
        if job.between_steps:
            self._urgent.append((job, p))
            self._q.put(_WAKE)
        else:
            self._q.put((job, p))

    async def wait(self, p: _SubmittedJob) -> Any:
        # A cancelled waiter does not cancel the job: libllama work is not interruptible,
        # and the actor that sent it re-synchronises from its own state.
        if p.settled:
            # A yield (and a cancellation point) as anyio's checkpoint makes one, without
            # its backend lookup on the per-step path (asyncio: its own sleep(0)).
            await (self._sleep0(0) if self._sleep0 is not None else anyio.lowlevel.checkpoint())
        elif self._loop is not None:
            p.waiter = self._loop.create_future()
            await p.waiter
        else:
            p.waiter = anyio.Event()
            await p.waiter.wait()
        if self.on_done is not None:
            await self.on_done(p.job, p.value, p.error, p.n)
        if p.error is not None:
            raise p.error
        return p.value

    async def stop(self) -> None:
        self._stopping = True
        if self.gate is not None:
            for job, p in self.gate.drop():  # held by a gate: answered, never run
                self.enqueue(job, p)
        if self._thread.is_alive():
            self._q.put(_STOP)
            await anyio.to_thread.run_sync(self._thread.join)
        bell = self._bell
        if bell is not None:
            self._drain()  # whatever the thread finished last (jobs failed at the stop marker)
            bell.close()

    @property
    def queued(self) -> int:
        return self._q.qsize() + len(self._urgent) + len(self._stash)

    def _next(self) -> Any:
        """The next job: a between-steps one first, else the oldest queued (engine thread)."""
        while True:
            if self._urgent:
                return self._urgent.popleft()
            if self._stash:
                return self._stash.popleft()
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                self._release_held()  # nothing to overlap with: the loop gets its result now
                item = self._q.get()
            if item is _WAKE:
                continue
            if self._urgent:  # one arrived meanwhile: it goes first, this one right after
                self._stash.append(item)
                continue
            return item

    def _more_waiting(self) -> bool:
        return bool(self._urgent or self._stash or self._q.qsize())

    # -- engine thread side ------------------------------------------------------------

    def _release_held(self) -> None:
        p, self._held = self._held, None
        if p is not None:
            self._unannounced_since = 0.0
            p.finish()

    def _announce(self) -> None:
        """Right before a step's decode (the engine's `before_decode`): the step before it
        goes to the loop, or, while the loop has nothing to do about it yet, waits to go
        with a later one.

        Why: ringing a sleeping loop costs the engine thread a wake-up per step (~11 us of a
        ~250 us step at 8 slots on the tiny model, in the write with the GIL held) and the
        loop a pass of its own. A result may wait while the step now starting is a decode of
        one token per sequence, another job is queued behind it (the engine has work the
        loop already planned: it does not starve while the loop sleeps), and the oldest
        waiting result plus one more step stays within `defer_s`. So on a fast device the
        loop wakes once per few steps and routes them together; a step of a slow one (tens of
        ms) is always announced at once; and a step after which the engine would idle rings,
        so the loop plans while this one decodes. A result deferred here always goes with the
        ring of the step now starting, at the latest: that step's own result is then held
        (released, so rung, before the next job or before the thread blocks) or finished."""
        p = self._held
        if p is None:
            return
        job = self._running
        # Behind it in submission order (a between-steps job, about to run, would delay it).
        if self._defer_s > 0.0 and isinstance(job, Step) and not self._urgent and self._q.qsize():
            now = time.perf_counter()
            since = self._unannounced_since or now
            if now - since + self._last_step_s < self._defer_s and _one_token_each(job):
                self._held = None
                self._unannounced_since = since
                self.deferred += 1
                self._bell.defer(p)
                return
        self._release_held()

    def _main(self) -> None:
        from actord.engine import llama

        self.ident = threading.get_ident()
        if self._cpus:
            try:  # this thread only (pid 0), before libllama starts its compute threads from it
                os.sched_setaffinity(0, self._cpus)
            except OSError as e:  # e.g. a CPU taken away since: run where the kernel puts us
                log.warning("engine.cpus_not_set", cpus=sorted(self._cpus), error=str(e))
        try:
            llama.claim_current_thread()
        except BaseException as e:
            self._start_error = e
            self._ready.set()
            return
        try:
            engine = self._factory()
            # A finished step's completion is held back while the next step is already
            # queued, and let go right before that step enters llama_decode (the engine calls
            # `before_decode`): the loop then routes step k while step k+1 runs without the
            # GIL, instead of both threads' Python contending for the GIL between two decodes.
            engine.before_decode = self._announce
        except BaseException as e:  # reported to start(), never swallowed
            self._start_error = e if isinstance(e, ActordError) else EngineError(f"engine start failed: {e}")
            llama.release_current_thread()
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                item = self._next()
                if item is _STOP:
                    break
                job, p = item
                p.n = self.started
                self.started += 1
                overlaps = job.overlaps
                if not overlaps:
                    self._release_held()  # (it rings for whatever waited with it)
                self._running = job
                t0 = time.perf_counter()
                try:
                    p.value = self._runner(engine, job)
                    self.jobs_done += 1
                    if overlaps:
                        self._last_step_s = time.perf_counter() - t0
                except BaseException as e:
                    # The loop side gets the typed error without this thread's frames: they
                    # hold the job (a gene load's whole image, a page's state) for as long as
                    # anyone keeps the error.
                    p.error = e.with_traceback(None) if isinstance(e, ActordError) else EngineError(str(e))
                    p.error.__cause__ = p.error.__context__ = None
                self._running = None
                if not isinstance(job, QUIET):
                    self.busy_jobs += 1
                    if self.asleep or isinstance(job, Sleep):
                        self.asleep = engine.asleep
                self._release_held()
                if overlaps and p.error is None and self._more_waiting():
                    self._held = p
                else:
                    self._unannounced_since = 0.0
                    p.finish()
                del item, job, p  # nor does an idle engine thread keep the last job alive
        finally:
            self._release_held()
            while True:  # fail whatever was queued behind the stop marker
                if self._urgent:
                    item = self._urgent.popleft()
                elif self._stash:
                    item = self._stash.popleft()
                else:
                    try:
                        item = self._q.get_nowait()
                    except queue.Empty:
                        break
                if item is not _STOP and item is not _WAKE:
                    item[1].error = ShuttingDown("engine stopped before this job ran")
                    item[1].finish()
            try:
                self._closer(engine)
            except Exception as e:
                log.error("engine.close_failed", error=str(e))
            llama.release_current_thread()
