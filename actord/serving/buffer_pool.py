"""Host buffers that pages let go of, kept warm for the next page_out to write into.

Why: a fresh multi-MB buffer costs a page fault per 4 KiB page on its first write, and
that, not the copy, was most of a page_out (a 134 MB state: a copy into a cold buffer ran
3x slower than into a warm one). A page's state buffer is therefore not freed when the page
goes (page_in done, dropped, replaced, spilled with drop): the PageStore keeps it here, and
the next page_out of a state that fits is copied into it, already faulted in.

The pool is part of the page RAM the ceiling bounds: the PageStore keeps
`(charged - earmarked) + pool.bytes <= ceiling` at every message boundary (a buffer enters
only if it fits under what the pages leave free, and admissions trim the pool first, oldest
buffer first). Pure and synchronous: only the PageStore actor touches it.

A buffer serves a state of n bytes when its capacity is in [n, n + n/8 + 4 KiB]: a large
buffer is not spent on a small state. A fresh buffer is allocated with n/16 of headroom
(`capacity_for`), so a mind whose state grew by a turn still fits the buffer it left; the
headroom is charged with the page (a page's charge is its buffer's bytes, never less).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from actord.engine.jobs import HostBuffer

PAGE = 4096


def capacity_for(n: int) -> int:
    """A fresh buffer's capacity for an n-byte state: n/16 of headroom, whole 4 KiB pages."""
    want = n + n // 16
    return max(PAGE, (want + PAGE - 1) // PAGE * PAGE)


def fits(capacity: int, n: int) -> bool:
    return n <= capacity <= n + n // 8 + PAGE


def buffer_of(state: Any) -> HostBuffer | None:
    """The whole engine buffer a page's state views (a memoryview of a numpy array the
    engine allocated), or None for anything else (bytes read from a file, say)."""
    if not isinstance(state, memoryview):
        return None
    arr = state.obj
    if (not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1 or arr.base is not None
            or not arr.flags.c_contiguous or not arr.flags.writeable):
        return None
    return HostBuffer(arr)


class BufferPool:
    def __init__(self) -> None:
        self._bufs: OrderedDict[int, HostBuffer] = OrderedDict()  # oldest first
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.dropped = 0  # buffers let go to keep the bound

    def __len__(self) -> int:
        return len(self._bufs)

    def take(self, n: int) -> HostBuffer | None:
        """The smallest pooled buffer that serves an n-byte state, out of the pool."""
        best = None
        for key, b in self._bufs.items():
            if fits(b.capacity, n) and (best is None or b.capacity < self._bufs[best].capacity):
                best = key
        if best is None:
            self.misses += 1
            return None
        b = self._bufs.pop(best)
        self.bytes -= b.capacity
        self.hits += 1
        return b

    def give(self, buf: HostBuffer, room: int) -> bool:
        """Keep `buf` if it fits in `room` bytes beside what the pool holds."""
        key = id(buf.array)
        if key in self._bufs or self.bytes + buf.capacity > room:
            self.dropped += key not in self._bufs
            return False
        self._bufs[key] = buf
        self.bytes += buf.capacity
        return True

    def trim(self, room: int) -> None:
        """Let buffers go, oldest first, until the pool holds at most `room` bytes."""
        while self._bufs and self.bytes > max(0, room):
            _, b = self._bufs.popitem(last=False)
            self.bytes -= b.capacity
            self.dropped += 1
