"""Restarts as an operator does them (issue 34): minds spread over slots, RAM pages and page
files; SIGTERM (or the `stop` verb), or kill -9 once write-behind has written them; start
again: every mind's next turn processes only her new tokens."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from actord.frontends.client import Client
from actord.testing.daemon import wait_until_serving
from tests.waits import wait_until

pytestmark = pytest.mark.slow  # daemons stopped, killed and started again

PY = sys.executable
N_MINDS = 6


def _start(tiny_model: str, tmp_path: Path, *flags: str) -> tuple[Path, subprocess.Popen]:
    sock = tmp_path / "actord.sock"
    proc = subprocess.Popen(
        [PY, "-m", "actord.cli", "serve", "--model", tiny_model, "--slots", "2", "--ctx", "1024",
         "--batch", "64", "--threads", "1", "--socket", str(sock), "--page-dir", str(tmp_path / "pages"),
         "--page-ram-bytes", "12000", "--log-level", "warning", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    wait_until_serving(proc, sock, timeout_s=120, poll_s=0.1)
    return sock, proc


def _turns(sock: Path, history: dict[str, list[int]], rounds: int) -> None:
    with Client(str(sock), timeout=60) as c:
        for _ in range(rounds):
            for mind, prompt in history.items():
                r = c.call("completion", {"prompt": prompt, "n_predict": 4, "mind": mind, "ignore_eos": True})
                history[mind] = prompt + r["tokens"] + [5, 6]
        tiers = {m["tier"] for m in c.call("memory")["minds"]}
    assert {"slot", "page", "file"} <= tiers, tiers  # spread over every tier


def _next_turns(sock: Path, history: dict[str, list[int]]) -> dict[str, int]:
    with Client(str(sock), timeout=60) as c:
        return {mind: c.call("completion", {"prompt": prompt, "n_predict": 2, "mind": mind, "ignore_eos": True})
                ["n_prompt_processed"] for mind, prompt in history.items()}


def _history() -> dict[str, list[int]]:
    return {f"m{i}": [1, 10 + i, 20 + i, 30 + i, 40 + i, 50 + i, 60 + i, 70 + i] for i in range(N_MINDS)}


def _metric(c: Client, name: str) -> float:
    for line in c.call("metrics")["text"].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _stopped(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("how", ["sigterm", "stop_verb"])
def test_a_graceful_stop_keeps_every_mind_and_each_resumes_with_only_her_new_tokens(tiny_model, tmp_path, how):
    history = _history()
    sock, proc = _start(tiny_model, tmp_path, "--write-behind-s", "0")  # only the stop writes them
    try:
        _turns(sock, history, rounds=2)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            with Client(str(sock), timeout=30) as c:
                assert c.call("stop") == {"stopping": True}
        assert _stopped(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    sock, proc = _start(tiny_model, tmp_path)
    try:
        assert _next_turns(sock, history) == {m: 3 for m in history}  # the last reply token and [5, 6]
    finally:
        proc.send_signal(signal.SIGTERM)
        _stopped(proc)


def test_kill_9_after_the_write_behind_window_loses_no_mind(tiny_model, tmp_path):
    history = _history()
    sock, proc = _start(tiny_model, tmp_path, "--write-behind-s", "0.3")
    try:
        _turns(sock, history, rounds=2)
        with Client(str(sock), timeout=30) as c:
            before = _metric(c, "page_write_behind_total")
            # The window passes: wait until a pass has written the last turn's mind and
            # found nothing else unwritten.
            wait_until(lambda: _metric(c, "page_write_behind_total") > before and _metric(c, "minds_unpersisted") == 0,
                       "write-behind catches up", every=0.1)
        proc.kill()  # SIGKILL: no stop, nothing flushed
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    (tmp_path / "actord.sock").unlink(missing_ok=True)
    sock, proc = _start(tiny_model, tmp_path)
    try:
        assert _next_turns(sock, history) == {m: 3 for m in history}
    finally:
        proc.send_signal(signal.SIGTERM)
        _stopped(proc)
