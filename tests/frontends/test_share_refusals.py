"""A generation past its client's share (issue 33, shares.py) waits its turn from its
request head, its body unread, and is served once the share frees; past the line's bound
too, it is refused from its head: 429 in its route's API shape, its body never read,
counted under its metric reason, sent after a pause. The count taken at the head is the
generation's until its answer ends (not taken again as it starts). With several API keys
a key's default share leaves a slot free of it. The route tests drive the front as an
ASGI app (the body's reads are what is checked); the rest go through a daemon with two
keys and the default shares, its line off. No assertion is on time."""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest

from actord.frontends.http.app import HttpFront
from actord.frontends.shares import key_generations
from actord.vocabulary.config import Config
from actord.vocabulary.metrics import Metrics
from tests.frontends.test_http_bounds import _addr
from tests.frontends.test_key_bounds import OTHER, _unread_stream
from tests.frontends.test_openai_http import BODY_LIMIT, KEY, _metric, front_on_tiny
from tests.frontends.test_client_fields import Recorder as ClientFieldsRecorder
from tests.waits import eventually

MSGS = [{"role": "user", "content": "hi"}]
# Each generating route, a body it would serve, and how its API's 429 reads.
ROUTES = {
    "/v1/chat/completions": ({"model": "m", "messages": MSGS}, lambda b: b["error"]["code"] == "rate_limit_exceeded"),
    "/chat/completions": ({"model": "m", "messages": MSGS}, lambda b: b["error"]["code"] == "rate_limit_exceeded"),
    "/v1/completions": ({"model": "m", "prompt": "hi"}, lambda b: b["error"]["code"] == "rate_limit_exceeded"),
    "/v1/responses": ({"model": "m", "input": "hi"}, lambda b: b["error"]["code"] == "rate_limit_exceeded"),
    "/v1/messages": ({"model": "m", "messages": MSGS, "max_tokens": 4},
                     lambda b: b["type"] == "error" and b["error"]["type"] == "rate_limit_error"),
    "/completion": ({"prompt": "hi"}, lambda b: b["error"]["code"] == 429),  # llama-server's shape
    "/completions": ({"prompt": "hi"}, lambda b: b["error"]["code"] == 429),
}
PEER = "127.0.0.1"


class Recorder(ClientFieldsRecorder):
    """test_client_fields' recorder (each generation a route asks for recorded, then
    refused), with the metrics registry the share refusals are counted in."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics = Metrics()


def _front(waiting: int = 0) -> tuple[HttpFront, Recorder]:
    rec = Recorder()
    front = HttpFront(None, Config(model="/models/tiny.gguf", api_key=KEY, http_max_generations_per_peer=1,
                                   http_max_waiting_per_peer=waiting))
    front.attach(rec)  # type: ignore[arg-type]
    return front, rec


def _refused(rec: Recorder, reason: str) -> float:
    return rec.metrics.http_refused_total.labels(reason=reason)._value.get()


async def _post(front: HttpFront, path: str, body: bytes | None, on_read: Any = None,
                done: list[str] | None = None, extra: dict | None = None) -> tuple[int, dict, dict]:
    """POST `path` to the app from PEER under KEY, its head declaring `body`'s length (or a
    large one, with `body` None: a body that never comes; reading it fails the test);
    `extra`: more of the scope (what the connection's protocol adds)."""
    declared = len(body) if body is not None else BODY_LIMIT - 1
    scope = {**(extra or {}), "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "client": (PEER, 40000), "server": ("127.0.0.1", 8080),
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                         (b"content-length", str(declared).encode()), (b"authorization", f"Bearer {KEY}".encode())]}
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        assert body is not None, "the body of a refused request was read"
        if delivered:
            await asyncio.Event().wait()  # then only the disconnect, which never comes here
        delivered = True
        if on_read is not None:
            on_read()
        return {"type": "http.request", "body": body, "more_body": False}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if done is not None and message["type"] == "http.response.start":
            done.append(f"sent {message['status']}")

    await front.app(scope, receive, send)
    if not sent:
        return 0, {}, {}  # nothing answered: the client was gone
    start = next(m for m in sent if m["type"] == "http.response.start")
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(text)


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_generation_past_its_share_is_refused_from_its_head_in_its_apis_shape_its_body_unread(path):
    front, rec = _front()
    front.shares.start(PEER, None)  # the address's one generation is in flight
    status, headers, body = asyncio.run(_post(front, path, None))
    assert status == 429 and headers["retry-after"] == "1", body
    assert ROUTES[path][1](body), body
    assert "generations in flight" in json.dumps(body)
    assert _refused(rec, "peer_generations") == 1 and not rec.asked


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion", "/v1/messages"])
def test_a_generation_within_its_share_is_read_and_asked_for(path):
    front, rec = _front()
    front.shares.start(PEER, None)
    front.shares.end(PEER, None)  # the share is free again
    status, _, body = asyncio.run(_post(front, path, json.dumps(ROUTES[path][0]).encode()))
    assert status == 400 and "recorded" in json.dumps(body)  # it reached the service
    assert len(rec.asked) == 1 and _refused(rec, "peer_generations") == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion", "/v1/messages"])
def test_a_generation_counted_at_its_head_is_not_counted_again_as_it_starts(path):
    # The head took the address's one generation; another of the address started (past the
    # share: the test's own count) while the body arrived: the generation holds its count.
    front, rec = _front()
    status, _, body = asyncio.run(_post(front, path, json.dumps(ROUTES[path][0]).encode(),
                                        on_read=lambda: front.shares.start(PEER, None)))
    assert status == 400 and "recorded" in json.dumps(body)  # it reached the service
    assert len(rec.asked) == 1 and _refused(rec, "peer_generations") == 0
    assert front.shares.generations[PEER] == 1  # its own count released as its answer ended


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion", "/v1/messages"])
def test_a_generation_past_its_share_waits_its_turn_with_its_body_unread_and_is_served(path):
    front, rec = _front(waiting=1)
    events: list[str] = []

    async def run() -> tuple[int, dict]:
        front.shares.start(PEER, None)  # the address's one generation is in flight
        async with anyio.create_task_group() as tg:
            got: dict[str, Any] = {}

            async def waiting() -> None:
                got["status"], _, got["body"] = await _post(front, path, json.dumps(ROUTES[path][0]).encode(),
                                                            on_read=lambda: events.append("read"))

            tg.start_soon(waiting)
            await eventually(lambda: front.shares.waiting[PEER] == 1, "the second generation waits")
            assert rec.metrics.registry.get_sample_value("generations_waiting") == 1
            # The line holds one of the address's: the next is refused, its body unread.
            status, _, body = await _post(front, path, None)
            assert status == 429 and ROUTES[path][1](body), body
            assert "1 waiting" in json.dumps(body) and events == [] and not rec.asked
            events.append("share freed")
            front.shares.end(PEER, None)
        return got["status"], got["body"]

    status, body = asyncio.run(run())
    assert events == ["share freed", "read"]  # its body was read only once it was let in
    assert status == 400 and "recorded" in json.dumps(body) and len(rec.asked) == 1
    assert not front.shares.generations and not front.shares.waiting and not front.shares.line
    assert rec.metrics.registry.get_sample_value("generations_waiting") == 0


def test_a_generation_waiting_its_turn_leaves_the_line_when_its_client_hangs_up():
    from actord.frontends.http.bounds import GONE

    front, rec = _front(waiting=4)

    async def run() -> tuple[int, dict]:
        front.shares.start(PEER, None)  # the address's one generation is in flight
        gone = asyncio.Event()  # what the connection's protocol sets as it is lost (bounds.py)
        async with anyio.create_task_group() as tg:
            got: dict[str, Any] = {}

            async def waiting() -> None:
                got["status"], _, got["body"] = await _post(front, "/completion", None, extra={GONE: gone})

            tg.start_soon(waiting)
            await eventually(lambda: front.shares.waiting[PEER] == 1, "it waits")
            gone.set()
            await eventually(lambda: "status" in got, "it ended")
        return got["status"], got["body"]

    status, body = asyncio.run(run())
    assert status == 0 and body == {}  # answered nothing: nobody to answer; its body never read
    assert not front.shares.waiting and not front.shares.line and front.shares.generations[PEER] == 1
    assert rec.metrics.http_client_gone_total.labels(phase="waiting")._value.get() == 1 and not rec.asked


def test_a_shares_429_is_sent_only_after_its_pause(monkeypatch):
    from actord.frontends import shares

    done: list[str] = []

    async def sleep(seconds: float) -> None:
        done.append(f"paused {seconds}")

    monkeypatch.setattr(shares, "anyio", SimpleNamespace(sleep=sleep))
    front, rec = _front()
    front.shares.start(PEER, None)
    status, _, _ = asyncio.run(_post(front, "/completion", None, done=done))
    assert status == 429 and done == [f"paused {shares.REFUSED_PAUSE_S}", "sent 429"]


def test_with_several_keys_a_keys_default_share_is_every_slot_but_one():
    assert [key_generations(0, slots) for slots in (1, 2, 3, 8)] == [1, 1, 2, 7]
    assert key_generations(5, 2) == 5  # a configured share is kept, whatever the slots
    front = HttpFront(None, Config(model="/models/tiny.gguf", api_key="a,b", slots=4))
    assert front.shares.generations_per_key == 3
    assert front.shares.generations_per_peer == 8  # the address's default is unchanged: twice the slots


# -- through a daemon with two keys and the default shares (2 slots: a key holds 1) ----------------


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    for _, url in front_on_tiny(tmp_path_factory, "--http-write-timeout-s", "600", "--http-idle-timeout-s", "600",
                                "--http-max-waiting-per-peer", "0", keys=f"{KEY},{OTHER}"):
        yield url


def _answer(s: socket.socket) -> bytes:
    """One whole answer with a Content-Length read from `s`."""
    got = b""
    while True:
        head, sep, rest = got.partition(b"\r\n\r\n")
        if sep:
            n = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:"))
            if len(rest) >= n:
                return got
        part = s.recv(65536)
        assert part, got
        got += part


def _held(url: str, key: str) -> socket.socket:
    """A stream under `key` whose client reads nothing, once it is in flight (its head says
    200: it is sent with the first chunk): it holds one of the key's generations until it
    is closed."""
    while True:
        held = _unread_stream(url, key)
        if held.recv(12).startswith(b"HTTP/1.1 200"):
            return held
        held.close()  # refused: an earlier test's generation under the key is still being cancelled


def test_with_two_keys_and_two_slots_one_key_holds_one_generation_by_default_and_the_other_is_served(url):
    held = _held(url, KEY)
    try:
        with httpx.Client(timeout=60) as c:
            r = c.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "m", "max_tokens": 1, "messages": MSGS})
            assert r.status_code == 429 and "API key has 1 generations" in r.json()["error"]["message"], r.text
            r = c.post(url + "/completion", headers={"authorization": f"Bearer {OTHER}"},
                       json={"prompt": "b", "n_predict": 2})
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 2  # the slot the key left free
    finally:
        held.close()


def test_a_head_with_a_huge_content_length_and_no_body_gets_429_past_the_share(url):
    held = _held(url, KEY)
    before = _metric(url, 'http_refused_total{reason="key_generations"}')
    try:
        s = socket.create_connection(_addr(url), timeout=60)
        # Within the body limit: were the body awaited, this would be a 408 after the body
        # deadline (60 s), not a 429 at once.
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"x-api-key: " + KEY.encode() + b"\r\nContent-Length: " + str(BODY_LIMIT - 1).encode() + b"\r\n\r\n")
        got = _answer(s)
        s.close()
        assert got.startswith(b"HTTP/1.1 429") and b"Retry-After: 1" in got, got
        assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["type"] == "rate_limit_error"  # Anthropic's
    finally:
        held.close()
    assert _metric(url, 'http_refused_total{reason="key_generations"}') >= before + 1


def test_a_connection_answered_429_for_its_share_is_served_on_once_the_share_is_free(url):
    held = _held(url, KEY)
    try:
        s = socket.create_connection(_addr(url), timeout=60)
        body = json.dumps({"prompt": "b", "n_predict": 2}).encode()
        ask = (b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
               + b"\r\n\r\n" + body)
        for _ in range(2):  # as a flood asks, on one connection: each answered once, its body unread
            s.sendall(ask)
            assert _answer(s).startswith(b"HTTP/1.1 429")
    finally:
        held.close()
    s.sendall(ask)  # the share free again: the same connection is served
    got = _answer(s)
    while got.startswith(b"HTTP/1.1 429"):  # the held stream's generation is still being cancelled
        s.sendall(ask)
        got = _answer(s)
    assert got.startswith(b"HTTP/1.1 200") and json.loads(got.partition(b"\r\n\r\n")[2])["tokens_predicted"] == 2
    s.close()
