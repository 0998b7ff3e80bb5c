"""An engine factory that keeps what it made, for tests that reach the engine's own state."""

from __future__ import annotations

from typing import Callable

from actord.engine.engine import Engine
from actord.vocabulary.config import Config


def engine_kept() -> tuple[list[Engine], Callable[[Config], Engine]]:
    engines: list[Engine] = []

    def factory(c: Config) -> Engine:
        engines.append(Engine(c))
        return engines[-1]

    return engines, factory
