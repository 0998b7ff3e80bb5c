"""POST /v1/embeddings with the official `openai` client: a generated tiny model that names a
pooling type (mean) embeds in a second context on the same weights; a generative model (no
pooling) is a 400 naming `model`, and serving it goes on."""

from __future__ import annotations

import math

import openai
import pytest

from tests.frontends.test_openai_http import KEY, _start, _stop


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama

    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-embed.gguf", seed=3, pooling=1,
                                 chat_template=TINY_CHAT_TEMPLATE))
    proc, _, url = _start(model, tmp_path_factory.mktemp("d"), "--api-key", KEY)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    finally:
        _stop(proc)


def test_a_pooling_model_embeds_strings_and_tokens_as_unit_vectors(pooled):
    r = pooled.embeddings.create(model="e", input=["hello world", "the cache", "hello world"])  # base64, decoded by the SDK
    vecs = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and len(vecs[0]) == 64  # n_embd
    assert all(abs(math.sqrt(sum(v * v for v in x)) - 1) < 1e-4 for x in vecs)
    assert vecs[0] == pytest.approx(vecs[2], abs=1e-6) and vecs[0] != pytest.approx(vecs[1], abs=1e-3)
    floats = pooled.embeddings.create(model="e", input="hello world", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(vecs[0], abs=1e-6)
    assert r.usage.prompt_tokens > 3 and r.model == "e"
    # The generative context is untouched: chat still works beside it.
    c = pooled.chat.completions.create(model="e", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert c.usage.completion_tokens == 3


@pytest.mark.parametrize("kw,param", [({"dimensions": 8}, "dimensions"), ({"input": []}, "input"),
                                      ({"input": [[1, 99999]]}, "input")])
def test_a_bad_embeddings_field_is_a_400_naming_it(pooled, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        pooled.embeddings.create(model="e", **{"input": "x", **kw})
    assert e.value.param == param


def test_a_generative_model_refuses_embeddings_naming_the_limitation(tmp_path):
    from actord.testing.models import write_tiny_llama

    proc, _, url = _start(str(write_tiny_llama(tmp_path / "gen.gguf", seed=1)), tmp_path / "d")
    try:
        oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            oa.embeddings.create(model="m", input="hello")
        assert e.value.param == "model" and "pooling" in e.value.message
        assert oa.completions.create(model="m", prompt="hello", max_tokens=2).usage.completion_tokens == 2
    finally:
        _stop(proc)
