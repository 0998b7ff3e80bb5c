"""Waiting for a daemon started in a subprocess, and stopping it (benchmarks and tests start
`actord serve`)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable

from actord.frontends.client import Client


def wait_until_serving(proc: subprocess.Popen, sock: Path, exited: Callable[[], str] | None = None, *,
                       timeout_s: float = 120.0, poll_s: float = 0.05) -> None:
    """Return once the daemon answers `health` on `sock`. A daemon that exits first raises
    RuntimeError with `exited()` (its log's tail, say; by default the tail of its stderr
    when that is a pipe); one that does not answer within `timeout_s` is killed and
    TimeoutError raised."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            tail = exited() if exited is not None else (
                proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else "")
            raise RuntimeError(f"daemon exited: {tail}")
        if sock.exists():
            try:
                with Client(str(sock), timeout=5) as c:
                    c.call("health")
                return
            except OSError:
                pass
        time.sleep(poll_s)
    proc.kill()
    raise TimeoutError("daemon did not come up")


def stop_daemon(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
