"""The router's JSON-RPC socket: the daemon's protocol (rpc/protocol.py), served by the
router, so a client of one daemon (`actord.frontends.client.Client`, `actord --socket ... call`)
reaches the cluster the same way.

    completion        CompletionRequest's params; `mind` is required (the cluster places
                      minds, not slots); optional `turn_id` (a client's own retry key: a
                      second call with the same id is refused `DuplicateTurn`, with the
                      first call's answer in its data). Answers the CompletionResult.
    health            {"status": "ok", ...}
    cluster.status    nodes, their load, the directory, node losses
    cluster.migrate   {"mind", "node"}
    cluster.persist   {"mind"}: the mind's state to its page file now
    cluster.rebalance {}

A `stream: true` completion streams as the daemon's do (`completion.chunk` notifications,
then the answer), relayed from the node through a Ray streaming generator; a turn retried
after its node died does not send again the chunks its first try sent (a greedy or seeded
turn regenerates the same ones), and one answered from a dead try's record sends no more
chunks, only its whole answer. Each request line is served in its own task.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec

from actord.vocabulary.errors import InvalidParams, METHOD_NOT_FOUND
from actord.vocabulary.log import get
from actord.frontends.rpc.methods import socket_chunk
from actord.frontends.rpc.protocol import ProtocolError, decode_request, error_response, notification, result_response

log = get("actord.cluster.rpc")

MAX_LINE = 4 << 20


class RouterRpc:
    def __init__(self, router: Any, path: str) -> None:
        self.router = router
        self.path = path
        self.server: asyncio.AbstractServer | None = None
        self._ino = -1  # the inode of the socket this listener bound

    async def start(self) -> None:
        p = Path(self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() or p.is_symlink():
            os.unlink(p)  # a dead router's socket (a live one would be this actor, restarted)
        self.server = await asyncio.start_unix_server(self._serve, path=self.path, limit=MAX_LINE)
        self._ino = os.stat(self.path).st_ino
        log.info("cluster.rpc_serving", path=self.path)

    async def ensure_bound(self) -> None:
        """Bind the path again if it no longer names this listener: a node's stand-in
        (standin.py) took it while this router was starting, then went away."""
        try:
            ours = os.stat(self.path).st_ino == self._ino
        except OSError:
            ours = False
        if not ours:
            if self.server is not None:
                self.server.close()
            await self.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()
        tasks: set[asyncio.Task[None]] = set()

        async def answer(line: bytes) -> None:
            out = await self._one(line, writer.write)
            if out:
                async with lock:
                    writer.write(out)
                    await writer.drain()

        try:
            while True:
                try:
                    line = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    writer.write(error_response(None, ProtocolError(-32600, "request line too long")))
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                t = asyncio.get_running_loop().create_task(answer(line))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _one(self, line: bytes, put: Any) -> bytes:
        rid: Any = None
        try:
            req = decode_request(line.strip())
            rid = req.rid
            params = msgspec.json.decode(req.params) if req.params else {}
            if isinstance(params, list) and not params:
                params = {}
            if not isinstance(params, dict):
                raise InvalidParams("params are named (an object)")
            def stream(chunk: Any) -> None:  # the daemon's chunks: before the answer, in order
                put(notification("completion.chunk", {"id": rid, **socket_chunk(chunk)}))

            result = await self._call(req.method, params, None if req.is_notification else stream)
            return b"" if req.is_notification else result_response(rid, result)
        except ProtocolError as e:
            return error_response(e.id if e.id is not None else rid, e)
        except BaseException as e:  # every request gets exactly one answer
            if not isinstance(e, Exception):
                raise
            return error_response(rid, e)

    async def _call(self, method: str, params: dict[str, Any], stream: Any) -> Any:
        r = self.router
        if method == "completion":
            params = dict(params)
            mind = params.pop("mind", None)
            turn_id = params.pop("turn_id", None)
            if mind is None:
                raise InvalidParams("a cluster completion names its mind (the cluster places minds, not slots)")
            if turn_id is not None and not isinstance(turn_id, str):
                raise InvalidParams("turn_id is a string")
            out = await r.turn(mind, params, turn_id, stream if params.get("stream") else None)
            return out.result
        if method == "health":
            return {"status": "ok", "router": await r.ping()}
        if method == "cluster.status":
            return await r.status()
        if method == "cluster.migrate":
            return await r.migrate(params.get("mind"), params.get("node"))
        if method == "cluster.persist":
            return await r.persist(params.get("mind"))
        if method == "cluster.rebalance":
            return await r.rebalance()
        raise ProtocolError(METHOD_NOT_FOUND, f"method {method!r} is not served by the cluster router",
                            data={"type": "MethodNotFound", "method": method[:64]})
