"""The daemon under systemd (issue 27.4): READY=1 once it serves, STOPPING=1 at shutdown,
WATCHDOG=1 pings, and sockets systemd bound served in place of its own (socket
activation). systemd is played by a datagram socket in tmp and a shim that puts the
listeners at fds 3 and 4 and sets LISTEN_PID to the daemon's pid, as systemd does."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from actord.frontends import systemd
from actord.frontends.client import Client
from actord.testing.daemon import wait_until_serving

PY = sys.executable

# systemd's part in socket activation: the listeners at fds 3.., LISTEN_PID = the daemon's pid.
_SHIM = """import fcntl, os, sys
fds = [int(f) for f in sys.argv[1].split(",")]
high = [fcntl.fcntl(f, fcntl.F_DUPFD, 100) for f in fds]
for f in fds:
    os.close(f)
for i, f in enumerate(high):
    os.dup2(f, 3 + i)
    os.close(f)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def _serve_args(model: str, tmp_path, *extra: str) -> list[str]:
    return ["-m", "actord.cli", "serve", "--model", model, "--slots", "2", "--ctx", "256",
            "--batch", "64", "--threads", "1", "--page-dir", str(tmp_path / "pages"), "--log-level", "info",
            *extra]


@pytest.fixture
def notify_socket(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "notify"))
    s.settimeout(60)
    yield s
    s.close()


def _next(s: socket.socket, prefix: str) -> dict[str, str]:
    """The next notice that starts with `prefix` (others skipped), as its KEY=VALUE lines."""
    while True:
        msg = s.recv(4096).decode()
        if msg.startswith(prefix):
            return dict(line.split("=", 1) for line in msg.splitlines())


def test_notify_sends_one_datagram_and_is_silent_without_systemd(notify_socket, tmp_path):
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify")}
    assert systemd.notify("READY=1\nSTATUS=x", env)
    assert notify_socket.recv(100) == b"READY=1\nSTATUS=x"
    assert not systemd.notify("READY=1", {})
    assert not systemd.notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody")})  # logged, not raised


def test_notify_reaches_an_abstract_socket():
    name = f"actord-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        assert systemd.notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(100) == b"STOPPING=1"


def test_the_watchdog_interval_is_half_watchdog_usec_for_this_process_only():
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "3000000"}) == 1.5
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}) == 1.5
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}) is None
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert systemd.watchdog_interval({}) is None


def test_sockets_for_another_process_are_left_alone():
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "rpc:http"}
    got = systemd.listen_fds(env)
    assert got.rpc is None and got.http is None and env["LISTEN_FDS"] == "2"


@pytest.mark.slow
def test_ready_after_the_socket_serves_watchdog_pings_and_stopping_at_shutdown(tiny_model, tmp_path, notify_socket):
    sock = tmp_path / "d.sock"
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "200000"}
    # WATCHDOG_PID must be the daemon's own: set by a shell that then becomes it.
    proc = subprocess.Popen(["sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh", PY,
                             *_serve_args(tiny_model, tmp_path, "--socket", str(sock))],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ready = _next(notify_socket, "READY=1")
        assert ready["MAINPID"] == str(proc.pid) and str(sock) in ready["STATUS"]
        with Client(str(sock), timeout=5) as c:  # serving already: no wait, no retry
            assert c.call("health")["status"] == "ok"
        # The pings repeat (their interval is pinned by the test above; the socket's timeout
        # is the hang guard, not a measure).
        _next(notify_socket, "WATCHDOG=1")
        _next(notify_socket, "WATCHDOG=1")
        proc.send_signal(signal.SIGTERM)
        _next(notify_socket, "STOPPING=1")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.slow
def test_socket_activation_serves_the_sockets_systemd_bound(tiny_model, tmp_path, notify_socket):
    path = tmp_path / "activated.sock"
    rpc = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    rpc.bind(str(path))
    rpc.listen(16)
    http = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    http.bind(("127.0.0.1", 0))
    http.listen(16)
    port = http.getsockname()[1]
    own = tmp_path / "own.sock"  # --socket: not bound, systemd's socket is served instead
    env = {**os.environ, "LISTEN_FDS": "2", "LISTEN_FDNAMES": "rpc:http", "NOTIFY_SOCKET": str(tmp_path / "notify")}
    fds = (rpc.fileno(), http.fileno())
    proc = subprocess.Popen([PY, "-c", _SHIM, ",".join(map(str, fds)),
                             *_serve_args(tiny_model, tmp_path, "--socket", str(own))],
                            env=env, pass_fds=fds, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rpc.close()
    http.close()
    try:
        # A client that connects before the daemon is up waits in systemd's socket's backlog.
        early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        early.settimeout(60)
        early.connect(str(path))
        early.sendall(b'{"jsonrpc": "2.0", "id": 1, "method": "health"}\n')
        with early, early.makefile("rb") as f:
            assert json.loads(f.readline())["result"]["status"] == "ok"
        assert _next(notify_socket, "READY=1")["MAINPID"] == str(proc.pid)
        wait_until_serving(proc, path, timeout_s=60)
        with Client(str(path), timeout=60) as c:
            out = c.call("completion", {"prompt": "Hello", "n_predict": 4, "ignore_eos": True})
            assert len(out["tokens"]) == 4 and out["stop_reason"] == "length"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            assert r.status == 200 and json.loads(r.read())["data"]
        assert not own.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read().decode()[-2000:]
        assert path.exists()  # systemd's socket: its path is systemd's to remove
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_a_passed_socket_the_daemon_cannot_use_is_refused_at_start(tiny_model, tmp_path):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    env = {**os.environ, "LISTEN_FDS": "1"}
    r = subprocess.run([PY, "-c", _SHIM, str(udp.fileno()),
                        *_serve_args(tiny_model, tmp_path, "--socket", str(tmp_path / "s.sock"))],
                       env=env, pass_fds=(udp.fileno(),), capture_output=True, text=True, timeout=120)
    udp.close()
    assert r.returncode == 1 and "not a listening stream socket" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_the_example_units_and_config_file_are_what_the_daemon_reads():
    from pathlib import Path

    from actord.frontends.config_flags import serve_config

    root = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
    c = serve_config(["--config", str(root / "actord.toml")])
    unit = (root / "actord.service").read_text()
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "--config /etc/actord/actord.toml" in unit
    sockets = (root / "actord.socket").read_text()
    assert f"ListenStream={c.socket}" in sockets and "ListenStream=127.0.0.1:" in sockets
