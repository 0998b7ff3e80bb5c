"""The real engine on this machine (no GPU): props report the backend, the devices and how
flash attention resolved; a page file records the V cache layout flash attention implies,
and one taken under another layout is refused with a typed error, not a libllama failure."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import PageDoesNotFit
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

PROMPT = [1, 44, 55, 66, 77, 88, 99, 110, 121, 132]


def cfg(model: str, page_dir, **kw) -> Config:
    return Config(model=model, slots=2, ctx=256, batch=64, page_dir=str(page_dir), **kw)


async def test_props_report_the_cpu_backend_and_flash_attention(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        dev = (await s.props_dict())["device"]
    assert dev["backend"] == "CPU" and dev["device"].startswith("CPU")
    assert dev["gpu_offload"] is False and dev["n_gpu_layers"] == 0  # nothing to offload to
    assert [d["type"] for d in dev["devices"]] == ["cpu"] and dev["devices"][0]["total_bytes"] > 0
    assert dev["flash_attn"] == "auto" and dev["flash_attn_used"] == "on"  # the CPU backend has it
    assert dev["v_trans"] is False
    assert dev["budget_bytes"] == 0 and "unlimited" in dev["budget_reason"]


async def test_flash_attention_off_is_reported_and_transposes_v(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, flash_attn="off")) as s:
        dev = (await s.props_dict())["device"]
    assert (dev["flash_attn"], dev["flash_attn_used"], dev["v_trans"]) == ("off", "off", True)


async def test_a_page_file_restores_only_under_its_own_v_layout(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, flash_attn="off")) as s:
        first = await s.complete(prompt=PROMPT, n_predict=4, slot=0, ignore_eos=True)
        await s.slot_save(0, "off.page")
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:  # flash attention auto
        with pytest.raises(PageDoesNotFit) as e:
            await s.slot_restore(1, "off.page")
        assert "flash attention" in e.value.message and "--flash-attn off" in e.value.message
        assert (await s.slot_list())[1].n_tokens == 0  # the slot stays empty and usable
        await s.complete(prompt=PROMPT, n_predict=2, slot=1, ignore_eos=True)
    async with ActorSystem(cfg(tiny_model, tmp_path, flash_attn="off")) as s:  # its own layout
        r = await s.slot_restore(1, "off.page")
        assert r["n_tokens"] == len(PROMPT) + len(first.tokens) - 1
        again = await s.complete(prompt=PROMPT + first.tokens, n_predict=2, slot=1, ignore_eos=True)
        assert again.n_prompt_processed <= 1
