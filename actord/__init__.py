"""actord: many long-lived LLM sessions on one accelerator, over llama-cpp-python.

`from actord import ActorSystem, Config` is the embedding API; both are resolved on first use
so that importing any part (`actord.vocabulary.errors`, `actord.engine.jobs`) does not pull the
whole system in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actord.vocabulary.config import Config
    from actord.service.system import ActorSystem

__all__ = ["ActorSystem", "Config"]


def __getattr__(name: str) -> Any:
    if name == "Config":
        from actord.vocabulary.config import Config

        return Config
    if name == "ActorSystem":
        from actord.service.system import ActorSystem

        return ActorSystem
    raise AttributeError(f"module 'actord' has no attribute {name!r}")
