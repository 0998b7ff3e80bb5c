"""The socket's outbox (actord/frontends/rpc/outbox.py), over a socketpair: chunks are
queued as the slot made them and encoded by the writer, in order with the answers; a peer
that does not read is cut off by `max_outbox_bytes` of encoded output, counted while the
socket is full."""

from __future__ import annotations

import json
import socket
from typing import Any

import anyio

from actord.frontends.rpc.outbox import Outbox
from tests.waits import eventually


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    return a, b


def test_chunks_are_encoded_by_the_writer_in_order_with_the_answers():
    ours, theirs = _pair()
    ended: list[str] = []
    box = Outbox(ours, 1 << 20, lambda reason, **_: ended.append(reason))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(box.writer)
            tg.start_soon(box.drained)
            chunk = {"slot": 0, "content": "x", "tokens": [7]}
            for i in range(100):
                box.put((3, chunk))
            assert len(box.queue) == 100 and not box.out  # queued as they are: nothing encoded yet
            box.put(b'{"jsonrpc":"2.0","id":3,"result":{}}\n')
            await eventually(lambda: not box.busy, "the writer sends all it was given")
            tg.cancel_scope.cancel()

    anyio.run(main)
    theirs.settimeout(5)
    data = b""
    while data.count(b"\n") < 101:
        data += theirs.recv(1 << 20)
    lines = [json.loads(ln) for ln in data.splitlines()]
    assert [ln.get("method") for ln in lines[:100]] == ["completion.chunk"] * 100
    assert lines[0]["params"] == {"id": 3, "slot": 0, "content": "x", "tokens": [7]}
    assert lines[100] == {"jsonrpc": "2.0", "id": 3, "result": {}} and ended == []
    ours.close()
    theirs.close()


def test_a_peer_that_does_not_read_is_cut_off_by_the_bound_on_encoded_bytes():
    ours, theirs = _pair()
    ended: list[tuple[str, dict[str, Any]]] = []
    limit = 64 << 10
    box = Outbox(ours, limit, lambda reason, **info: (ended.append((reason, info)), box.close()))
    peak = [0]

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(box.writer)
            tg.start_soon(box.drained)
            chunk = {"slot": 0, "content": "y" * 100, "tokens": [7]}
            for _ in range(100_000):  # ~15 MB encoded: far past the socket's buffers and the bound
                box.put((1, chunk))
                await anyio.lowlevel.checkpoint()  # one chunk a turn, as a slot makes them
                peak[0] = max(peak[0], box.out_bytes)
                if box.closed:
                    break
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert ended == [("outbox_overflow", {"limit": limit})]
    assert peak[0] <= limit  # counted as encoded, while the socket was full
    assert not box.queue and not box.out and box.out_bytes == 0
    ours.close()
    theirs.close()
