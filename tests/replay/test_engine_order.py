"""A replay runs engine jobs in the order the recorded engine thread ran them.

Where a sequence's cells land depends on which jobs ran before (a cut frees cells the next
step fills), and a page lists its cells in cell order: the same tokens run in another order
make another page. The order results reach their waiters is not the order jobs ran (the
engine's between-steps lane overtakes queued steps; a step's result waits while the next
runs), so the trace says the order (`EngineDone.n`) and the replay keeps it."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.vocabulary.errors import ShuttingDown
from actord.replay.replay import replay
from actord.replay.dispatcher import EngineOrder
from actord.vocabulary.trace import EngineDone, digest
from actord.service.system import ActorSystem


class _Engine:
    """What EngineOrder needs of the engine thread: enqueue, and settled pendings."""

    def __init__(self) -> None:
        self.queued: list[object] = []

    def enqueue(self, job, p) -> None:
        self.queued.append(job)


class _P:
    settled = False


def _done(job, n: int) -> EngineDone:
    return EngineDone(job=type(job).__name__, digest=digest(job), result="-", n=n)


def test_jobs_submitted_out_of_the_recorded_order_are_queued_in_it_one_at_a_time():
    a, b, c = J.SeqRm(seq=1, p0=4), J.StateSize(seq=0), J.SeqRm(seq=0, p0=2)
    # The trace lists the results as their waiters saw them (b, a, c); they ran a, b, c.
    order = EngineOrder([_done(b, 8), _done(a, 7), _done(c, 9)])
    eng = order.engine = _Engine()
    pc, pb, pa = _P(), _P(), _P()
    assert order.admit(c, pc) is False and order.admit(b, pb) is False
    assert eng.queued == []  # a, which ran first, is not here yet
    assert order.admit(a, pa) is False
    assert eng.queued == [a]
    order.settled()  # a still out: nothing more goes
    assert eng.queued == [a]
    pa.settled = True
    order.settled()
    assert eng.queued == [a, b]
    pb.settled = True
    order.settled()
    assert eng.queued == [a, b, c]


def test_a_job_the_trace_has_no_place_for_is_not_held():
    order = EngineOrder([_done(J.StateSize(seq=0), 3)])
    order.engine = _Engine()
    assert order.admit(J.SeqRm(seq=1), _P()) is True  # unrecorded (or diverged): runs at once
    assert order.admit(J.StateSize(seq=0), _P()) is False
    assert order.admit(J.StateSize(seq=0), _P()) is True  # its one recorded place is taken


def test_a_job_held_for_its_turn_is_answered_when_the_engine_stops(tiny_model, tmp_path):
    async def run():
        order = EngineOrder([_done(J.StateSize(seq=1), 0), _done(J.StateSize(seq=0), 1)])
        async with ActorSystem(Config(model=tiny_model, slots=2, ctx=256, page_dir=str(tmp_path / "p"))) as s:
            order.engine, s.engine.gate = s.engine, order
            p = s.engine.submit(J.StateSize(seq=0))  # waits for seq 1's, which never comes
            with anyio.move_on_after(0.2):
                await s.engine.wait(p)
            assert not p.settled
        with pytest.raises(ShuttingDown):
            await s.engine.wait(p)

    anyio.run(run)


class _Overtaking:
    """A recording engine whose between-steps jobs overtake the step queued before them (as
    the engine's own lanes do when the step has not started yet): each step waits up to
    20 ms for such a job. A replay that ran jobs as they came would run the step first."""

    def __init__(self, engine) -> None:
        self.engine, self.held, self.overtaken = engine, [], 0

    def admit(self, job, p) -> bool:
        if isinstance(job, J.Step):
            self.flush()
            self.held.append((job, p))
            asyncio.get_running_loop().call_later(0.02, self.flush)
            return False
        if self.held and job.between_steps:
            self.overtaken += 1
            self.engine.enqueue(job, p)
            self.flush()
            return False
        return True

    def flush(self) -> None:
        for job, p in self.drop():
            self.engine.enqueue(job, p)

    def drop(self) -> list:
        held, self.held = self.held, []
        return held


def test_traces_whose_cuts_overtook_queued_steps_replay(tiny_model, tmp_path):
    """Slot 0's short turns cut back while slot 1's long ones step. Replayed in the order the
    jobs came, about one recording in four diverged at a page's state (measured: 5 of 22);
    in the recorded order, none (0 of 30)."""
    overtaken = 0
    for run_no in range(6):
        events: list = []

        async def run():
            nonlocal overtaken
            async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, page_dir=str(tmp_path / f"p{run_no}")),
                                   trace=events) as s:
                gate = s.engine.gate = _Overtaking(s.engine)

                async def client(slot: int) -> None:
                    for i in range(8 if slot == 0 else 3):  # a shared head, a new tail: each turn cuts
                        await s.complete(prompt=[1, 5 + slot, 9, 13 + i], n_predict=2 if slot == 0 else 20,
                                         slot=slot, ignore_eos=True)

                async with anyio.create_task_group() as tg:
                    for slot in (0, 1):
                        tg.start_soon(client, slot)
                s.engine.gate = None
                gate.flush()
                overtaken += gate.overtaken
                await s.page_out(0, "a")
                await s.page_out(1, "b")

        anyio.run(run)
        ns = [e.n for e in events if isinstance(e, EngineDone)]
        assert min(ns) >= 0 and len(set(ns)) == len(ns)
        r = anyio.run(replay, events, tiny_model)
        assert r.ok, (run_no, r)
    assert overtaken > 0, "no job overtook a step in the recordings"
