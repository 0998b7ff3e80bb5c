"""The engine thread announces a finished decode step to the loop, or lets it wait for a
later wake-up while the loop has nothing to do about it yet (engine/thread.py `_announce`),
and keeps to its CPUs (actord/policy/cpus.py).

What these pin: every result reaches its waiter, in order, whether or not it was rung for;
results wait only while another job is queued behind a one-token-per-entry decode and the
wait stays within `defer_s`; a step after which the engine would idle, a slow step, a
prompt step and a failed step are announced at once.
"""

from __future__ import annotations

import os
import threading
import time

import anyio
import pytest

from actord.engine import jobs as J
from actord.engine.thread import EngineThread
from actord.vocabulary.errors import EngineError

pytestmark = pytest.mark.anyio


class Device:
    """A stand-in engine: a step calls `before_decode` where llama_decode would start."""

    def __init__(self, decode_s: float = 0.001) -> None:
        self.before_decode = None
        self.decode_s = decode_s
        self.hold = threading.Event()
        self.hold.set()
        self.fail_epoch = -1
        self.blocked: dict[int, threading.Event] = {}  # a step that decodes until its event is set

    def run(self, job: J.Job) -> int:
        if isinstance(job, J.Step):
            if self.before_decode is not None:
                self.before_decode()
            self.hold.wait(10)
            if job.epoch in self.blocked:
                self.blocked[job.epoch].wait(10)
            time.sleep(self.decode_s)  # the decode's own duration: a "slow" step outlasts defer_s
            if job.epoch == self.fail_epoch:
                raise EngineError("decode failed", epoch=job.epoch)
            return job.epoch
        return -1


def decode(i: int) -> J.Step:
    return J.Step(entries=[J.StepEntry(seq=0, tokens=[], pos0=i, sample=True, feed_last=True)], epoch=i)


def prompt(i: int) -> J.Step:
    return J.Step(entries=[J.StepEntry(seq=0, tokens=[1, 2, 3, 4], pos0=0, sample=True)], epoch=i)


async def started(dev: Device, defer_s: float, **kw) -> tuple[EngineThread, list[int]]:
    t = EngineThread(lambda: dev, lambda e, job: e.run(job), lambda e: None, defer_s=defer_s, **kw)
    await t.start()
    rings: list[int] = []
    signal = t._bell._signal

    def counted() -> None:
        rings.append(1)
        signal()

    t._bell._signal = counted
    return t, rings


async def test_steps_queued_behind_each_other_share_wake_ups_and_every_result_arrives() -> None:
    dev = Device(decode_s=0.001)
    dev.hold.clear()  # the first step waits until all are queued
    t, rings = await started(dev, defer_s=0.5)
    try:
        pend = [t.submit(decode(i)) for i in range(8)]
        dev.hold.set()
        assert [await t.wait(p) for p in pend] == list(range(8))
        assert t.deferred >= 4 and len(rings) <= 8 - t.deferred
        assert t.inflight == 0
    finally:
        await t.stop()


async def test_results_are_rung_for_before_the_last_queued_step_decodes() -> None:
    """With nothing queued behind it, the engine would idle after this step unless the loop
    plans now: what waited goes to the loop before the step decodes, however long it takes."""
    dev = Device()
    dev.hold.clear()
    last = threading.Event()
    dev.blocked = {2: last}
    t, _ = await started(dev, defer_s=10.0)  # a bound that never runs out
    try:
        pend = [t.submit(decode(i)) for i in range(3)]
        dev.hold.set()
        with anyio.fail_after(5):
            assert [await t.wait(p) for p in pend[:2]] == [0, 1]
        assert t.deferred == 1 and not pend[2].settled  # step 0 waited for step 1's ring
        last.set()
        assert await t.wait(pend[2]) == 2
    finally:
        last.set()
        await t.stop()


@pytest.mark.parametrize("case", ["slow", "prompt", "off"])
async def test_slow_prompt_or_unbounded_steps_are_never_deferred(case: str) -> None:
    dev = Device(decode_s=0.02 if case == "slow" else 0.001)
    dev.hold.clear()
    t, rings = await started(dev, defer_s=0.0 if case == "off" else 0.01)
    try:
        make = prompt if case == "prompt" else decode
        pend = [t.submit(make(i)) for i in range(5)]
        dev.hold.set()
        assert [await t.wait(p) for p in pend] == list(range(5))
        assert t.deferred == 0
    finally:
        await t.stop()


async def test_a_failed_step_reaches_its_waiter_at_once() -> None:
    dev = Device()
    dev.hold.clear()
    dev.fail_epoch = 0
    t, _ = await started(dev, defer_s=10.0)
    try:
        pend = [t.submit(decode(i)) for i in range(4)]
        dev.hold.set()
        with pytest.raises(EngineError):
            await t.wait(pend[0])
        assert [await t.wait(p) for p in pend[1:]] == [1, 2, 3]
    finally:
        await t.stop()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs and Linux affinity")
async def test_the_engine_thread_runs_on_the_cpus_it_is_given() -> None:
    cpu = max(os.sched_getaffinity(0))
    t = EngineThread(Device, lambda e, job: frozenset(os.sched_getaffinity(0)), lambda e: None,
                     cpus=frozenset({cpu}))
    await t.start()
    try:
        assert await t.run(J.ModelInfo()) == {cpu}
        assert cpu in os.sched_getaffinity(0) and len(os.sched_getaffinity(0)) >= 2  # the loop's mask is its own
    finally:
        await t.stop()


async def test_waiting_results_go_to_the_loop_before_a_job_that_is_not_a_step() -> None:
    """A page move or a gene load queued behind the steps may take long: what waited is rung
    for before it starts, not after."""
    dev = Device()
    dev.hold.clear()
    slow = threading.Event()
    t, _ = await started(dev, defer_s=10.0)
    orig = dev.run

    def run(job: J.Job) -> int:
        if isinstance(job, J.GenePageIn):
            slow.wait(10)
        return orig(job)

    dev.run = run
    try:
        steps = [t.submit(decode(i)) for i in range(3)]
        move = t.submit(J.GenePageIn(id=1))
        dev.hold.set()
        with anyio.fail_after(5):
            assert [await t.wait(p) for p in steps] == [0, 1, 2]
        assert t.deferred >= 1 and not move.settled
        slow.set()
        assert await t.wait(move) == -1
    finally:
        slow.set()
        await t.stop()


async def test_a_result_deferred_on_a_stale_wake_up_token_still_reaches_the_loop() -> None:
    """A between-steps job's wake-up token stays queued after the job was taken from its own
    lane: a step's result deferred because of it must go before the engine thread sleeps."""
    dev = Device()
    dev.hold.clear()
    t, _ = await started(dev, defer_s=10.0)
    try:
        a, b = t.submit(decode(0)), t.submit(decode(1))
        urgent = t.submit(J.StateSize(seq=0))  # taken at the next boundary; its token stays behind
        dev.hold.set()
        with anyio.fail_after(5):  # nothing else is ever submitted: only the flush can deliver these
            assert await t.wait(urgent) == -1
            assert [await t.wait(a), await t.wait(b)] == [0, 1]
    finally:
        await t.stop()
