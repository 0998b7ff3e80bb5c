"""Per-peer bounds on the HTTP front (issue 33), through a daemon without a key: one client
address holds at most its share of connections, past it the control routes (/health,
/metrics) still answer from the control room while every other route gets 503, another
address keeps being served, and a client that reads nothing of a long stream is ended by
the write deadline, its generation cancelled and its slot free. No assertion is on time:
where a deadline matters the test waits for what the deadline must produce (a metric)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from tests.frontends.test_http_bounds import _addr, _kept_alive, _read_all
from tests.frontends.test_openai_http import _metric, _start, _stop

pytestmark = pytest.mark.slow  # daemons held past their per-peer bounds and write deadlines


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama

    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-chat.gguf", seed=1,
                                 chat_template=TINY_CHAT_TEMPLATE))
    proc, _, url = _start(model, tmp_path_factory.mktemp("d"), "--http-max-connections", "16",
                          "--http-max-connections-per-peer", "4", "--http-control-connections", "2",
                          "--http-write-timeout-s", "1", "--http-idle-timeout-s", "600",
                          "--http-max-generations-per-peer", "1", "--http-max-waiting-per-peer", "0",
                          "--http-header-timeout-s", "600")
    try:
        yield url
    finally:
        _stop(proc)


def _from(source: str, url: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(60)
    s.bind((source, 0))
    s.connect(_addr(url))
    return s


def _get(s: socket.socket, path: str) -> bytes:
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    got = b""
    while True:
        head, sep, rest = got.partition(b"\r\n\r\n")
        if sep:
            n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")), 0)
            if len(rest) >= n:
                return got
        part = s.recv(65536)
        if not part:
            return got
        got += part


def test_one_address_past_its_share_gets_the_control_room_and_others_are_served(url):
    held = [_kept_alive(url) for _ in range(4)]  # 127.0.0.1's whole share
    try:
        room = socket.create_connection(_addr(url), timeout=60)
        assert _get(room, "/health").startswith(b"HTTP/1.1 200")  # control routes answer past the share
        assert _get(room, "/metrics").startswith(b"HTTP/1.1 200")
        other = socket.create_connection(_addr(url), timeout=60)
        answer = _get(other, "/v1/models")
        assert answer.startswith(b"HTTP/1.1 503") and b"only /health and /metrics" in answer
        other.close()
        second = socket.create_connection(_addr(url), timeout=60)  # the room's other place
        full = socket.create_connection(_addr(url), timeout=60)  # past share and room: refused at once
        answer = _read_all(full)
        assert answer.startswith(b"HTTP/1.1 503") and b"at most 4 connections" in answer
        full.close()
        second.close()
        room.close()
        there = _from("127.0.0.2", url)  # another address keeps its share
        assert _get(there, "/v1/models").startswith(b"HTTP/1.1 200")
        there.close()
        assert _metric(url, 'http_refused_total{reason="peer_connections"}') >= 1
    finally:
        for s in held:
            s.close()


def test_a_client_that_does_not_read_is_ended_by_the_write_deadline_and_its_slot_freed(url):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the daemon's output backs up
    s.settimeout(60)
    s.bind(("127.0.0.3", 0))
    s.connect(_addr(url))
    body = b'{"prompt": "hello", "n_predict": 4000, "ignore_eos": true, "stream": true, "id_slot": 0}'
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    while _metric(url, 'http_refused_total{reason="write_timeout"}') < 1:
        pass  # what the deadline must produce: the connection ended, counted
    got = _read_all(s)  # what the kernel had buffered, then the end
    s.close()
    assert got.startswith(b"HTTP/1.1 200") and len(got) < 4000 * 100
    while _metric(url, 'http_client_gone_total{phase="generation"}') < 1:
        pass  # the stream's generation saw the disconnect
    r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 3, "id_slot": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 3  # slot 0 serves again


def test_an_address_past_its_generations_gets_429_while_another_is_served(url):
    # The long one streams, read whole on its own thread: its first chunk says it is in
    # flight (polling instead raced: the poll itself could hold the address's one
    # generation and refuse the long one).
    started, first = threading.Event(), {}

    def long_one() -> None:
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.4"), timeout=300) as c, \
                c.stream("POST", url + "/completion",
                         json={"prompt": "a", "n_predict": 4000, "ignore_eos": True, "stream": True}) as r:
            first["status"] = r.status_code
            for _ in r.iter_lines():
                started.set()
            started.set()

    t = threading.Thread(target=long_one)
    t.start()
    assert started.wait(120)
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.4"), timeout=60) as same, \
            httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.5"), timeout=60) as other:
        r = same.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", (r.text, "long one alive", t.is_alive())
        assert r.json()["error"]["code"] == "rate_limit_exceeded"  # OpenAI's shape on OpenAI's route
        assert other.post(url + "/completion", json={"prompt": "b", "n_predict": 2}).status_code == 200
    t.join(300)
    assert first["status"] == 200
