"""Sampling the API asks for, end to end through the actors on the generated tiny llama:
grammar (JSON schema) decoding, logit biases, penalties, logprobs, and refusals that change
nothing. The HTTP mapping is tested in tests/frontends/test_openai_http.py."""

from __future__ import annotations

import json
import math

import pytest

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.vocabulary.errors import InvalidParams
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

PROMPT = [1, 17, 40, 99, 7, 250, 33, 12, 180, 64]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}, "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "kind", "tags"], "additionalProperties": False,
}


def cfg(model: str) -> Config:
    return Config(model=model, slots=2, ctx=1024, batch=64)


def _valid(doc: dict) -> bool:
    """SCHEMA, checked by hand (no jsonschema package here)."""
    return (set(doc) == set(SCHEMA["required"]) and isinstance(doc["name"], str) and len(doc["name"]) <= 12
            and isinstance(doc["age"], int) and not isinstance(doc["age"], bool) and isinstance(doc["ok"], bool)
            and doc["kind"] in ("a", "b", "c") and isinstance(doc["tags"], list) and len(doc["tags"]) <= 3
            and all(isinstance(t, str) and len(t) <= 4 for t in doc["tags"]))


async def test_json_schema_output_is_valid_json_under_the_schema_greedy_and_sampled(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        for seed, temperature in [(0, 0.0), (1, 0.9), (2, 0.9)]:
            r = await s.complete(prompt=PROMPT[:6 + seed], n_predict=200, slot=0, json_schema=SCHEMA,
                                 temperature=temperature, seed=seed)
            assert r.stop_reason == "eos"  # the grammar closed the document and allowed only EOG
            assert _valid(json.loads(r.content)), r.content
        free = await s.complete(prompt=PROMPT, n_predict=40, slot=0)
        with pytest.raises(json.JSONDecodeError):
            json.loads(free.content)  # the random model writes no JSON by itself


async def test_greedy_logprobs_name_the_chosen_token_top_1_and_stream_the_same(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        r = await s.complete(prompt=PROMPT, n_predict=12, slot=0, logprobs=True, top_logprobs=5)
        assert r.logprobs is not None and [t.token for t in r.logprobs] == r.tokens
        for t in r.logprobs:
            assert t.top[0].token == t.token and t.top[0].logprob == t.logprob  # greedy: the argmax
            lps = [a.logprob for a in t.top]
            assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
            assert sum(math.exp(lp) for lp in lps) <= 1 + 1e-6
            assert t.bytes == list(t.text.encode())  # printable ASCII pieces
        chunks: list = []
        again = await s.complete(prompt=PROMPT, n_predict=12, slot=1, logprobs=True, top_logprobs=5, stream=True,
                                 on_token=chunks.append)
        streamed = [t for c in chunks for t in c.get("logprobs", [])]
        assert streamed == again.logprobs
        assert [t.token for t in again.logprobs] == r.tokens
        assert [t.logprob for t in again.logprobs] == pytest.approx([t.logprob for t in r.logprobs], abs=1e-4)
        plain = await s.complete(prompt=PROMPT, n_predict=12, slot=0)
        assert plain.logprobs is None and plain.tokens == r.tokens  # asking for logprobs changes no token


async def test_full_vocabulary_logprobs_are_a_distribution(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        n_vocab = s.props.n_vocab
        await s.engine.run(J.SetSampler(seq=1, params=J.SamplingParams(top_logprobs=n_vocab)))
        out = await s.engine.run(J.Step(entries=[J.StepEntry(seq=1, tokens=PROMPT, pos0=0, sample=True)]))
        await s.engine.run(J.SeqRm(seq=1))
        e = out.entries[0]
        assert len(e.top) == n_vocab and e.top[0][0] == e.token
        assert abs(sum(math.exp(lp) for _, lp, _ in e.top) - 1.0) < 1e-4


async def test_logit_bias_minus_100_bans_the_greedy_token_and_plus_100_forces_one(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        base = await s.complete(prompt=PROMPT, n_predict=8, slot=0)
        banned = await s.complete(prompt=PROMPT, n_predict=8, slot=0, logit_bias={str(base.tokens[0]): -100})
        assert banned.tokens[0] != base.tokens[0] and base.tokens[0] not in banned.tokens
        forced = await s.complete(prompt=PROMPT, n_predict=4, slot=0, logit_bias=[[300, 100]])  # llama-server's shape
        assert forced.tokens == [300] * 4


async def test_penalties_change_a_repetitive_greedy_output(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        base = await s.complete(prompt=PROMPT, n_predict=96, slot=0)
        assert len(set(base.tokens)) < len(base.tokens)  # greedy repeats itself
        for kw in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5}, {"repeat_penalty": 1.5}):
            r = await s.complete(prompt=PROMPT, n_predict=96, slot=0, **kw)
            assert r.tokens != base.tokens and len(set(r.tokens)) > len(set(base.tokens)), kw


async def test_a_bad_schema_or_grammar_is_refused_and_changes_nothing(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        first = await s.complete(prompt=PROMPT, n_predict=4, slot=0)
        extended = PROMPT + first.tokens + [5, 6]
        before = (await s.slot_list())[0]
        for kw, param in [({"json_schema": {"type": "frob"}}, "json_schema"),
                          ({"json_schema": {"type": "array", "minItems": 10**9}}, "json_schema"),
                          ({"grammar": "root ::= undefined-rule"}, "grammar"),
                          ({"logit_bias": {"512": 1}}, "logit_bias"),
                          ({"top_logprobs": 3}, "top_logprobs")]:
            with pytest.raises(InvalidParams) as e:
                await s.complete(prompt=extended, n_predict=4, slot=0, **kw)
            assert e.value.data["param"] == param, kw
            after = (await s.slot_list())[0]
            assert (after.n_tokens, after.state) == (before.n_tokens, "idle"), kw
        again = await s.complete(prompt=extended, n_predict=4, slot=0)
        assert again.n_cached == before.n_tokens == len(PROMPT) + 3  # the slot's cache survived every refusal


async def test_a_grammar_left_with_no_token_ends_the_request_not_the_daemon(tiny_model):
    # Every token that can start a JSON object banned: the grammar allows nothing the bias
    # leaves. libllama aborts the process if a refused token is accepted into a grammar.
    async with ActorSystem(cfg(tiny_model)) as s:
        n_vocab = s.props.n_vocab
        starts = [t for t in range(n_vocab)
                  if (await s.engine.run(J.Detokenize(tokens=[t]))).lstrip(" ").startswith("{")]
        assert 126 in starts  # the "{" byte token, <0x7B>
        bias = {str(t): -100 for t in starts}
        with pytest.raises(InvalidParams) as e:
            await s.complete(prompt=PROMPT, n_predict=8, slot=0, grammar='root ::= "{" [a-z]* "}"', logit_bias=bias)
        assert "grammar allows no token" in e.value.message
        ok = await s.complete(prompt=PROMPT, n_predict=4, slot=0)
        assert len(ok.tokens) == 4
