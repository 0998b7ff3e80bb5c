"""A request past its share of engine time ends with EngineTimeExceeded, and its peer in
the same steps goes on (issue 33). The stand-in engine says each step took a second, so
the budget is reached after a known number of steps: no clock is read by the test."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest

from actord.serving.kernel import Dispatcher
from actord.serving.messages import Enroll
from actord.serving.scheduler import Scheduler
from actord.vocabulary.errors import EngineTimeExceeded
from actord.vocabulary.metrics import Metrics
from tests.serving.test_busy_victim import InlineEngine, Relay

STEP_MS = 1000.0


class SlowSteps(InlineEngine):
    """The fake engine, each of its steps reported as taking STEP_MS to decode."""

    def _do(self, job: Any) -> tuple[bool, Any]:
        ok, out = super()._do(job)
        if ok and hasattr(out, "t_decode_ms"):
            out = msgspec.structs.replace(out, t_decode_ms=STEP_MS)
        return ok, out


async def _two_requests(budget_s: float) -> dict[str, Any]:
    disp = Dispatcher()
    eng = SlowSteps()
    slots = [Relay(disp, f"slot-{i}", 64) for i in range(2)]
    sched = Scheduler(disp, eng, slots, n_batch=64, metrics=Metrics(), depth=1, engine_budget_s=budget_s)
    eng.fake.samplers.update({0, 1})
    out: dict[str, Any] = {}

    async def ask(name: str, slot: int, n_predict: int) -> None:
        try:
            out[name] = await sched.ask(Enroll(rid=slot + 1, slot=slot, seq=slot, prompt=[1, 5, 9], pos0=0,
                                               n_predict=n_predict, ignore_eos=True))
        except EngineTimeExceeded as e:
            out[name] = e

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            disp.bind(tg)
            for a in (*slots, sched):
                disp.spawn(a)
            async with anyio.create_task_group() as asks:
                asks.start_soon(ask, "long", 0, 1000)
                asks.start_soon(ask, "short", 1, 2)
            for a in (*slots, sched):
                a.close()
    return out


@pytest.mark.anyio
async def test_a_request_past_its_engine_time_ends_typed_while_its_peer_finishes():
    # Both share each step (half a second each) until the short one ends after its 2
    # tokens; the long one then has whole steps, and ends on the step that takes it past 4 s.
    out = await _two_requests(budget_s=4.0)
    assert out["short"].stop_reason == "length" and len(out["short"].tokens) == 2
    e = out["long"]
    assert isinstance(e, EngineTimeExceeded) and e.data["budget_s"] == 4.0
    assert e.http_status == 429 and "request_engine_s" in e.message


@pytest.mark.anyio
async def test_without_a_budget_a_long_request_runs_to_its_end():
    out = await _two_requests(budget_s=0.0)
    assert len(out["long"].tokens) == 1000 and len(out["short"].tokens) == 2


async def _one(budget_s: float, engine_s: float) -> Any:
    disp = Dispatcher()
    eng = SlowSteps()
    slots = [Relay(disp, "slot-0", 64)]
    sched = Scheduler(disp, eng, slots, n_batch=64, metrics=Metrics(), depth=1, engine_budget_s=budget_s)
    eng.fake.samplers.update({0})
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            disp.bind(tg)
            for a in (*slots, sched):
                disp.spawn(a)
            try:
                out: Any = await sched.ask(Enroll(rid=1, slot=0, seq=0, prompt=[1, 5, 9], pos0=0, n_predict=3,
                                                  ignore_eos=True, continued=engine_s > 0, engine_s=engine_s))
            except EngineTimeExceeded as e:
                out = e
            for a in (*slots, sched):
                a.close()
    return out


@pytest.mark.anyio
async def test_a_generation_that_gave_its_slot_up_goes_on_with_its_one_engine_account():
    # 3 steps of a second each fit a 4 s budget from a fresh account, and its answer says
    # what it had; a continuation whose earlier parts had 2.5 s ends on its second step.
    fresh = await _one(budget_s=4.0, engine_s=0.0)
    assert len(fresh.tokens) == 3 and fresh.timings.engine_ms == pytest.approx(3000.0)
    rest = await _one(budget_s=4.0, engine_s=2.5)
    assert isinstance(rest, EngineTimeExceeded) and "4.5 s" in rest.message
