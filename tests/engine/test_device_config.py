"""The accelerator's configuration: Config fields and their serve flags, what --device-bytes 0
means on a GPU and on the CPU (actord.policy.device, and the system reading the engine's
resolved figure through the stand-in engine's seam)."""

from __future__ import annotations

import argparse

import pytest

from actord.frontends.config_flags import add_config_flags, config_from_args
from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.vocabulary.errors import InvalidParams
from actord.policy.device import MARGIN_MIN, device_budget, margin, swa_budget

GIB = 1 << 30
MIB = 1 << 20


def serve_config(*argv: str) -> Config:
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return config_from_args(p.parse_args(["--model", "m.gguf", *argv]))


def test_defaults_offload_everything_and_let_flash_attention_resolve() -> None:
    c = Config(model="m.gguf").validate()
    assert (c.n_gpu_layers, c.flash_attn, c.main_gpu, c.device_bytes) == (-1, "auto", -1, 0)


def test_serve_flags_set_the_device_fields() -> None:
    c = serve_config("--n-gpu-layers", "20", "--flash-attn", "off", "--main-gpu", "1")
    assert (c.n_gpu_layers, c.flash_attn, c.main_gpu) == (20, "off", 1)
    assert serve_config("--flash-attn").flash_attn == "on"  # a bare flag, as llama-server's -fa


def test_serve_flag_refuses_an_unknown_flash_attn_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serve_config("--flash-attn", "maybe")
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("field,value", [("n_gpu_layers", -2), ("flash_attn", "yes"), ("main_gpu", -2)])
def test_config_refuses_bad_device_values(field: str, value: object) -> None:
    with pytest.raises(InvalidParams) as e:
        Config(model="m.gguf", **{field: value}).validate()
    assert field in str(e.value.message)


# ---- what --device-bytes means --------------------------------------------------------------


def test_device_bytes_0_on_the_cpu_stays_unlimited() -> None:
    b = device_budget(0, gpu=None)
    assert b.bytes == 0 and "unlimited" in b.reason


def test_device_bytes_given_is_taken_as_is_on_either() -> None:
    assert device_budget(5 * GIB, gpu=None).bytes == 5 * GIB
    assert device_budget(5 * GIB, gpu="CUDA0 (NVIDIA H200)", total_bytes=141 * GIB,
                         free_after_context=100 * GIB).bytes == 5 * GIB


def test_device_bytes_0_on_a_gpu_is_its_free_memory_less_the_margin() -> None:
    total = 141 * GIB
    b = device_budget(0, gpu="CUDA0 (NVIDIA H200)", total_bytes=total, free_after_model=139 * GIB,
                      free_after_context=138 * GIB, kv_bytes=512 * MIB)
    assert margin(total) == total // 32
    assert b.bytes == 138 * GIB + 512 * MIB - total // 32
    assert "CUDA0" in b.reason and "margin" in b.reason


def test_the_kv_cache_added_back_is_at_most_what_the_context_took() -> None:
    # An estimate of bytes/token x n_ctx above what the context really allocated (a
    # windowed SWA cache) counts only what was allocated.
    b = device_budget(0, gpu="CUDA0", total_bytes=8 * GIB, free_after_model=6 * GIB,
                      free_after_context=5 * GIB, kv_bytes=3 * GIB)
    assert b.bytes == 5 * GIB + 1 * GIB - margin(8 * GIB)


def test_a_small_gpu_keeps_the_minimum_margin_and_never_goes_negative() -> None:
    assert margin(2 * GIB) == MARGIN_MIN
    assert device_budget(0, gpu="CUDA0", total_bytes=2 * GIB, free_after_context=100 * MIB).bytes == 0


def test_swa_weighs_a_full_cache_against_the_gpu_free_memory() -> None:
    assert swa_budget(0, gpu=None) == 0  # the caller falls back to host memory
    assert swa_budget(3 * GIB, gpu="CUDA0") == 3 * GIB
    assert swa_budget(0, gpu="CUDA0", total_bytes=141 * GIB, free_after_model=140 * GIB) == 140 * GIB - 141 * GIB // 32


@pytest.mark.anyio
@pytest.mark.parametrize("gpu", [False, True])
async def test_the_system_budgets_genes_and_slots_with_the_engine_resolved_bytes(gpu: bool) -> None:
    from actord.service.system import ActorSystem
    from actord.testing.fake_engine import FakeEngine

    report = J.DeviceReport(backend="CUDA", device="CUDA0 (NVIDIA H200)", gpu_offload=True, n_gpu_layers=-1,
                            budget_bytes=7 * GIB, budget_reason="test") if gpu else None
    cfg = Config(model=__file__, slots=2, ctx=256, batch=64)  # --device-bytes 0
    async with ActorSystem(cfg, engine_factory=lambda c: FakeEngine(c, device=report)) as s:
        props = await s.props_dict()
        assert s.residency is not None
        if gpu:
            assert s.residency.budget == 7 * GIB and props["device"]["backend"] == "CUDA"
            assert all(slot.memory.track_footprint for slot in s.slots)
        else:
            assert s.residency.budget == 0 and props["device"]["budget_bytes"] == 0
            assert not any(slot.memory.track_footprint for slot in s.slots)


# ---- what the engine reads off libllama (pure helpers, fed what libllama reports) ------------


def dev(name: str, typ: str, free: int, total: int) -> J.DeviceInfo:
    return J.DeviceInfo(name=name, description=f"{name} desc", type=typ, backend=name.rstrip("0123456789"),
                        free_bytes=free, total_bytes=total)


def test_the_main_device_is_the_asked_gpu_or_every_gpu_split() -> None:
    from actord.engine.context import _main_device

    cpu = dev("CPU", "cpu", 10 * GIB, 10 * GIB)
    gpus = [cpu, dev("CUDA0", "gpu", 100 * GIB, 141 * GIB), dev("CUDA1", "gpu", 50 * GIB, 141 * GIB)]
    assert _main_device([cpu], -1) is None
    name, free, total = _main_device(gpus, -1)  # type: ignore[misc]
    assert "CUDA0" in name and "CUDA1" in name and (free, total) == (150 * GIB, 282 * GIB)
    assert _main_device(gpus, 1) == ("CUDA1 (CUDA1 desc)", 50 * GIB, 141 * GIB)
    with pytest.raises(InvalidParams):
        _main_device(gpus, 2)


def test_how_auto_flash_attention_resolved_is_read_from_libllama_log() -> None:
    from actord.engine.context import _flash_attn_resolved

    assert _flash_attn_resolved("auto", ["llama_context: ...\n", "resolve_fused_ops: Flash Attention enabled\n"]) == "on"
    assert _flash_attn_resolved("auto", ["resolve_fused_ops: Flash Attention not supported, set to disabled\n"]) == "off"
    assert _flash_attn_resolved("auto", []) == ""  # not said: reported as unknown, never guessed
    assert _flash_attn_resolved("off", ["Flash Attention enabled"]) == "off"
