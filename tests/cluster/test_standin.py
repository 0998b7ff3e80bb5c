"""The router's stand-in (actord/cluster/standin.py), without Ray: while it holds the
router's socket and HTTP address, a client gets the typed NodeUnavailable (JSON-RPC) or a
503 in the API's error shape (HTTP), never a refused connection; closed, it leaves the
path to the router."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import httpx
import pytest

from actord.cluster.standin import StandIn, router_process_gone
from actord.frontends.client import Client
from actord.vocabulary.errors import NodeUnavailable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stand_in_answers_the_routers_socket_and_http_with_a_typed_unavailable(tmp_path):
    path = str(tmp_path / "router.sock")
    dead = socket.socket(socket.AF_UNIX)  # what a killed router leaves: a socket file nobody serves
    dead.bind(path)
    dead.close()
    http = f"127.0.0.1:{_free_port()}"
    loop = asyncio.new_event_loop()
    stand_in = StandIn(path, http)
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(stand_in.start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ready.wait(60)
    try:
        assert stand_in.serving
        with Client(path, timeout=30) as c:
            with pytest.raises(NodeUnavailable) as e:
                c.call("completion", {"prompt": [1], "n_predict": 1, "mind": "ada"})
            assert e.value.data["router"] is True
            with pytest.raises(NodeUnavailable):
                c.call("health")  # the connection stays usable: each request gets its answer
        r = httpx.post(f"http://{http}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "NodeUnavailable"  # OpenAI's shape, as the front answers it
        r = httpx.post(f"http://{http}/v1/messages", json={}, timeout=30)
        assert r.status_code == 503 and r.json()["type"] == "error"  # Anthropic's on its routes
    finally:
        asyncio.run_coroutine_threadsafe(stand_in.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
    assert not os.path.exists(path)  # its own path removed: the router binds it afresh
    with pytest.raises(OSError):
        Client(path, timeout=5)


def test_a_live_router_process_is_never_stood_in_for():
    assert not router_process_gone(os.getpid())
