"""The engine thread runs a between-steps job (an idle slot's state move: page_in, page_out)
at the next step boundary, ahead of steps already queued, and everything else in order."""

from __future__ import annotations

import threading

import anyio
import pytest

from actord.engine import jobs as J
from actord.engine.thread import EngineThread
from tests.waits import eventually, wait_until

pytestmark = pytest.mark.anyio


class Recorder:
    def __init__(self) -> None:
        self.order: list[str] = []
        self.gate = threading.Event()
        self.running = threading.Event()  # the first step is in `run`, held at the gate
        self.before_decode = None  # the hook the engine thread sets (engine/thread.py Announced)

    def run(self, job: J.Job) -> str:
        if isinstance(job, J.Step) and not self.order:
            self.running.set()
            self.gate.wait(10)  # the running step: everything else queues behind it
        name = type(job).__name__ + (f"{job.epoch}" if isinstance(job, J.Step) else "")
        self.order.append(name)
        return name


def test_idle_sequence_work_is_between_steps_and_nothing_else_is() -> None:
    idle = (J.StateSize, J.StateGet, J.StateSet, J.SeqRm, J.SetSampler, J.MemoryRange, J.Tokenize,
            J.Detokenize, J.Pieces)
    assert all(c.between_steps for c in idle)
    assert not any(c.between_steps for c in (J.Step, J.GenePageIn, J.GenePageOut, J.GeneLoad,
                                                                  J.FreeSampler, J.Fail, J.StepRecords))


async def test_a_page_in_jumps_the_steps_already_queued() -> None:
    rec = Recorder()
    t = EngineThread(lambda: rec, lambda e, job: e.run(job), lambda e: None)
    await t.start()
    try:
        pend = [t.submit(J.Step(entries=[], epoch=i)) for i in (1, 2, 3)]  # step 1 runs, 2 and 3 wait
        await eventually(rec.running.is_set, "step 1 running")
        pend.append(t.submit(J.GenePageIn(id=1)))  # in order, behind the steps
        pend.append(t.submit(J.StateSet(seq=1, data=b"x")))  # the page_in: next boundary
        pend.append(t.submit(J.StateGet(seq=1)))
        rec.gate.set()
        for p in pend:
            await t.wait(p)
        assert rec.order == ["Step1", "StateSet", "StateGet", "Step2", "Step3", "GenePageIn"]
    finally:
        await t.stop()


async def test_jobs_finished_while_the_loop_is_busy_all_reach_their_waiters() -> None:
    """One ring of the doorbell serves every job finished before the loop drains; a job
    finished after a drain rings again (engine/doorbell.py `Doorbell`)."""
    t = EngineThread(Recorder, lambda e, job: job.text, lambda e: None)
    await t.start()
    try:
        pend = [t.submit(J.Tokenize(text=str(i))) for i in range(50)]
        # The loop is blocked (a wait that does not yield): the engine finishes them all meanwhile.
        wait_until(lambda: t.jobs_done == 50, "the engine finishes the 50 jobs", timeout=10, every=0.001)
        assert [await t.wait(p) for p in pend] == [str(i) for i in range(50)]
        for i in range(20):  # one at a time: each finishes after the previous drain
            assert await t.run(J.Tokenize(text=f"again {i}")) == f"again {i}"
        assert t.inflight == 0
    finally:
        await t.stop()


async def test_a_cancelled_waiter_leaves_the_job_to_finish_and_the_next_wait_works() -> None:
    gate = threading.Event()

    def run(e: object, job: J.Job) -> str:
        if isinstance(job, J.Step):
            gate.wait(10)
        return type(job).__name__

    t = EngineThread(Recorder, run, lambda e: None)
    await t.start()
    try:
        p = t.submit(J.Step(entries=[]))
        with anyio.move_on_after(0.01):
            await t.wait(p)  # cancelled: the step goes on
        gate.set()
        assert await t.run(J.ModelInfo()) == "ModelInfo"
        assert p.settled and p.value == "Step" and t.inflight == 0
    finally:
        await t.stop()
