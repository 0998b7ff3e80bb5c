"""The stand-in engine keeps the real engine's contract (what bench/hot_path.py relies on):
the same jobs answer with the same result types, and the same bad jobs fail with the same
typed errors (a feed_last with nothing sampled, a stale epoch, a sequence out of range)."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.engine.engine import Engine, run_job
from actord.engine.thread import EngineThread
from actord.vocabulary.errors import ActordError
from actord.testing.fake_engine import FakeEngine

JOBS = [
    J.ModelInfo(),
    J.Tokenize(text="hello"),
    J.SetSampler(seq=0, params=J.SamplingParams()),
    J.Step(entries=[J.StepEntry(seq=0, tokens=[1, 5, 6], pos0=0, sample=True)]),
    J.Step(entries=[J.StepEntry(seq=0, tokens=[], pos0=3, sample=True, feed_last=True)]),
    J.Step(entries=[J.StepEntry(seq=1, tokens=[], pos0=0, sample=False, feed_last=True)]),  # nothing sampled
    J.Step(entries=[J.StepEntry(seq=0, tokens=[7], pos0=4, sample=True)], epoch=0),  # stale: epoch 1 now
    J.Step(entries=[J.StepEntry(seq=9, tokens=[7], pos0=0, sample=False)], epoch=1),  # out of range
    J.StateSize(seq=0),
    J.StateGet(seq=0),
    J.SeqRm(seq=0, p0=2, p1=-1),
    J.MemoryRange(seq=0),
    J.SeqCopy(src=0, dst=1),
    J.SeqCopy(src=1, dst=1),  # onto itself
    J.SeqCopy(src=0, dst=9),  # out of range
]


async def outcomes(factory, config) -> list[str]:
    t = EngineThread(lambda: factory(config), run_job, lambda e: e.close())
    await t.start()
    out = []
    try:
        for job in JOBS:
            try:
                out.append(type(await t.run(job)).__name__)
            except ActordError as e:
                out.append(e.type)
    finally:
        await t.stop()
    return out


@pytest.mark.anyio
async def test_the_stand_in_engine_answers_every_job_as_the_real_one_does(tiny_model):
    cfg = Config(model=tiny_model, slots=2, ctx=256)
    real = await outcomes(Engine, cfg)
    fake = await outcomes(FakeEngine, cfg)
    assert real == fake
    assert real[5:8] == ["InvalidParams", "StepSkipped", "InvalidParams"]
