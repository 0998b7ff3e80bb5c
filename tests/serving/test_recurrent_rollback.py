"""Rolling a recurrent state back: what libllama's n_rs_seq really does, and that actord
never rolls back outside the batch just decoded.

libllama 0.3.36 with n_rs_seq > 0 (qwen35 supports it; mamba2 is clamped to 0) keeps the
recurrent states after the last n_rs_seq + 1 tokens of the last ubatch and accepts a
seq_rm of up to n_rs_seq tokens from the end. The state is right only when the position
rolled back to lies inside the batch just decoded: after one-token generation steps the
snapshots are stale, the cut is accepted, and the output is wrong. These tests pin that
hazard in libllama itself (through a raw seq_rm, bypassing actord's guard), pin that the
right use is right, and pin that actord's SeqRm refuses both (a job between steps is never
inside the batch just decoded) so a slot resumes a divergence correctly.
"""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.engine.engine import Engine
from actord.engine.llama import lib
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

P = [1] + [3 + (i * 37) % 500 for i in range(99)]  # 100 tokens


@pytest.fixture
def anyio_backend():
    return "asyncio"


class RawSeqRm(J.Job):
    """Test seam: llama_memory_seq_rm(seq, p0, -1) without actord's guard."""

    seq: int
    p0: int


class RawEngine(Engine):
    def handle(self, job):
        if isinstance(job, RawSeqRm):
            return bool(lib.llama_memory_seq_rm(self.context.mem, job.seq, job.p0, -1))
        return super().handle(job)


def cfg(model: str, tmp_path, slots: int = 2, **kw) -> Config:
    return Config(model=model, slots=slots, ctx=1024, batch=128, page_dir=str(tmp_path), threads=1,
                  ctx_checkpoints_bytes=10**8, **kw)


def system(model: str, tmp_path, n_rs_seq: int = 2, **kw) -> ActorSystem:
    return ActorSystem(cfg(model, tmp_path, **kw), engine_factory=lambda c: RawEngine(c, n_rs_seq=n_rs_seq))


async def step(s, seq: int, tokens: list[int], pos0: int) -> int:
    out = await s.engine.run(J.Step(entries=[J.StepEntry(seq=seq, tokens=tokens, pos0=pos0, sample=True)]))
    return out.entries[0].token


async def greedy(s, seq: int, first: int, pos0: int, n: int = 8) -> list[int]:
    toks = [await step(s, seq, [first], pos0)]
    for i in range(n - 1):
        toks.append(await step(s, seq, [toks[-1]], pos0 + 1 + i))
    return toks


async def fresh(s, seq: int, prefix: list[int], first: int) -> list[int]:
    await s.engine.run(J.SeqRm(seq=seq, p0=-1, p1=-1))
    await step(s, seq, prefix, 0)
    return await greedy(s, seq, first, len(prefix))


async def test_libllama_accepts_a_rollback_after_one_token_steps_and_the_state_is_wrong(tiny_hybrid_model, tmp_path):
    async with system(tiny_hybrid_model, tmp_path) as s:
        assert s.props.n_rs_seq == 2 and s.props.hybrid
        for seq in (0, 1):
            await s.engine.run(J.SetSampler(seq=seq, params=J.SamplingParams()))
        t1 = await step(s, 0, P, 0)
        t2 = await step(s, 0, [t1], 100)
        await step(s, 0, [t2], 101)  # the memory holds P + t1 + t2, each decoded alone
        x = 7
        # actord's engine refuses the cut: it runs between steps, never inside the last batch.
        assert await s.engine.run(J.SeqRm(seq=0, p0=100)) is False
        assert (await s.engine.run(J.MemoryRange(seq=0))).pos_max == 101
        # libllama itself accepts it (a rollback of 2 <= n_rs_seq) ...
        assert await s.engine.run(RawSeqRm(seq=0, p0=100)) is True
        assert (await s.engine.run(J.MemoryRange(seq=0))).pos_max == 99
        wrong = await greedy(s, 0, x, 100)
        # ... and the state it rolled back to is not P's.
        assert wrong != await fresh(s, 1, P, x)


async def test_libllama_rolls_back_right_inside_the_batch_just_decoded(tiny_hybrid_model, tmp_path):
    async with system(tiny_hybrid_model, tmp_path) as s:
        for seq in (0, 1):
            await s.engine.run(J.SetSampler(seq=seq, params=J.SamplingParams()))
        await step(s, 0, P, 0)
        a, b, c = 11, 12, 13
        await step(s, 0, [a, b, c], 100)  # one batch: the snapshots are its last 3 tokens'
        assert await s.engine.run(J.SeqRm(seq=0, p0=101)) is False  # actord: still refused
        assert await s.engine.run(RawSeqRm(seq=0, p0=101)) is True  # keep P + a
        y = 7
        assert await greedy(s, 0, y, 101) == await fresh(s, 1, P + [a], y)


@pytest.mark.parametrize("fixture", ["tiny_hybrid_model", "tiny_recurrent_model"])
async def test_a_slot_never_cuts_recurrent_memory_back_and_resumes_like_a_fresh_slot(fixture, request, tmp_path):
    """Generated with one-token steps, then a request diverging two tokens before the end:
    with n_rs_seq = 2 libllama would accept that cut and decode from a wrong state; the slot
    resumes from a checkpoint or re-prefills, and its output is a fresh slot's."""
    model = request.getfixturevalue(fixture)
    async with system(model, tmp_path) as s:
        r = await s.complete(prompt=P, n_predict=8, slot=0, ignore_eos=True)
        held = P + r.tokens[:-1]  # the last sampled token is not decoded
        diverged = held[:-2] + [7, 8]
        again = await s.complete(prompt=diverged, n_predict=8, slot=0, ignore_eos=True)
        assert again.n_cached <= len(P)  # not cut back into the generated tokens
        ref = await s.complete(prompt=diverged, n_predict=8, slot=1, ignore_eos=True)
        assert again.tokens == ref.tokens


async def test_the_engine_refuses_every_partial_cut_of_recurrent_memory_but_the_end(tiny_recurrent_model, tmp_path):
    async with system(tiny_recurrent_model, tmp_path) as s:
        assert s.props.n_rs_seq == 0  # mamba2: libllama clamps it
        await s.engine.run(J.SetSampler(seq=0, params=J.SamplingParams()))
        await step(s, 0, P, 0)
        assert await s.engine.run(J.SeqRm(seq=0, p0=50)) is False
        assert await s.engine.run(J.SeqRm(seq=0, p0=10, p1=20)) is False  # libllama: True, removes nothing
        assert await s.engine.run(RawSeqRm(seq=0, p0=50)) is False  # n_rs_seq 0: libllama refuses too
        assert await s.engine.run(J.SeqRm(seq=0, p0=100)) is True  # at the end: nothing to remove
        assert (await s.engine.run(J.MemoryRange(seq=0))).pos_max == 99
        assert await s.engine.run(J.SeqRm(seq=0, p0=-1, p1=-1)) is True
        assert (await s.engine.run(J.MemoryRange(seq=0))).pos_max == -1


async def test_the_device_budget_counts_the_rollback_snapshots_a_sequence_holds(tiny_hybrid_model, tmp_path):
    """With n_rs_seq snapshots libllama keeps (1 + n_rs_seq) recurrent rows per sequence on the
    device; a page still copies one (llama_state_seq_get_size does not grow)."""
    out = {}
    for n_rs in (0, 2):
        c = cfg(tiny_hybrid_model, tmp_path, device_bytes=10**9)
        async with ActorSystem(c, engine_factory=lambda c, n=n_rs: RawEngine(c, n_rs_seq=n)) as s:
            await s.complete(prompt=P, n_predict=4, slot=0, ignore_eos=True)
            state = await s.engine.run(J.StateSize(seq=0))
            out[n_rs] = (state, s.residency.slot_bytes.get(0), s.props.recurrent_state_bytes)
    (s0, dev0, rec), (s2, dev2, _) = out[0], out[2]
    assert s0 == s2 and dev0 == s0
    assert dev2 == s2 + 2 * rec


Q = [1] + [5 + (i * 53) % 490 for i in range(39)]  # 40 tokens
R = [1] + [4 + (i * 29) % 495 for i in range(59)]  # 60 tokens


async def interleave(s, draft: bool = False) -> int:
    """Sequences 0, 2 and 1 prefilled in that order, so libllama's recurrent cells hold them
    in that order: a later ubatch of sequences 0 and 1 gathers them into adjacent cells and
    moves sequence 2 aside. Returns the token sequence 2 sampled after P."""
    for seq in range(3):
        await s.engine.run(J.SetSampler(seq=seq, params=J.SamplingParams()))
    await step(s, 0, Q[:30], 0)
    extra = {"draft_tokens": P, "draft_pos0": 0} if draft else {}
    out = await s.engine.run(J.Step(entries=[J.StepEntry(seq=2, tokens=P, pos0=0, sample=True, **extra)]))
    await step(s, 1, R[:40], 0)
    return out.entries[0].token


def three_ubatches(first: J.StepEntry) -> J.Step:
    """One decode that libllama splits into ubatches (split_equal keeps each sequence's last
    n_rs_seq + 1 tokens together): `first` (sequence 2's 3 tokens) alone, then sequences 0 and
    1 together (two tokens each), then the rest of sequence 1's chunk."""
    return J.Step(entries=[first, J.StepEntry(seq=0, tokens=[21, 22], pos0=30, sample=True),
                           J.StepEntry(seq=1, tokens=R[40:52], pos0=40, sample=False)])


async def test_libllama_rolls_back_wrong_when_a_later_ubatch_of_the_decode_moved_the_sequence(tiny_hybrid_model, tmp_path):
    """The snapshots stay in the rows of the cell the sequence held when its ubatch ran; the
    ubatch of sequences 0 and 1 swaps sequence 2 into another cell without them, and the
    rollback reads that cell's rows. (If this starts to fail, libllama moves snapshots with
    their cell, and engine/step.py `_one_ubatch` may go.)"""
    async with system(tiny_hybrid_model, tmp_path, slots=3) as s:
        await interleave(s)
        a, b, c = 11, 12, 13
        await s.engine.run(three_ubatches(J.StepEntry(seq=2, tokens=[a, b, c], pos0=len(P), sample=True)))
        assert await s.engine.run(RawSeqRm(seq=2, p0=len(P) + 1)) is True  # keep P + a
        y = 7
        assert await greedy(s, 2, y, len(P) + 1) != await fresh(s, 0, P + [a], y)


async def test_a_verify_decoded_in_several_ubatches_rolls_back_by_replay_and_answers_as_plain_decoding(
        tiny_hybrid_model, tiny_model, tmp_path):
    """Speculation on the hybrid target (rollback "rs"): sequence 2 verifies two drafts in a
    decode that takes three ubatches (seed 4003 of the deeper hunt); the rejected drafts are
    taken back by replay, and what it generates next is what plain decoding gives."""
    spec = cfg(tiny_hybrid_model, tmp_path, slots=3, spec_draft_model=tiny_model, spec_n_max=2, swa_full="on")
    async with ActorSystem(spec) as s:
        assert s.props.n_rs_seq == 2
        t = await interleave(s, draft=True)
        out = await s.engine.run(three_ubatches(J.StepEntry(
            seq=2, tokens=[t], pos0=len(P), sample=True, draft_tokens=[t], draft_pos0=len(P), draft=2)))
        e = out.entries[0]
        assert e.drafted == 2 and len(e.more) < 2  # a draft was rejected: the rollback ran
        got = [e.token] + [m.token for m in e.more]
        while len(got) < 6:
            got.append(await step(s, 2, [got[-1]], len(P) + len(got)))
    async with ActorSystem(cfg(tiny_hybrid_model, tmp_path, slots=1)) as ref:
        await ref.engine.run(J.SetSampler(seq=0, params=J.SamplingParams()))
        assert await step(ref, 0, P, 0) == t
        assert await greedy(ref, 0, t, len(P), n=6) == got
