"""Clients for the daemon's socket: `Client` (blocking) and `AsyncClient` (anyio).

Both speak the same line-delimited JSON-RPC; domain errors come back as the same typed
exceptions the embedded API raises (`actord.vocabulary.errors`), so calling code does not care
whether it talks to a daemon or embeds one.
"""

from __future__ import annotations

import itertools
import socket
from typing import Any, Callable

import anyio
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from actord.vocabulary.errors import ActordError, from_dict
from actord.frontends.rpc.protocol import MAX_LINE

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()


class RpcError(ActordError):
    """A protocol-level error (parse, invalid request, method not found)."""


def _raise(err: dict[str, Any]) -> None:
    data = err.get("data") or {}
    if data.get("type") in (None, "ParseError", "InvalidRequest", "MethodNotFound", "InternalError"):
        raise RpcError(err.get("message", ""), code=err.get("code"), **{k: v for k, v in data.items() if k != "message"})
    raise from_dict(data)


_PENDING = object()


def _take(line: bytes, rid: int, on_chunk: Callable[[dict], None] | None) -> Any:
    """One line from the daemon: the call's result, a raised error, or _PENDING."""
    msg = _dec.decode(line)
    if "method" in msg:  # a streamed chunk (notification)
        if on_chunk is not None and msg["params"].get("id") == rid:
            on_chunk(msg["params"])
        return _PENDING
    if msg.get("id") != rid:
        # An error with id null answers a request whose id the daemon could not read (a
        # line over the limit, malformed JSON): with one call outstanding, it is this one.
        if not (isinstance(msg, dict) and msg.get("id") is None and "error" in msg):
            return _PENDING
    if "error" in msg:
        _raise(msg["error"])
    return msg["result"]


def _request(rid: int, method: str, params: Any) -> bytes:
    return _enc.encode({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}}) + b"\n"


class Client:
    def __init__(self, path: str, timeout: float | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.file = self.sock.makefile("rb")
        self._ids = itertools.count(1)

    def call(self, method: str, params: Any = None, on_chunk: Callable[[dict], None] | None = None) -> Any:
        rid = next(self._ids)
        self.sock.sendall(_request(rid, method, params))
        while True:
            line = self.file.readline(MAX_LINE)
            if not line:
                raise ConnectionError("daemon closed the connection")
            out = _take(line, rid, on_chunk)
            if out is not _PENDING:
                return out

    def complete(self, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        return self.call("completion", {"prompt": prompt, **params})

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """One request at a time per client object; open several clients for concurrency."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ids = itertools.count(1)
        self._stream: Any = None
        self._reader: BufferedByteReceiveStream | None = None
        self._lock = anyio.Lock()

    async def __aenter__(self) -> "AsyncClient":
        self._stream = await anyio.connect_unix(self.path)
        self._reader = BufferedByteReceiveStream(self._stream)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stream.aclose()

    async def call(self, method: str, params: Any = None, on_chunk: Callable[[dict], None] | None = None) -> Any:
        async with self._lock:
            rid = next(self._ids)
            await self._stream.send(_request(rid, method, params))
            assert self._reader is not None
            while True:
                out = _take(await self._reader.receive_until(b"\n", MAX_LINE), rid, on_chunk)
                if out is not _PENDING:
                    return out

    async def complete(self, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        return await self.call("completion", {"prompt": prompt, **params})
