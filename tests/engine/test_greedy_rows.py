"""A greedy-only chain's token is the argmax of its logit row, taken for every such entry at
once after the decode (Samplers.greedy_rows); a chain with anything more samples through
libllama. Both must pick the same tokens: here two sequences fed alike in one batch, one
greedy alone, one greedy behind a zero logit bias (a chain of two: the libllama path)."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.service.system import ActorSystem
from tests.engine.kept import engine_kept

pytestmark = pytest.mark.anyio


async def test_greedy_rows_pick_what_the_chain_picks(tiny_model, tmp_path):
    engines, factory = engine_kept()
    cfg = Config(model=tiny_model, slots=3, ctx=512, batch=64, page_dir=str(tmp_path), threads=1)
    async with ActorSystem(cfg, engine_factory=factory) as s:
        await s.engine.run(J.SetSampler(seq=0, params=J.SamplingParams()))
        await s.engine.run(J.SetSampler(seq=1, params=J.SamplingParams(logit_bias=((5, 0.0),))))
        await s.engine.run(J.SetSampler(seq=2, params=J.SamplingParams(temperature=0.8, seed=3)))
        assert engines[0].samplers.greedy == {0}
        prompt = [1, 17, 29, 33]
        # seq 2 (a sampled chain) sits between them: its row is skipped, not shifted
        out = await s.engine.run(J.Step(entries=[J.StepEntry(seq=q, tokens=prompt, pos0=0, sample=True)
                                                 for q in (0, 2, 1)]))
        got = {0: [out.entries[0].token], 1: [out.entries[2].token]}
        for i in range(24):
            entries = [J.StepEntry(seq=0, tokens=[], pos0=len(prompt) + i, sample=True, feed_last=True),
                       J.StepEntry(seq=2, tokens=[7], pos0=len(prompt) + i, sample=True),
                       J.StepEntry(seq=1, tokens=[got[1][-1]], pos0=len(prompt) + i, sample=True)]
            out = await s.engine.run(J.Step(entries=entries))
            got[0].append(out.entries[0].token)
            got[1].append(out.entries[2].token)
        assert got[0] == got[1]
        assert len(set(got[0])) > 1  # the model does not repeat one token: the rows were told apart


async def test_the_rows_are_found_after_a_mixed_batch(tiny_model, tmp_path):
    engines, factory = engine_kept()
    cfg = Config(model=tiny_model, slots=2, ctx=512, batch=64, page_dir=str(tmp_path), threads=1)
    async with ActorSystem(cfg, engine_factory=factory) as s:
        await s.engine.run(J.SetSampler(seq=0, params=J.SamplingParams()))
        e = engines[0]
        seen: list[object] = []
        rows = e.samplers.greedy_rows
        e.samplers.greedy_rows = lambda n: seen.append(rows(n)) or seen[-1]  # type: ignore[method-assign]
        # a prompt that does not sample, then one that does: one logit row
        await s.engine.run(J.Step(entries=[J.StepEntry(seq=1, tokens=[1, 2, 3], pos0=0, sample=False),
                                           J.StepEntry(seq=0, tokens=[1, 17, 29], pos0=0, sample=True)]))
        assert len(seen) == 1 and isinstance(seen[0], list) and len(seen[0]) == 1
