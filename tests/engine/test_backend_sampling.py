"""Backend sampling (engine/backend_sampling.py) on the generated tiny llama, on the CPU
backend (where "auto" leaves it off, so these tests turn it on): the chains that can run in
the decode's graph are attached there and pick the same greedy tokens as the CPU chain; the
ones that cannot (grammar, logprobs, penalties) stay on the CPU and still work; a chain is
detached before libllama could see it freed."""

from __future__ import annotations

import ctypes

import pytest

from actord.vocabulary.config import Config
from actord.engine import backend_sampling as BS
from actord.engine import jobs as J
from actord.engine.llama import lib
from actord.vocabulary.errors import InvalidParams
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

PROMPT = [1, 17, 40, 99, 7, 250, 33, 12, 180, 64]


def cfg(model: str, mode: str) -> Config:
    return Config(model=model, slots=2, ctx=1024, batch=64, backend_sampling=mode)


@pytest.fixture
def attached(monkeypatch):
    """(seq, attached?) for every llama_set_sampler call, in order."""
    calls: list[tuple[int, bool]] = []
    orig = lib.llama_set_sampler

    def spy(ctx, seq, smpl):
        calls.append((int(seq), bool(smpl) and bool(ctypes.cast(smpl, ctypes.c_void_p).value)))
        return orig(ctx, seq, smpl)

    monkeypatch.setattr(lib, "llama_set_sampler", spy)
    return calls


async def _runs(model: str, mode: str, requests: list[dict]) -> list:
    async with ActorSystem(cfg(model, mode)) as s:
        assert s.props.device.backend_sampling == (mode == "on")
        out = []
        for i, kw in enumerate(requests):
            out.append(await s.complete(prompt=PROMPT[: 4 + i % 6], n_predict=24, slot=i % 2, ignore_eos=True, **kw))
        return out


async def test_greedy_outputs_are_the_cpu_chains_and_the_chain_ran_in_the_graph(tiny_model, attached):
    greedy = [{}, {}, {"logit_bias": {"300": -100}}, {}]
    on = await _runs(tiny_model, "on", greedy)
    attaches = [c for c in attached if c[1]]
    assert len(attaches) == len(greedy)  # each request's chain was attached...
    assert attached.count((0, False)) + attached.count((1, False)) >= len(greedy)  # ...and detached
    attached.clear()
    off = await _runs(tiny_model, "off", greedy)
    assert attached == []
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert 300 not in on[2].tokens


async def test_a_chain_is_detached_when_its_request_ends(tiny_model, attached):
    async with ActorSystem(cfg(tiny_model, "on")) as s:
        await s.complete(prompt=PROMPT, n_predict=4, slot=1, ignore_eos=True)
        await s.slot_list()  # the slot has handled its request's end (the answer goes out first)
        assert attached == [(1, True), (1, False)]
        again = await s.complete(prompt=PROMPT, n_predict=4, slot=1, ignore_eos=True)  # a new chain, attached anew
        await s.slot_list()
        assert attached[2:] == [(1, True), (1, False)] and len(again.tokens) == 4


async def test_the_backend_picks_the_token_the_step_reports(tiny_model):
    """Straight on the engine: after a backend-sampled step, libllama holds the sampled token
    (llama_get_sampled_token_ith) and it is the one the step returned."""
    async with ActorSystem(cfg(tiny_model, "on")) as s:
        seen = []

        def probe(engine, job):
            out = real(engine, job)
            if isinstance(job, J.Step) and 0 in engine.samplers.backend_seqs:
                seen.append((int(lib.llama_get_sampled_token_ith(engine.context.ctx, out.n_tokens - 1)), out.entries[0].token))
            return out

        real = s.engine._runner
        s.engine._runner = probe
        try:
            await s.complete(prompt=PROMPT, n_predict=6, slot=0, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)
        finally:
            s.engine._runner = real
        assert len(seen) == 6 and all(a == b for a, b in seen), seen


async def test_chains_the_graph_cannot_run_stay_on_the_cpu_and_still_work(tiny_model, attached):
    asks = [{"logprobs": True, "top_logprobs": 3}, {"frequency_penalty": 1.5}, {"grammar": 'root ::= "ab" [a-z]*'}]
    on = await _runs(tiny_model, "on", asks)
    assert [c for c in attached if c[1]] == []
    off = await _runs(tiny_model, "off", asks)
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert on[0].logprobs == off[0].logprobs
    assert on[2].content.startswith("ab")


def test_eligibility_and_the_mode():
    assert BS.eligible(J.SamplingParams())
    assert BS.eligible(J.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=1))
    assert BS.eligible(J.SamplingParams(logit_bias=((5, -1.0),)))
    assert not BS.eligible(J.SamplingParams(grammar='root ::= "a"'))
    assert not BS.eligible(J.SamplingParams(grammar_triggers=(("<tool>", False),)))
    assert not BS.eligible(J.SamplingParams(top_logprobs=0))
    assert not BS.eligible(J.SamplingParams(penalty_last_n=64, presence_penalty=0.5))
    assert BS.eligible(J.SamplingParams(penalty_last_n=64))  # all penalties neutral: none in the chain
    assert BS.resolve("auto", gpu_offload=True, drafting=False) is True
    assert BS.resolve("auto", gpu_offload=False, drafting=False) is False
    assert BS.resolve("on", gpu_offload=False, drafting=False) is True
    assert BS.resolve("on", gpu_offload=True, drafting=True) is False  # speculation keeps the CPU chain
    assert BS.resolve("off", gpu_offload=True, drafting=False) is False


def test_config_and_flag():
    import argparse

    from actord.frontends.config_flags import add_config_flags, config_from_args

    def serve(*argv: str) -> Config:
        p = argparse.ArgumentParser()
        add_config_flags(p)
        return config_from_args(p.parse_args(["--model", "m.gguf", *argv]))

    with pytest.raises(InvalidParams):
        Config(model="m.gguf", backend_sampling="maybe").validate()
    assert Config(model="m.gguf").backend_sampling == "auto"
    assert serve("--backend-sampling", "off").backend_sampling == "off"
    assert serve("--backend-sampling").backend_sampling == "on"  # a bare flag, as --flash-attn
    with pytest.raises(SystemExit):
        serve("--backend-sampling", "maybe")
