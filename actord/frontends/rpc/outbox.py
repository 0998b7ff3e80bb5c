"""One socket connection's output: a queue, the writer that encodes it, and its bound.

Why it is built this way:

- One queue per connection, drained by one writer task, in order: lines never interleave,
  and a request's answer follows its chunks.
- A streamed chunk is queued as the slot made it, (request id, chunk): the sink runs in a
  slot's turn, where every microsecond delays the other requests' tokens, so nothing is
  encoded there. The writer encodes what queued since it last ran (one turn of the event
  loop's worth) and adds it to the outbox as one `b"".join`; a write takes outbox batches
  up to WRITE_CHUNK.
- The writer never waits on the socket: when the socket is full a second task waits for
  room and wakes it. So the writer keeps encoding, and counting, while a client does not
  read, and the bound is on encoded bytes, as it always was: past `max_outbox_bytes` in
  the outbox (one answer alone may be larger) the client is not reading and the
  connection is ended ("outbox_overflow"); nothing is silently dropped while it stays
  open. A write that fails is a hang-up.
"""

from __future__ import annotations

import collections
import socket
from typing import Any, Callable

import anyio

from actord.frontends.rpc import protocol as P

WRITE_CHUNK = 256 << 10  # bytes the writer hands the socket at once

Item = bytes | tuple[Any, dict[str, Any]]  # an answer's line, or (request id, chunk) to encode


class Outbox:
    def __init__(self, sock: socket.socket, limit: int, disconnect: Callable[..., None]) -> None:
        self.sock = sock
        self.limit = limit
        self.disconnect = disconnect  # the connection's: ends it (sync), and makes `closed` true
        self.closed = False
        self.queue: collections.deque[Item] = collections.deque()  # not encoded yet
        self.out: collections.deque[bytes] = collections.deque()  # encoded batches, for the socket
        self.out_bytes = 0
        self.sending = 0  # bytes handed to the socket and not yet written
        self.wake = anyio.Event()  # set: something queued, or the full socket has room
        self.full = anyio.Event()  # set: the socket took no more; `drained` waits for room

    @property
    def busy(self) -> bool:
        """Something is still to be written."""
        return bool(self.queue or self.out or self.sending)

    def put(self, item: Item) -> None:
        """Queue an answer's line, or a streamed chunk as (request id, chunk); never blocks,
        never raises (a streaming sink calls it in a slot's turn)."""
        if self.closed:
            return
        self.queue.append(item)
        self.wake.set()

    def close(self) -> None:
        """Drop everything queued: the connection is ending."""
        self.closed = True
        self.queue.clear()
        self.out.clear()
        self.out_bytes = 0

    def _encode(self) -> None:
        parts = []
        queue = self.queue
        while queue:
            item = queue.popleft()
            data = item if isinstance(item, bytes) else P.notification("completion.chunk", {"id": item[0], **item[1]})
            if self.out_bytes and self.out_bytes + len(data) > self.limit:
                self.disconnect("outbox_overflow", limit=self.limit)
                return
            parts.append(data)
            self.out_bytes += len(data)
        self.out.append(b"".join(parts))

    async def writer(self) -> None:
        view = memoryview(b"")
        while True:
            await self.wake.wait()
            self.wake = anyio.Event()
            if self.queue:
                self._encode()
                if self.closed:
                    return
            while (view or self.out) and not self.full.is_set():
                if not view:
                    view = memoryview(self._take())
                try:
                    sent = self.sock.send(view)
                except BlockingIOError:
                    self.full.set()  # `drained` wakes us when the socket has room again
                    break
                except OSError:
                    self.disconnect("hangup")
                    return
                view = view[sent:]
                self.sending = len(view)

    def _take(self) -> bytes:
        """The next write: outbox batches up to WRITE_CHUNK (one batch at least)."""
        parts, n = [], 0
        while self.out and (n == 0 or n + len(self.out[0]) <= WRITE_CHUNK):
            part = self.out.popleft()
            parts.append(part)
            n += len(part)
        self.out_bytes -= n
        self.sending = n
        return b"".join(parts)

    async def drained(self) -> None:
        """Waits on a full socket for the writer, which goes on encoding meanwhile."""
        while True:
            await self.full.wait()
            await anyio.wait_writable(self.sock)
            self.full = anyio.Event()
            self.wake.set()
