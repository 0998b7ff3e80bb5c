"""Per-key bounds on the HTTP front (issue 33), through a daemon with two API keys: one key
past its share of connections or generations gets 429 in the route's API shape while the
other key is served; a stream whose client takes nothing ends its generation before the
write deadline, so its slot serves again. No assertion is on time: where something must
happen the test waits for what it must produce (a metric, an answer)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from tests.frontends.test_http_bounds import _addr
from tests.frontends.test_openai_http import KEY, _metric, front_on_tiny

OTHER = "second-key"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    for _, url in front_on_tiny(tmp_path_factory, "--http-max-connections-per-key", "2",
                                "--http-max-generations-per-key", "1", "--http-max-generations-per-peer", "8",
                                "--http-max-waiting-per-peer", "0", "--http-write-timeout-s", "600",
                                "--http-stream-ahead-chunks", "4", "--http-idle-timeout-s", "600",
                                keys=f"{KEY},{OTHER}"):
        yield url


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _models(s: socket.socket, key: str) -> bytes:
    """GET /v1/models under `key` on the connection `s`: the whole answer."""
    s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    got = b""
    while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
        part = s.recv(65536)
        assert part, got
        got += part
    return got


def _keyed(url: str, key: str) -> socket.socket:
    """A connection the daemon counts against `key`: one request answered on it already."""
    s = socket.create_connection(_addr(url), timeout=60)
    assert _models(s, key).startswith(b"HTTP/1.1 200")
    return s


def test_a_key_past_its_connections_gets_429_in_its_apis_shape_while_another_key_is_served(url):
    held = [_keyed(url, KEY) for _ in range(2)]  # the key's whole share
    try:
        with httpx.Client(timeout=60) as c:
            r = c.get(url + "/v1/models", headers=_auth(KEY))
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "rate_limit_exceeded"  # OpenAI's shape
            assert "connections" in r.json()["error"]["message"]
        with httpx.Client(timeout=60) as c:
            r = c.post(url + "/v1/messages", headers={"x-api-key": KEY},
                       json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 429 and r.json()["type"] == "error"  # Anthropic's shape on its route
            assert r.json()["error"]["type"] == "rate_limit_error"
        with httpx.Client(timeout=60) as c:
            assert c.get(url + "/v1/models", headers=_auth(OTHER)).status_code == 200  # the other key's share
            assert c.get(url + "/health").status_code == 200  # control routes answer past a key's share
    finally:
        for s in held:
            s.close()
    assert _metric(url, 'http_refused_total{reason="key_connections"}') >= 2
    with httpx.Client(timeout=60) as c:  # its connections closed, the key is served again
        while c.get(url + "/v1/models", headers=_auth(KEY)).status_code == 429:
            pass  # the closed connections are counted out as the daemon sees them go


def _unread_stream(url: str, key: str) -> socket.socket:
    """A long stream under `key` whose client reads nothing (a small window: the daemon's
    output backs up); its answer cannot end, so its generation counts till it is closed."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(60)
    s.connect(_addr(url))
    body = b'{"prompt": "hello", "n_predict": 4000, "ignore_eos": true, "stream": true, "id_slot": 0}'
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + key.encode() + b"\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def test_a_key_past_its_generations_gets_429_while_another_key_is_served(url):
    held = _unread_stream(url, KEY)
    try:
        with httpx.Client(timeout=60) as c:
            while True:  # until the stream is in flight: then the same key is refused at once
                r = c.post(url + "/v1/chat/completions", headers=_auth(KEY),
                           json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
                if r.status_code != 200:
                    break
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and "API key" in r.json()["error"]["message"]
            r = c.post(url + "/completion", headers=_auth(OTHER), json={"prompt": "b", "n_predict": 2})
            assert r.status_code == 200  # the same address, another key: served
    finally:
        held.close()
    assert _metric(url, 'http_refused_total{reason="key_generations"}') >= 1


def test_a_kept_alive_connection_counts_against_the_key_its_latest_request_presented(url):
    held: list[socket.socket] = []
    while len(held) < 2:  # the key's whole share (an earlier test's closed connections may still count)
        s = socket.create_connection(_addr(url), timeout=60)
        if _models(s, KEY).startswith(b"HTTP/1.1 200"):
            held.append(s)
        else:
            s.close()
    try:
        full = socket.create_connection(_addr(url), timeout=60)
        assert _models(full, KEY).startswith(b"HTTP/1.1 429")  # the share is taken
        full.close()
        assert _models(held[0], OTHER).startswith(b"HTTP/1.1 200")  # the connection moves to the other key
        again = socket.create_connection(_addr(url), timeout=60)
        assert _models(again, KEY).startswith(b"HTTP/1.1 200")  # so the key has room for one more
        again.close()
    finally:
        for s in held:
            s.close()


def test_a_keys_generations_are_one_share_from_every_address(url):
    # One key's holder on many addresses (a NAT, a fleet: bench/abuse.py's per_key attack):
    # each address is within its own share (8 here), and the key's (1) binds them all. The
    # long one streams, read on its own thread: its first chunk says it is in flight.
    started, done, first = threading.Event(), threading.Event(), {}

    def long_one() -> None:
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.6"), timeout=300) as c, \
                c.stream("POST", url + "/completion", headers=_auth(KEY),
                         json={"prompt": "a", "n_predict": 4000, "ignore_eos": True, "stream": True}) as r:
            first["status"] = r.status_code
            for _ in r.iter_lines():
                started.set()
                if done.is_set():
                    break  # closing the stream ends its generation
            started.set()

    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.7"), timeout=60) as c:
        while c.post(url + "/completion", headers=_auth(KEY), json={"prompt": "b", "n_predict": 1}).status_code == 429:
            pass  # an earlier test's generation under the key is still being cancelled
    t = threading.Thread(target=long_one)
    t.start()
    try:
        assert started.wait(120)
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.7"), timeout=60) as c:
            r = c.post(url + "/completion", headers=_auth(KEY), json={"prompt": "b", "n_predict": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", (r.text, "long one alive", t.is_alive())
            assert "API key" in r.text
            r = c.post(url + "/completion", headers=_auth(OTHER), json={"prompt": "b", "n_predict": 2})
            assert r.status_code == 200  # another key from the same address: served
    finally:
        done.set()
        t.join(300)
    assert first["status"] == 200


def test_a_stream_whose_client_takes_nothing_ends_its_generation_and_frees_its_slot(url):
    # The write deadline is 600 s here: only the stream's own bound can free the slot.
    before = _metric(url, 'http_refused_total{reason="stream_output"}')
    s = _unread_stream(url, OTHER)
    try:
        while _metric(url, 'http_refused_total{reason="stream_output"}') <= before:
            pass  # what the bound must produce: the stream cut, counted
        r = httpx.post(url + "/completion", headers=_auth(KEY),
                       json={"prompt": "hi", "n_predict": 3, "id_slot": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 3  # slot 0 serves again
        got = b""
        while b"client_too_slow" not in got:  # read at last: the stream ends saying why
            part = s.recv(65536)
            assert part, got[-500:]
            got += part
        assert got.startswith(b"HTTP/1.1 200")
        assert got.count(b'"content"') < 4000  # the generation ended long before its n_predict
    finally:
        s.close()


def test_shares_bound_queued_chunks_per_key_and_release_them():
    from actord.frontends.shares import Shares

    sh = Shares(generations_per_peer=8, generations_per_key=1, queued_per_peer=100, queued_per_key=3)
    assert all(sh.queue("10.0.0.1", "key0") for _ in range(3))
    assert not sh.queue("10.0.0.2", "key0")  # another address, the same key: the key's share is taken
    assert sh.queue("10.0.0.2", "key1") and sh.queue("10.0.0.2", None)  # another key, and no key: their own
    sh.taken("10.0.0.1", "key0", 3)
    assert sh.queue("10.0.0.2", "key0") and not sh.key_queued["key1"] - 1
    sh.start("10.0.0.1", "key0")
    assert sh.refusal("10.0.0.2", "key0")[1] == "key_generations"
    assert sh.refusal("10.0.0.2", "key1") is None
    sh.end("10.0.0.1", "key0")
    assert sh.refusal("10.0.0.2", "key0") is None and not sh.generations and not sh.key_generations


def test_a_stored_response_is_found_only_by_the_key_that_stored_it(url):
    with httpx.Client(timeout=120) as c:
        r = c.post(url + "/v1/responses", headers=_auth(KEY),
                   json={"model": "m", "input": "a private note", "max_output_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        # Another tenant holding the id: as if it were never stored, and nothing changes.
        assert c.get(f"{url}/v1/responses/{rid}", headers=_auth(OTHER)).status_code == 404
        assert c.delete(f"{url}/v1/responses/{rid}", headers=_auth(OTHER)).status_code == 404
        cont = c.post(url + "/v1/responses", headers=_auth(OTHER),
                      json={"model": "m", "input": "and?", "max_output_tokens": 2, "previous_response_id": rid})
        assert cont.status_code == 400 and cont.json()["error"]["param"] == "previous_response_id"
        mine = c.get(f"{url}/v1/responses/{rid}", headers=_auth(KEY))
        assert mine.status_code == 200 and mine.json()["id"] == rid
        assert c.delete(f"{url}/v1/responses/{rid}", headers=_auth(KEY)).status_code == 200
