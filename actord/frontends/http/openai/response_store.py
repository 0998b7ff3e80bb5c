"""The Responses API's store: responses kept by id for `previous_response_id`, GET and
DELETE, bounded in count and bytes (`--http-responses-max`, `--http-responses-max-bytes`).

Why a module of its own: it is the one thing the Responses front holds between requests,
and the memory report reads its bytes (service/memory.py). The eviction rule (least
recently used first; a response larger than the whole byte bound is answered, not stored)
is in docs/http.md.
"""

from __future__ import annotations

import collections
from typing import Any

import msgspec

from actord.chat.messages import ChatMessage


class Stored(msgspec.Struct):
    mind: str | None
    messages: list[ChatMessage]  # the conversation, this response's output included (no instructions)
    body: dict[str, Any]
    n_bytes: int


class ResponseStore:
    """Responses by id, oldest dropped first past `max_items` or `max_bytes`."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self.held = 0
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str) -> Stored | None:
        s = self._items.get(rid)
        if s is not None:
            self._items.move_to_end(rid)
        return s

    def put(self, rid: str, s: Stored) -> None:
        if s.n_bytes > self.max_bytes or self.max_items == 0:
            return
        self._items[rid] = s
        self.held += s.n_bytes
        while len(self._items) > self.max_items or self.held > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.held -= old.n_bytes

    def pop(self, rid: str) -> Stored | None:
        s = self._items.pop(rid, None)
        if s is not None:
            self.held -= s.n_bytes
        return s
