"""KV cache types (--cache-type-k / --cache-type-v, llama-server's -ctk / -ctv): the context
holds its cells in them (a q8_0 or q4_0 page is smaller per token), page files record them,
and a file of other types is refused with a typed error that changes nothing."""

from __future__ import annotations

import pytest

from actord import ActorSystem, Config
from actord.frontends.config_flags import serve_config
from actord.vocabulary.errors import InvalidParams, PageDoesNotFit
from actord.testing.models import write_tiny_llama

pytestmark = pytest.mark.anyio
PROMPT = "hello world, this is a page of cells"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    # head_dim 32: a quantized K cache needs a head dimension its block size (32) divides.
    return str(write_tiny_llama(tmp_path_factory.mktemp("m") / "t.gguf", seed=1, n_embd=128))


def _config(model: str, tmp_path, k: str, v: str) -> Config:
    return Config(model=model, slots=1, ctx=512, batch=64, cache_type_k=k, cache_type_v=v,
                  page_dir=str(tmp_path / "pages"))


def test_the_flags_and_their_llama_server_names_set_the_types_and_a_bad_one_is_refused():
    c = serve_config(["--model", "m.gguf", "--cache-type-k", "q8_0", "-ctv", "q4_0"])
    assert (c.cache_type_k, c.cache_type_v) == ("q8_0", "q4_0")
    with pytest.raises(InvalidParams, match="cache_type_k and cache_type_v are one of f16, q8_0, q4_0"):
        Config(model="m.gguf", cache_type_k="q5_1").validate()
    with pytest.raises(InvalidParams, match="needs flash attention"):
        Config(model="m.gguf", cache_type_v="q8_0", flash_attn="off").validate()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_quantized_cache_holds_fewer_bytes_per_token_and_its_file_is_refused_by_another_type(model, tmp_path):
    per_token = {}
    for k in ("f16", "q8_0", "q4_0"):
        async with ActorSystem(_config(model, tmp_path, k, k)) as s:
            assert (s.props.device.cache_type_k, s.props.device.cache_type_v) == (k, k)
            per_token[k] = s.props.kv_bytes_per_token
    assert per_token["f16"] > per_token["q8_0"] > per_token["q4_0"]
    async with ActorSystem(_config(model, tmp_path, "q8_0", "q8_0")) as s:
        await s.complete(prompt=PROMPT, n_predict=2, slot=0)
        await s.slot_save(0, "q8.page")
        await s.slot_erase(0)
        assert (await s.slot_restore(0, "q8.page"))["n_tokens"] > 0  # the same types restore
    async with ActorSystem(_config(model, tmp_path, "f16", "f16")) as s:
        with pytest.raises(PageDoesNotFit, match=r"q8_0/q8_0 \(K/V\).*f16/f16"):
            await s.slot_restore(0, "q8.page")
        assert (await s.slot_list())[0].n_tokens == 0  # the refusal changed nothing
