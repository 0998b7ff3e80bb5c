"""The Responses API's store: responses kept by id for `previous_response_id`, GET and
DELETE, bounded in count and bytes (`--http-responses-max`, `--http-responses-max-bytes`).

Why a module of its own: it is the one thing the Responses front holds between requests,
and the memory report reads its bytes (service/memory.py). The eviction rule (least
recently used first; a response larger than the whole byte bound is answered, not stored)
is in docs/http.md.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.chat.messages import ChatMessage
from actord.policy.lru import BoundedLru


class Stored(msgspec.Struct):
    mind: str | None
    messages: list[ChatMessage]  # the conversation, this response's output included (no instructions)
    body: dict[str, Any]
    n_bytes: int
    # The tenant whose request stored it (service/tenancy.py): another tenant's GET, DELETE
    # or previous_response_id finds no such response, as with an id never stored.
    tenant: str | None = None


class ResponseStore(BoundedLru[Stored]):
    """Responses by id, oldest dropped first past `max_items` or `max_bytes`."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        super().__init__(max_items, max_bytes, lambda s: s.n_bytes)

    def put(self, rid: str, s: Stored) -> None:
        if s.n_bytes > self.max_bytes or self.max_items == 0:
            return  # answered, not stored: the store is off, or the one response would pass the bound
        self._add(rid, s)

    def find(self, rid: str, tenant: str | None) -> Stored | None:
        """The response `rid` stored by `tenant`, now the most recently used."""
        return self.get(rid) if self._owns(rid, tenant) else None

    def take(self, rid: str, tenant: str | None) -> Stored | None:
        """The response `rid` stored by `tenant`, taken off the store."""
        return self.pop(rid) if self._owns(rid, tenant) else None

    def _owns(self, rid: str, tenant: str | None) -> bool:
        s = self._items.get(rid)
        return s is not None and s.tenant == tenant
