"""Speculative decoding with a draft model, on the tiny llama (f32: greedy output is
bit-equal whatever the batch shape, so any difference is a bug).

Drafts: the target itself (acceptance near 1), a differently-seeded tiny llama of the same
vocabulary (acceptance near 0) and the target pruned to its first block (a real, partial
draft: about 1 in 8 accepted), so acceptance patterns are sensitive to the draft's state.

What these pin: output identical with and without speculation, greedy and sampled (same
seed), alone and with two slots batched; llama-server's metrics and timings; the typed
refusals at start (another vocabulary, --spec mtp on a model without an MTP layer, memory
that cannot be cut back; recurrent and hybrid targets and the MTP head speculate:
test_spec_memory_kinds.py); the draft state carried by page out/in and by spill/restore (the
.dft sidecar) so the next request's drafts and acceptance equal a never-paged slot's; a file
without a draft state starting the draft cold; the page RAM ceiling counting draft bytes.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.vocabulary.errors import DraftVocabMismatch, PageRamExceeded, SpecUnsupported
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

P1 = [1, 50, 61, 72, 83, 94, 105, 116, 127, 138, 149, 160, 171, 182]
P2 = [1, 300, 290, 280, 270, 260, 250, 240, 230]


@pytest.fixture(scope="session")
def drafts(tiny_model, models_dir) -> dict[str, str]:
    from actord.testing.draft_models import write_pruned_draft, write_vocab_variant
    from actord.testing.models import write_tiny_llama

    return {
        "same": tiny_model,
        "other": str(write_tiny_llama(models_dir / "tiny-llama-s2.gguf", seed=2)),
        "pruned": str(write_pruned_draft(tiny_model, models_dir / "tiny-llama-first1.gguf", 1)),
        "vocab": str(write_vocab_variant(tiny_model, models_dir / "tiny-llama-vocab.gguf")),
    }


def cfg(model: str, draft: str | None = None, **kw) -> Config:
    if draft is not None:
        kw["spec_draft_model"] = draft
    return Config(model=model, slots=kw.pop("slots", 2), ctx=kw.pop("ctx", 512), batch=kw.pop("batch", 64), **kw)


async def _turn(s, slot, prompt, n=40, **kw):
    return await s.complete(prompt=prompt, n_predict=n, slot=slot, ignore_eos=True, **kw)


async def _conversation(s, **kw):
    """Two slots at once, then a second turn on each (their prefix reused)."""
    out: dict[int, list] = {}

    async def one(slot, prompt):
        a = await _turn(s, slot, prompt, **kw)
        b = await _turn(s, slot, prompt + a.tokens + [7, 8, 9], n=24, **kw)
        out[slot] = [a, b]

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0, P1)
        tg.start_soon(one, 1, P2)
    return out


async def _drafts_since(s, n_before: int) -> tuple[list[list[list[int]]], int]:
    """The draft tokens proposed per step since record `n_before`, and how many tokens the
    draft context caught up on meanwhile."""
    records = await s.engine.run(J.StepRecords())
    return [r.drafts for r in records[n_before:]], sum(r.draft_in for r in records[n_before:])


@pytest.mark.parametrize("which", ["same", "other", "pruned"])
async def test_greedy_output_is_identical_with_and_without_speculation(tiny_model, drafts, which):
    async with ActorSystem(cfg(tiny_model)) as s:
        plain = await _conversation(s)
    async with ActorSystem(cfg(tiny_model, drafts[which], spec_n_max=4)) as s:
        spec = await _conversation(s)
        snap = s.metrics.snapshot()
    for slot in (0, 1):
        assert [r.tokens for r in spec[slot]] == [r.tokens for r in plain[slot]]
        assert [r.content for r in spec[slot]] == [r.content for r in plain[slot]]
        assert [r.n_prompt_processed for r in spec[slot]] == [r.n_prompt_processed for r in plain[slot]]
    drafted = sum(r.timings.draft_n for rs in spec.values() for r in rs)
    accepted = sum(r.timings.draft_n_accepted for rs in spec.values() for r in rs)
    assert drafted > 0 and snap["spec_decode_num_draft_tokens_total"] == drafted
    assert snap["spec_decode_num_accepted_tokens_total"] == accepted
    if which == "same":
        assert accepted >= 0.9 * drafted
        # Tokens per target forward: 128 tokens in far fewer steps than without speculation.
        assert snap["engine_steps_total"] < 0.5 * (2 * 40 + 2 * 24)
    if which == "pruned":
        assert 0 < accepted < drafted


async def test_sampled_output_is_identical_for_the_same_seed(tiny_model, drafts):
    """The request's own sampler chain runs at each drafted position in order, so it draws
    its random numbers as it would one token at a time. One slot, turns in order: with two
    slots racing, the cells a sequence's KV lands in vary from run to run, and a sampled
    token can flip on the last bits of its logits (as without speculation)."""
    kw = dict(temperature=0.9, top_k=40, top_p=0.95, seed=11)

    async def turns(s):
        a = await _turn(s, 0, P1, **kw)
        b = await _turn(s, 0, P1 + a.tokens + [7, 8, 9], n=24, **kw)
        c = await _turn(s, 0, P2, **kw)
        return [a, b, c]

    async with ActorSystem(cfg(tiny_model)) as s:
        plain = await turns(s)
    for which in ("same", "pruned"):
        async with ActorSystem(cfg(tiny_model, drafts[which])) as s:
            spec = await turns(s)
        assert [r.tokens for r in spec] == [r.tokens for r in plain]
        assert sum(r.timings.draft_n_accepted for r in spec) > 0


async def test_metrics_and_timings_carry_llama_servers_names(tiny_model, drafts):
    from actord.frontends.http.native.metrics import llama_metrics
    from actord.frontends.http.native.completion import timings

    async with ActorSystem(cfg(tiny_model, drafts["same"], spec_n_max=3)) as s:
        r = await _turn(s, 0, P1, n=20)
        text = s.metrics.exposition()
        llama = llama_metrics(s)
        props = await s.engine.run(J.ModelInfo())
    assert r.timings.draft_n > 0 and r.timings.draft_steps > 0
    t = timings(r)
    assert t["draft_n"] == r.timings.draft_n and t["draft_n_accepted"] == r.timings.draft_n_accepted
    for name in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_drafts_total"):
        assert f"\n{name} " in text and f"llamacpp:{name} " in llama
    assert (props.spec, props.spec_n_max) == ("draft", 3) and props.draft_digest


async def test_a_draft_model_with_another_vocabulary_is_refused_at_start(tiny_model, drafts):
    with pytest.raises(DraftVocabMismatch, match="token 300 differs"):
        async with ActorSystem(cfg(tiny_model, drafts["vocab"])):
            pass
    async with ActorSystem(cfg(tiny_model)) as s:  # the process and the library serve on
        assert (await _turn(s, 0, P1, n=4)).tokens


async def test_spec_mtp_on_a_model_without_an_mtp_layer_is_refused_at_start(tiny_model):
    with pytest.raises(SpecUnsupported, match="no MTP"):
        async with ActorSystem(cfg(tiny_model, spec="mtp")):
            pass


async def test_speculation_on_a_sliding_window_that_is_not_full_is_refused_at_start(tiny_swa_model, tiny_model):
    """A sliding window that is not full cannot be cut back at all. Recurrent and hybrid
    targets and draft models speculate: tests/serving/test_spec_memory_kinds.py."""
    with pytest.raises(SpecUnsupported, match="sliding-window"):
        async with ActorSystem(cfg(tiny_swa_model, tiny_model, swa_full="off")):
            pass


async def _paged_run(s, move, slot_after: int):
    """R1 on slot 0, `move` the slot's state away and back, R2 on `slot_after`; returns R2
    and the drafts the engine made for it, step by step."""
    r1 = await _turn(s, 0, P1, n=60)
    await move(s)
    before = len(await s.engine.run(J.StepRecords()))
    r2 = await _turn(s, slot_after, P1 + r1.tokens + [5, 6, 7], n=60)
    return r1, r2, await _drafts_since(s, before)


async def _no_move(s):
    pass


async def test_page_out_in_keeps_output_and_the_drafts_and_acceptance_of_a_never_paged_slot(tiny_model, drafts):
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2)) as s:
        base = await _paged_run(s, _no_move, 0)
    moved: dict = {}

    async def page(s):
        moved["out"] = await s.page_out(0, "ada")
        moved["in"] = await s.page_in(1, "ada")

    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2)) as s:
        paged = await _paged_run(s, page, 1)
    assert moved["out"]["draft_bytes"] > 0 and moved["in"]["draft"] == "warm"
    assert paged[1].tokens == base[1].tokens and paged[1].n_prompt_processed == base[1].n_prompt_processed == 4
    assert paged[2] == base[2]  # the same draft tokens step by step, caught up on as few tokens
    assert (paged[1].timings.draft_n, paged[1].timings.draft_n_accepted) == (
        base[1].timings.draft_n, base[1].timings.draft_n_accepted)
    assert base[1].timings.draft_n_accepted > 0


async def test_spill_and_restore_carry_the_draft_state_in_the_dft_sidecar(tiny_model, drafts, tmp_path):
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2, page_dir=str(tmp_path / "a"))) as s:
        base = await _paged_run(s, _no_move, 0)
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2, page_dir=str(tmp_path / "b"))) as s:
        r1 = await _turn(s, 0, P1, n=60)
        await s.page_out(0, "ada")
        await s.page_spill("ada", "ada.page", drop=True)
    assert (tmp_path / "b" / "ada.page.dft").exists()
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2, page_dir=str(tmp_path / "b"))) as s:  # a restart
        r = await s.slot_restore(1, "ada.page")
        assert r["draft"] == "warm" and r["draft_n_tokens"] > 0
        before = len(await s.engine.run(J.StepRecords()))
        r2 = await _turn(s, 1, P1 + r1.tokens + [5, 6, 7], n=60)
        got = await _drafts_since(s, before)
    assert r1.tokens == base[0].tokens and r2.tokens == base[1].tokens
    assert got == base[2]  # the same drafts, and no more to catch up on than a never-paged slot
    assert (r2.timings.draft_n, r2.timings.draft_n_accepted) == (base[1].timings.draft_n,
                                                                 base[1].timings.draft_n_accepted)


async def test_a_file_without_a_draft_state_starts_the_draft_cold(tiny_model, drafts, tmp_path):
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2)) as s:
        base = await _paged_run(s, _no_move, 0)
    async with ActorSystem(cfg(tiny_model, page_dir=str(tmp_path))) as s:  # no speculation: no .dft
        r1 = await _turn(s, 0, P1, n=60)
        await s.slot_save(0, "plain.page")
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2, page_dir=str(tmp_path))) as s:
        r = await s.slot_restore(1, "plain.page")
        assert (r["draft"], r["draft_n_tokens"]) == ("cold", 0)
        before = len(await s.engine.run(J.StepRecords()))
        r2 = await _turn(s, 1, P1 + r1.tokens + [5, 6, 7], n=60)
        got = await _drafts_since(s, before)
    assert not Path(tmp_path / "plain.page.dft").exists()
    assert r2.tokens == base[1].tokens and r2.n_prompt_processed == 4
    # The draft caught up on the slot's tokens first (in pieces within the draft's batch,
    # drafting nothing meanwhile), then drafted again.
    assert got[0][0] == [] and base[2][0][0] != []
    assert got[1] > base[2][1] + len(P1)  # it decoded the slot's tokens again, the warm one did not
    assert r2.timings.draft_n > 0


async def test_a_missing_dft_sidecar_is_a_cold_draft_not_an_error(tiny_model, drafts, tmp_path):
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2, page_dir=str(tmp_path))) as s:
        r1 = await _turn(s, 0, P1, n=60)
        await s.slot_save(0, "m.page")
        fresh = await _turn(s, 0, P1 + r1.tokens + [5], n=12)
    (tmp_path / "m.page.dft").unlink()
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2, page_dir=str(tmp_path))) as s:
        r = await s.slot_restore(0, "m.page")
        assert r["draft"] == "cold"
        again = await _turn(s, 0, P1 + r1.tokens + [5], n=12)
    assert again.tokens == fresh.tokens


async def test_the_page_ram_ceiling_counts_the_draft_state(tiny_model, drafts):
    async with ActorSystem(cfg(tiny_model)) as s:
        await _turn(s, 0, P1, n=30)
        plain = await s.page_out(0, "a")
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], spec_n_max=2)) as s:
        await _turn(s, 0, P1, n=30)
        spec = await s.page_out(0, "a")
        assert spec["n_bytes"] == plain["n_bytes"] + spec["draft_bytes"] and spec["draft_bytes"] > 0
        assert (await s.page_stats()).charged == spec["n_bytes"]
    async with ActorSystem(cfg(tiny_model, drafts["pruned"], page_ram_bytes=plain["n_bytes"] + 8)) as s:
        await _turn(s, 0, P1, n=30)
        with pytest.raises(PageRamExceeded):
            await s.page_out(0, "a")
        assert (await s.slot_list())[0].n_tokens > 0 and (await s.page_stats()).charged == 0


async def test_speculation_keeps_grammar_logprobs_biases_and_penalties_as_they_are(tiny_model, drafts):
    """The verify samples each position as the plain path does: the grammar checks and
    accepts there, logprobs are taken from that position's row, the chain's biases and
    penalties see the same tokens in the same order."""
    from tests.serving.test_sampling import SCHEMA

    asks = [
        dict(json_schema=SCHEMA, n=120),
        dict(json_schema=SCHEMA, n=120, temperature=0.9, seed=3),
        dict(logprobs=True, top_logprobs=3, n=30),
        dict(logit_bias=[[300, 5.0], [301, -100.0]], repeat_penalty=1.3, repeat_last_n=16, frequency_penalty=0.2, n=30),
    ]

    async def run(s):
        out = []
        for a in asks:
            a = dict(a)
            n = a.pop("n")
            r = await s.complete(prompt=P1, n_predict=n, slot=0, **a)
            out.append(r)
        return out

    async with ActorSystem(cfg(tiny_model, ctx=1024)) as s:
        plain = await run(s)
    async with ActorSystem(cfg(tiny_model, drafts["same"], ctx=1024)) as s:
        spec = await run(s)
    for p, q in zip(plain, spec):
        assert (q.tokens, q.content, q.stop_reason) == (p.tokens, p.content, p.stop_reason)
        # The same tokens and top lists; the values to float noise (a verify's rows go
        # through the matmuls in another batch shape than one token's).
        assert (q.logprobs is None) == (p.logprobs is None)
        for a, b in zip(q.logprobs or [], p.logprobs or []):
            assert a.token == b.token and [t.token for t in a.top] == [t.token for t in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
    assert spec[0].stop_reason == "eos" and spec[2].logprobs and len(spec[2].logprobs) == 30
    # The draft knows no grammar (as llama-server's): it proposes free text, and the target
    # under the grammar rejects most of it; elsewhere it agrees.
    assert all(r.timings.draft_n > 0 for r in spec) and spec[2].timings.draft_n_accepted > 0
