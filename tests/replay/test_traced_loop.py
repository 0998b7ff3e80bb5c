"""Tracing changes no path (issue 36): a recorded run steps on inside the scheduler's handler
as an unrecorded one does, and the trace holds that loop's input (`Loop`: did mail wait?),
so a replay answers it the same way instead of forcing every step through the mailbox."""

from __future__ import annotations

import anyio

from actord.replay.replay import replay
from actord.vocabulary.config import Config
from actord.service.system import ActorSystem
from actord.vocabulary.trace import Deliver, EngineDone, Loop


def test_a_traced_run_steps_on_in_the_handler_and_its_trace_replays(tiny_model, tmp_path):
    events: list = []

    async def run():
        async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, page_dir=str(tmp_path / "p")),
                               trace=events) as s:
            await s.complete(prompt=[1, 5, 9, 13], n_predict=24, slot=0, ignore_eos=True)

    anyio.run(run)
    steps = sum(1 for e in events if isinstance(e, EngineDone) and e.job == "Step")
    run_steps = sum(1 for e in events if isinstance(e, Deliver) and e.msg == "RunStep")
    went_on = sum(1 for e in events if isinstance(e, Loop) and e.actor == "scheduler" and not e.mail)
    assert steps >= 24 and went_on > 0
    assert run_steps < steps  # not one mailbox hop per step, as when tracing turned the loop off
    r = anyio.run(replay, events, tiny_model)
    assert r.ok, r
