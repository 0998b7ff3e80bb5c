"""The prompt's last logits, kept (engine/step.py `Stepper.memo`): a MEMO_REUSE entry whose
sequence still holds the cells that gave them samples from them with no decode; any job that
cuts or replaces those cells drops them, and the entry then decodes its token again in place
of the kept cell (never a second cell at that position)."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.service.system import ActorSystem
from tests.engine.kept import engine_kept

pytestmark = pytest.mark.anyio

PROMPT = [1, 17, 29, 33, 41, 58, 60]
L = len(PROMPT)


def _cfg(model: str, tmp_path, **kw) -> Config:
    base = dict(model=model, slots=3, ctx=512, batch=64, page_dir=str(tmp_path), threads=1)
    return Config(**(base | kw))


async def _prefill(s, seq: int) -> J.EntryOut:
    await s.engine.run(J.SetSampler(seq=seq, params=J.SamplingParams(top_logprobs=3)))
    out = await s.engine.run(J.Step(entries=[J.StepEntry(seq=seq, tokens=PROMPT, pos0=0, sample=True,
                                                         memo=J.MEMO_KEEP)]))
    return out.entries[0]


async def _reuse(s, seq: int) -> J.StepOut:
    return await s.engine.run(J.Step(entries=[J.StepEntry(seq=seq, tokens=[PROMPT[-1]], pos0=L - 1, sample=True,
                                                          memo=J.MEMO_REUSE)]))


async def _held(s, seq: int) -> tuple[int, int]:
    r = await s.engine.run(J.MemoryRange(seq=seq))
    return r.pos_min, r.pos_max


async def test_a_repeated_prompt_samples_from_the_kept_row_with_no_decode(tiny_model, tmp_path):
    async with ActorSystem(_cfg(tiny_model, tmp_path)) as s:
        assert s.props.prompt_logits
        first = await _prefill(s, 0)
        again = await _reuse(s, 0)
        assert again.n_tokens == 0  # nothing decoded
        e = again.entries[0]
        assert (e.token, e.logprob, e.top) == (first.token, first.logprob, first.top)
        assert await _held(s, 0) == (0, L - 1)
        # the sample is the sequence's last: the next step feeds it
        nxt = await s.engine.run(J.Step(entries=[J.StepEntry(seq=0, tokens=[], pos0=L, sample=True, feed_last=True)]))
        assert nxt.n_tokens == 1 and await _held(s, 0) == (0, L)


async def test_a_cut_below_the_kept_cell_makes_the_reuse_decode_in_its_place(tiny_model, tmp_path):
    async with ActorSystem(_cfg(tiny_model, tmp_path)) as s:
        first = await _prefill(s, 0)
        await s.engine.run(J.SeqRm(seq=0, p0=3, p1=-1))
        await s.engine.run(J.Step(entries=[J.StepEntry(seq=0, tokens=PROMPT[3:], pos0=3, sample=False)]))
        again = await _reuse(s, 0)
        assert again.n_tokens == 1
        assert again.entries[0].token == first.token  # f32: the same token either way
        assert await _held(s, 0) == (0, L - 1)  # decoded in place of the kept cell, not beside it


async def test_a_cut_past_the_kept_cell_keeps_the_row(tiny_model, tmp_path):
    async with ActorSystem(_cfg(tiny_model, tmp_path)) as s:
        await _prefill(s, 0)
        await s.engine.run(J.Step(entries=[J.StepEntry(seq=0, tokens=[], pos0=L, sample=True, feed_last=True)]))
        await s.engine.run(J.SeqRm(seq=0, p0=L, p1=-1))  # the generated token goes, the prompt stays
        assert (await _reuse(s, 0)).n_tokens == 0


async def test_a_share_takes_the_kept_row_along_and_a_page_in_does_not(tiny_model, tmp_path):
    async with ActorSystem(_cfg(tiny_model, tmp_path)) as s:
        first = await _prefill(s, 0)
        await s.engine.run(J.SetSampler(seq=1, params=J.SamplingParams(top_logprobs=3)))
        assert await s.engine.run(J.SeqShare(src=0, dst=1, n=L))
        shared = await _reuse(s, 1)
        assert shared.n_tokens == 0 and shared.entries[0].top == first.top
        # a share of fewer cells than the row's does not take it
        await s.engine.run(J.SetSampler(seq=2, params=J.SamplingParams(top_logprobs=3)))
        assert await s.engine.run(J.SeqShare(src=0, dst=2, n=L - 1))
        await s.engine.run(J.Step(entries=[J.StepEntry(seq=2, tokens=[PROMPT[-1]], pos0=L - 1, sample=False)]))
        assert (await _reuse(s, 2)).n_tokens == 1
        # a state set in: the cells are a copy, the row is not kept with them
        st = await s.engine.run(J.StateGet(seq=0))
        await s.engine.run(J.StateSet(seq=1, data=st.data))
        assert (await _reuse(s, 1)).n_tokens == 1
        assert await _held(s, 1) == (0, L - 1)


async def test_with_the_memo_off_nothing_is_kept_and_a_reuse_decodes(tiny_model, tmp_path):
    async with ActorSystem(_cfg(tiny_model, tmp_path, prompt_logits_memo=False)) as s:
        assert not s.props.prompt_logits
        first = await _prefill(s, 0)
        again = await _reuse(s, 0)
        assert again.n_tokens == 1 and again.entries[0].token == first.token
        assert await _held(s, 0) == (0, L - 1)


async def test_a_slot_sends_a_whole_repeat_as_a_reuse_and_answers_as_the_first_time(tiny_model, tmp_path):
    engines, factory = engine_kept()
    async with ActorSystem(_cfg(tiny_model, tmp_path, slots=2), engine_factory=factory) as s:
        prompt = "Once upon a time there was a little fox"
        a = await s.complete(prompt=prompt, n_predict=12, slot=0, logprobs=True)
        steps_before = engines[0].stepper.step_no
        b = await s.complete(prompt=prompt, n_predict=12, slot=0, logprobs=True)
        assert b.tokens == a.tokens and b.logprobs == a.logprobs
        assert b.n_cached == a.n_prompt_tokens - 1 and b.n_prompt_processed == 1
        records = [r for r in engines[0].stepper.records if r.step > steps_before]
        assert records[0].n_tokens == 0  # its first token came from the kept row
        # a prompt that extends the held one decodes its new tokens as before
        c = await s.complete(prompt=prompt + " who", n_predict=4, slot=0)
        assert c.n_prompt_processed >= 1


async def test_a_checkpoint_asked_on_a_reuse_is_the_state_as_it_stands(tiny_model, tmp_path):
    async with ActorSystem(_cfg(tiny_model, tmp_path)) as s:
        await _prefill(s, 0)
        out = await s.engine.run(J.Step(entries=[J.StepEntry(seq=0, tokens=[PROMPT[-1]], pos0=L - 1, sample=True,
                                                             checkpoint=True, memo=J.MEMO_REUSE)]))
        e = out.entries[0]
        assert out.n_tokens == 0 and e.checkpoint_pos == L and e.checkpoint is not None
        assert len(e.checkpoint) == len((await s.engine.run(J.StateGet(seq=0, partial=True))).data)
