"""The HTTP front's own bounds and its peer check (issue 19 points 4 and 5), through a
daemon run as users run it.

Every limit here is one a hostile or careless client hits: a header of any size, a head
trickled in a byte at a time, connections opened and never used, a body cut off halfway,
another local user on a front without a key. Each answer is a typed OpenAI error or a close,
never a traceback, and the socket keeps serving. No assertion is on time: where a deadline
matters the test waits for the answer the deadline must produce.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from actord.frontends.client import Client
from tests.frontends.test_openai_http import _metric, _start, _stop

pytestmark = pytest.mark.slow  # daemons held to their HTTP bounds' deadlines, one more started per refusal

PY = sys.executable


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-chat.gguf", seed=1,
                                chat_template=TINY_CHAT_TEMPLATE))


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            part = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return out
        if not part:
            return out
        out += part


def _kept_alive(url: str) -> socket.socket:
    """A connection the daemon has surely accepted: one request answered on it already."""
    s = socket.create_connection(_addr(url), timeout=60)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
        got += s.recv(65536)
    assert got.startswith(b"HTTP/1.1 200")
    return s


@pytest.fixture(scope="module")
def daemon(chat_model, tmp_path_factory):
    """No API key (loopback, peer-checked), small bounds so that tests reach them."""
    proc, sock, url = _start(chat_model, tmp_path_factory.mktemp("b"), "--http-max-header-bytes", "16384",
                             "--http-header-timeout-s", "1", "--http-idle-timeout-s", "1",
                             "--http-body-timeout-s", "1", "--http-max-connections", "8")
    try:
        yield sock, url, proc
    finally:
        _stop(proc)


def test_huge_header_is_refused_before_reading_it(daemon):
    sock, url, proc = daemon
    pid = proc.pid
    rss0 = _rss_mb(pid)
    s = _kept_alive(url)
    sent, total = 0, 100 << 20  # a 100 MB header value

    def pump() -> None:
        nonlocal sent
        try:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
            chunk = b"a" * (1 << 20)
            while sent < total:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # cut off: what a client that will not stop sending gets

    t = threading.Thread(target=pump)
    t.start()
    with Client(str(sock), timeout=60) as c:  # the socket stays responsive meanwhile
        for _ in range(20):
            assert c.call("health")["status"] == "ok"
    t.join(120)
    assert not t.is_alive()
    assert sent < 32 << 20, "the daemon kept reading the header"  # socket buffers + a bounded drain
    answer = _read_all(s)
    s.close()
    if answer:  # the 431 arrives unless the reset overtook it
        assert b"HTTP/1.1 431" in answer and b'"code":"header_too_large"' in answer
    assert _rss_mb(pid) - rss0 < 30, "the header was buffered"
    assert _metric(url, 'http_refused_total{reason="header_bytes"}') >= 1
    assert httpx.get(url + "/v1/models", timeout=60).status_code == 200


def test_a_header_over_the_limit_in_one_piece_gets_431(daemon):
    _, url, _ = daemon
    r = httpx.get(url + "/v1/models", headers={"x-big": "a" * 20000}, timeout=60)
    assert r.status_code == 431 and r.json()["error"]["code"] == "header_too_large"
    assert httpx.get(url + "/v1/models", headers={"x-fine": "a" * 8000}, timeout=60).status_code == 200


def test_a_trickled_head_gets_408_although_bytes_keep_coming(daemon):
    _, url, _ = daemon
    s = _kept_alive(url)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
    got = b""
    s.settimeout(60)
    # A byte at a time, never finishing the head: only the head's own deadline ends this.
    while b"HTTP/1.1 408" not in got:
        try:
            s.sendall(b"X")
        except OSError:
            break
        try:
            s.settimeout(0.2)
            got += s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
    got += _read_all(s)
    s.close()
    assert b"HTTP/1.1 408" in got and b'"code":"header_timeout"' in got


def test_a_silent_connection_is_closed(daemon):
    _, url, _ = daemon
    s = socket.create_connection(_addr(url), timeout=60)
    assert _read_all(s) == b""  # closed by the head deadline; no answer, nobody asked
    s.close()


def test_an_idle_keep_alive_connection_is_closed(daemon):
    _, url, _ = daemon
    s = _kept_alive(url)
    assert _read_all(s) == b""
    s.close()


def test_connections_over_the_cap_get_503_and_the_socket_keeps_serving(chat_model, tmp_path):
    # Deadlines far away, so that only the cap decides what happens to a connection.
    proc, sock, url = _start(chat_model, tmp_path / "d", "--http-max-connections", "8",
                             "--http-header-timeout-s", "600", "--http-idle-timeout-s", "600")
    fds0 = len(os.listdir(f"/proc/{proc.pid}/fd"))
    held = [_kept_alive(url) for _ in range(8)]  # the cap, all open
    try:
        refused = 0
        extra = []
        for _ in range(40):
            s = socket.create_connection(_addr(url), timeout=60)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
            answer = _read_all(s)
            extra.append(s)
            if answer.startswith(b"HTTP/1.1 503"):
                assert b'"code":"Overloaded"' in answer and b"Retry-After: 1" in answer
                refused += 1
        assert refused == 40
        assert len(os.listdir(f"/proc/{proc.pid}/fd")) < fds0 + 8 + 64 + 8  # the cap, lingering refusals
        with Client(str(sock), timeout=60) as c:
            assert c.call("health")["status"] == "ok"
        for s in extra:
            s.close()
        for s in held:
            s.close()
        # Room again once the held connections are gone (closed by us; the daemon sees it).
        for _ in range(200):
            r = httpx.get(url + "/v1/models", timeout=60)
            if r.status_code == 200:
                break
        assert r.status_code == 200
        assert _metric(url, 'http_refused_total{reason="connections"}') >= 40
    finally:
        for s in held:
            s.close()
        _stop(proc)


def test_a_body_that_stops_coming_gets_408(daemon):
    _, url, _ = daemon
    s = _kept_alive(url)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"messages\": ")
    answer = _read_all(s)
    s.close()
    assert answer.startswith(b"HTTP/1.1 408") and b'"code":"body_timeout"' in answer


def test_client_hanging_up_mid_body_writes_no_traceback(chat_model, tmp_path):
    proc, _, url = _start(chat_model, tmp_path / "d")
    try:
        for _ in range(3):
            s = _kept_alive(url)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 60000\r\n\r\n{\"messages\": [")
            s.close()
        for _ in range(200):
            if _metric(url, 'http_client_gone_total{phase="body"}') >= 3:
                break
        assert _metric(url, 'http_client_gone_total{phase="body"}') == 3
        assert httpx.get(url + "/v1/models", timeout=60).status_code == 200
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert b"Traceback" not in err and b"ClientDisconnect" not in err, err.decode()[-3000:]


_AS_OTHER_UID = """
import http.client, json, sys
host, port = sys.argv[1].removeprefix("http://").rsplit(":", 1)
c = http.client.HTTPConnection(host, int(port), timeout=60)
c.request("POST", "/v1/chat/completions", body=json.dumps({"messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 2}), headers={"content-type": "application/json", "x-actord-mind": "someone-elses"})
r = c.getresponse()
print(r.status, r.read().decode())
"""


def _as(uid: int, url: str) -> tuple[int, str]:
    # The system's python: the test's own may live where another uid cannot reach it.
    py = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if py is None or not os.stat(py).st_mode & 0o001:
        pytest.skip("no python executable by another uid")
    out = subprocess.run([py, "-I", "-c", _AS_OTHER_UID, url], user=uid, group=uid, extra_groups=[], cwd="/", capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    status, _, body = out.stdout.partition(" ")
    return int(status), body


def test_other_uid_is_refused_over_loopback_http_without_key(chat_model, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    proc, _, url = _start(chat_model, tmp_path / "d", "--allow-uid", "65533")
    try:
        status, body = _as(65534, url)
        assert status == 403 and '"code":"PeerRefused"' in body
        assert _as(65533, url)[0] == 200  # --allow-uid admits it, as on the socket
        assert httpx.post(url + "/v1/chat/completions", timeout=60, json={  # this uid: served
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
        assert _metric(url, 'http_refused_total{reason="peer"}') == 1
    finally:
        _stop(proc)
    # With a key the key is the gate, for every local user alike.
    proc, _, url = _start(chat_model, tmp_path / "k", "--api-key", "k")
    try:
        status, body = _as(65534, url)
        assert status == 401 and "invalid_api_key" in body
    finally:
        _stop(proc)


def test_a_refused_start_is_one_line_not_a_traceback(chat_model, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    with busy:
        out = subprocess.run([PY, "-m", "actord.cli", "serve", "--model", chat_model, "--socket", str(tmp_path / "s"),
                              "--page-dir", str(tmp_path / "p"), "--http", f"127.0.0.1:{busy.getsockname()[1]}"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "cannot listen" in out.stderr and "Traceback" not in out.stderr, out.stderr
