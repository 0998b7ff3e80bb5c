"""Sampling fields through the OpenAI HTTP front, with the official `openai` client against
`actord serve --http` (its own process) on the generated tiny chat model: structured output
(`.parse()` with a pydantic model, json_schema, json_object), logprobs on chat and
completions (streamed too), logit_bias, penalties, and the socket's `completion` taking the
same fields. Grammar-constrained decoding on a random model: the grammar alone makes the
output valid, so it must validate whenever the generation ends by itself."""

from __future__ import annotations

import json
import math
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from actord.frontends.client import Client
from tests.frontends.test_openai_http import KEY, _start, _stop, front_on_tiny, openai_client

MSGS = [{"role": "user", "content": "Describe a pet."}]


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int
    ok: bool
    name: str = Field(max_length=8)
    tags: list[Literal["a", "b", "c"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    yield from front_on_tiny(tmp_path_factory)


@pytest.fixture
def client(front) -> openai.OpenAI:
    return openai_client(front[1], timeout=60)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model_returns_a_valid_object(client, temperature):
    for seed in range(3):
        r = client.chat.completions.parse(model="gpt-4o-mini", messages=MSGS, response_format=Pet, max_tokens=300,
                                          temperature=temperature, seed=seed)
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"
        assert Pet.model_validate_json(r.choices[0].message.content) == pet


def test_json_schema_and_json_object_streamed_and_whole(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["x", "y"]}},
              "required": ["n", "s"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    whole = client.chat.completions.create(model="m", messages=MSGS, max_tokens=200, temperature=0, response_format=rf)
    doc = json.loads(whole.choices[0].message.content)
    assert set(doc) == {"n", "s"} and isinstance(doc["n"], int) and doc["s"] in ("x", "y")
    chunks = list(client.chat.completions.create(model="m", messages=MSGS, max_tokens=200, temperature=0,
                                                 response_format=rf, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    obj = client.chat.completions.create(model="m", messages=MSGS, max_tokens=300, temperature=0.7, seed=3,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a free object may run past max_tokens; what there is is a JSON prefix
        assert obj.choices[0].message.content.startswith("{")
    free = client.chat.completions.create(model="m", messages=MSGS, max_tokens=40, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)


def test_chat_logprobs_match_the_greedy_choice_and_stream_the_same(client):
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
        assert len(t.top_logprobs) == 4 and t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1 + 1e-6
    chunks = list(client.chat.completions.create(model="m", messages=MSGS, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=4, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # The same values up to float noise: a cached prompt decodes in other batch shapes.
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    plain = client.chat.completions.create(model="m", messages=MSGS, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_completion_logprobs_in_the_legacy_shape(client):
    r = client.completions.create(model="m", prompt="hello world", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == val and top[tok] == val
    chunks = list(client.completions.create(model="m", prompt="hello world", max_tokens=6, temperature=0,
                                            logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def _ban(text: str) -> dict[str, int]:
    """logit_bias -100 on the id of a piece (the tiny vocab holds each piece once; U+2581 is a space)."""
    from actord.testing.models import _spm_vocab

    bans = {str(i): -100 for i, p in enumerate(_spm_vocab()[0]) if p.replace("\u2581", " ") == text}
    assert len(bans) == 1
    return bans


def test_logit_bias_minus_100_changes_the_greedy_token(client):
    base = client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, temperature=0, logprobs=True)
    first = base.choices[0].logprobs.content[0].token
    banned = client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, temperature=0,
                                            logit_bias=_ban(first), logprobs=True)
    assert banned.choices[0].logprobs.content[0].token != first
    assert banned.choices[0].message.content != base.choices[0].message.content

    plain = client.completions.create(model="m", prompt="hello world", max_tokens=6, temperature=0, logprobs=0)
    other = client.completions.create(model="m", prompt="hello world", max_tokens=6, temperature=0,
                                      logit_bias=_ban(plain.choices[0].logprobs.tokens[0]))
    assert other.choices[0].text != plain.choices[0].text


def test_penalties_change_the_output(client):
    kw = {"model": "m", "messages": MSGS, "max_tokens": 96, "temperature": 0}
    base = client.chat.completions.create(**kw).choices[0].message.content
    for extra in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5}, {"extra_body": {"repeat_penalty": 1.5}}):
        assert client.chat.completions.create(**kw, **extra).choices[0].message.content != base, extra


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"logit_bias": {"99999": -100}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
])
def test_a_bad_sampling_field_is_a_400_naming_it(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, extra_body=body)
    assert e.value.param == param


def test_socket_completion_takes_the_sampling_fields(front):
    sock, _ = front
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    with Client(str(sock), timeout=60) as c:
        r = c.call("completion", {"prompt": "hello world", "n_predict": 60, "json_schema": schema,
                                  "logprobs": True, "top_logprobs": 2, "logit_bias": [[300, -100]],
                                  "presence_penalty": 0.5, "frequency_penalty": 0.5, "repeat_penalty": 1.1})
        assert isinstance(json.loads(r["content"])["ok"], bool) and r["stop_reason"] == "eos"
        assert len(r["logprobs"]) == len(r["tokens"]) and 300 not in r["tokens"]
        assert all(len(t["top"]) == 2 for t in r["logprobs"])
        g = c.call("chat", {"messages": MSGS, "n_predict": 60, "grammar": 'root ::= "yes" | "no"'})
        assert g["message"]["content"] in ("yes", "no")


@pytest.mark.slow
def test_gemma_parse_returns_a_valid_object_and_logprobs_stay_a_distribution(real_model, tmp_path):
    from actord.testing.models import GEMMA3_CHAT_TEMPLATE

    template = tmp_path / "gemma.jinja"
    template.write_text(GEMMA3_CHAT_TEMPLATE)
    proc, _, url = _start(real_model, tmp_path / "d", "--api-key", KEY, "--chat-template-file", str(template))
    try:
        oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Describe a small dog called Rex as JSON."}]
        r = oa.chat.completions.parse(model="gemma", messages=msgs, response_format=Pet, max_tokens=120,
                                      temperature=0, logprobs=True, top_logprobs=5)
        assert isinstance(r.choices[0].message.parsed, Pet)
        for t in r.choices[0].logprobs.content:
            assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1 + 1e-4
            assert t.logprob <= 0  # the grammar may pick a token the raw model ranks lower
    finally:
        _stop(proc)
