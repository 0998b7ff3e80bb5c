"""A daemon under test: `actord serve` in its own process, with its log, metrics, fds and RSS at hand;
or one serving HTTP for a module's tests (`serving_http`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from actord.frontends.client import Client
from actord.testing.daemon import wait_until_serving

PY = sys.executable


class Daemon:
    def __init__(self, model: str, folder: Path, *extra: str, name: str = "d", ctx: int = 4096,
                 wait: bool = True) -> None:
        self.folder = folder
        self.sock = folder / f"{name}.sock"
        self.log_path = folder / f"{name}.log"
        self.args = [PY, "-m", "actord.cli", "serve", "--model", model, "--slots", "2", "--ctx", str(ctx),
                     "--batch", "64", "--threads", "1", "--socket", str(self.sock),
                     "--page-dir", str(folder / f"{name}-pages"), "--log-level", "info", *extra]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log)
        if wait:
            self.wait_ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 60) -> None:
        wait_until_serving(self.proc, self.sock, lambda: self.log()[-2000:], timeout_s=timeout)

    def client(self, timeout: float = 60) -> Client:
        return Client(str(self.sock), timeout=timeout)

    def call(self, method: str, params: Any = None) -> Any:
        with self.client() as c:
            return c.call(method, params)

    def raw(self, timeout: float = 60) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(str(self.sock))
        return s

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.call("metrics")["text"].splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def nfds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def assert_clean_log(self) -> None:
        text = self.log()
        for bad in ("Traceback", "internal_error", "actor.crashed", "connection_failed", "InvalidStateError"):
            assert bad not in text, f"{bad} in the daemon log:\n{text[-3000:]}"


@contextlib.contextmanager
def serving_http(model: str | Path, folder: Path, *extra: str, slots: int = 2, ctx: int = 2048, batch: int = 64,
                 timeout: float = 30) -> Iterator[tuple[str, Client]]:
    """`actord serve --http 127.0.0.1:0` on `model`, its socket and pages in `folder`: its HTTP
    address and a client on its socket. At the end it is killed, and its log must hold no
    traceback, internal error or crashed actor."""
    sock = folder / "actord.sock"
    proc = subprocess.Popen(
        [PY, "-m", "actord.cli", "serve", "--model", str(model), "--slots", str(slots), "--ctx", str(ctx),
         "--batch", str(batch), "--threads", "1", "--socket", str(sock), "--page-dir", str(folder / "pages"),
         "--log-level", "warning", "--http", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until_serving(proc, sock, timeout_s=60, poll_s=0.1)
        with Client(str(sock), timeout=timeout) as c:
            yield "http://" + c.call("props")["http"], c
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    log = err.decode(errors="replace")
    for bad in ("Traceback", "internal_error", "actor.crashed"):
        assert bad not in log, log[-3000:]


def request(rid: Any, method: str, params: Any = None) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}}).encode() + b"\n"


def read_lines(s: socket.socket, n: int) -> list[dict]:
    f = s.makefile("rb")
    try:
        return [json.loads(f.readline()) for _ in range(n)]
    finally:
        f.close()


def read_to_eof(s: socket.socket, timeout: float = 60) -> bytes:
    """Everything until the daemon closes the connection (raises if it never does)."""
    s.settimeout(timeout)
    chunks = []
    while True:
        b = s.recv(1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)
