"""One lock per mind, shared by the router's parts: one mind's turns run one at a time, and
a migration or a re-homing "freezes" a mind by holding its lock."""

from __future__ import annotations

import asyncio


class MindLocks:
    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    def of(self, mind: str) -> asyncio.Lock:
        lock = self._locks.get(mind)
        if lock is None:
            lock = self._locks[mind] = asyncio.Lock()
        return lock
