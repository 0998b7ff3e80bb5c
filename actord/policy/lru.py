"""Least recently used first, bounded by count and by bytes: the rule the Responses front
keeps for its stored responses (frontends/http/openai/response_store.py), and the one the
minds the daemon makes for itself are held to (`DaemonMinds`: the Responses front's
anonymous conversations, the prompt cache's minds).

Why one: both drop the oldest entries while either bound is passed, never the one just
put, and the byte count must follow every put, pop and re-listing; written twice, the two
copies had to be kept in step by hand.
"""

from __future__ import annotations

import collections
from typing import Callable, Generic, TypeVar

V = TypeVar("V")


class BoundedLru(Generic[V]):
    """Entries by key, least recently used first, each charged `size(value)` bytes."""

    def __init__(self, max_items: int, max_bytes: int, size: Callable[[V], int]) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self.held = 0
        self._size = size
        self._items: collections.OrderedDict[str, V] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> V | None:
        """The entry, now the most recently used; None when there is none."""
        v = self._items.get(key)
        if v is not None:
            self._items.move_to_end(key)
        return v

    def pop(self, key: str) -> V | None:
        v = self._items.pop(key, None)
        if v is not None:
            self.held -= self._size(v)
        return v

    def _add(self, key: str, value: V) -> list[tuple[str, V]]:
        """`key` holds `value`, the most recently used: the entries past either bound, oldest
        first (never `key` itself), already taken off."""
        self.pop(key)
        self._items[key] = value
        self.held += self._size(value)
        out = []
        while len(self._items) > 1 and (len(self._items) > self.max_items or self.held > self.max_bytes):
            old, v = self._items.popitem(last=False)
            self.held -= self._size(v)
            out.append((old, v))
        return out

    def _add_oldest(self, key: str, value: V) -> None:
        """`key` holds `value`, listed as the least recently used: the next to go."""
        self.pop(key)
        self._items[key] = value
        self._items.move_to_end(key, last=False)
        self.held += self._size(value)


class DaemonMinds(BoundedLru[int]):
    """Minds the daemon made (no client named them, so no client keeps them), by last use,
    oldest first, with their charged bytes."""

    def __init__(self, max_minds: int, max_bytes: int) -> None:
        super().__init__(max_minds, max_bytes, int)

    def touch(self, mind: str, n_bytes: int) -> list[str]:
        """`mind` was just used and now holds `n_bytes`: the minds to forget, oldest first
        (never `mind` itself), already taken off the list."""
        return [old for old, _ in self._add(mind, n_bytes)]

    def keep(self, mind: str, n_bytes: int) -> None:
        """`mind` could not be forgotten yet (it sits in a slot): listed again, as the oldest."""
        self._add_oldest(mind, n_bytes)
