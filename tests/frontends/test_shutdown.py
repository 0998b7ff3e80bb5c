"""SIGTERM as users send it: with mind and slot requests in flight, the daemon answers them
and exits within its grace; a second SIGTERM exits at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actord.frontends.client import Client
from actord.testing.daemon import wait_until_serving
from tests.waits import wait_until

pytestmark = pytest.mark.slow  # daemons stopped by SIGTERM mid-request, each its own process

PY = sys.executable


def _start(tiny_model: str, tmp_path: Path, grace: float) -> tuple[Path, subprocess.Popen]:
    sock = tmp_path / "actord.sock"
    proc = subprocess.Popen(
        [PY, "-m", "actord.cli", "serve", "--model", tiny_model, "--slots", "2", "--ctx", "8192",
         "--batch", "64", "--threads", "1", "--socket", str(sock), "--page-dir", str(tmp_path / "pages"),
         "--shutdown-grace-s", str(grace), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    wait_until_serving(proc, sock, timeout_s=60, poll_s=0.1)
    return sock, proc


def _in_flight(sock: Path, n: int) -> tuple[list[threading.Thread], list[object]]:
    """n long requests, half of them naming minds (placed by the daemon), half slots."""
    answers: list[object] = []

    def one(i: int) -> None:
        params = {"prompt": [1, 5 + i, 9, 13], "n_predict": 6000, "ignore_eos": True}
        params.update({"mind": f"m{i}"} if i % 2 else {"slot": (i // 2) % 2})
        try:
            with Client(str(sock), timeout=60) as c:
                answers.append(c.call("completion", params))
        except Exception as e:  # noqa: BLE001 - the test inspects what came back
            answers.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, answers


def _wait_processing(sock: Path, which=all, within: float = 30.0) -> None:  # noqa: ANN001 - all or any
    """Until all (or any) slots process: a deadline, not a count of polls (CI machines are
    shared, and start-up can be slow)."""
    with Client(str(sock), timeout=10) as c:
        wait_until(lambda: which(s["state"] == "processing" for s in c.call("slot.list")), "requests start",
                   timeout=within, every=0.01)


def _wait_refusing(sock: Path, within: float = 30.0) -> None:
    """Until a new completion is refused with ShuttingDown (the daemon got its SIGTERM)."""
    from actord.vocabulary.errors import ShuttingDown

    def refusing() -> bool:
        try:
            with Client(str(sock), timeout=10) as c:
                c.call("page.drop", {"page": "nobody"})  # PageNotFound at once until then
        except ShuttingDown:
            return True
        except Exception:  # noqa: BLE001 - busy or not yet refusing: look again
            pass
        return False

    wait_until(refusing, "the daemon refuses new work", timeout=within)


def test_sigterm_with_minds_in_flight_cancels_them_at_the_end_of_the_grace_and_answers_each(tiny_model, tmp_path):
    sock, proc = _start(tiny_model, tmp_path, grace=1.0)
    try:
        threads, answers = _in_flight(sock, 4)
        _wait_processing(sock)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)  # a hang guard: what it checks is below, by state
        for t in threads:
            t.join(10)
        assert rc == 0
        # The grace ran out with the requests in flight and they were cancelled (not left
        # running, not finished): the daemon says so, and each client got its answer.
        assert "system.cancelled_at_shutdown" in proc.stderr.read().decode(errors="replace")
        assert len(answers) == 4
        for a in answers:  # every client got an answer: a cancelled result or a typed refusal
            if isinstance(a, dict):
                assert a["stop_reason"] == "cancelled"
            else:
                assert type(a).__name__ in ("ShuttingDown", "Cancelled"), repr(a)
        assert not sock.exists()
    finally:
        _reap(proc)


def test_a_second_sigterm_exits_at_once(tiny_model, tmp_path):
    sock, proc = _start(tiny_model, tmp_path, grace=60.0)
    try:
        threads, _ = _in_flight(sock, 2)
        # One request names slot 0, the other a mind the placer may put on slot 0 first (it
        # then waits behind it): so any slot busy, not all, is what "in flight" means here.
        _wait_processing(sock, any)
        proc.send_signal(signal.SIGTERM)
        _wait_refusing(sock)  # the first SIGTERM is in: new work is refused...
        assert proc.poll() is None, "the first SIGTERM waits for the grace"  # ...and it waits
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)  # a hang guard; the exit code says which path ended it
        # 128 + SIGTERM is the immediate exit (os._exit); the graceful path, which would
        # have waited the 60 s grace out, exits 0.
        assert rc == 128 + signal.SIGTERM
        for t in threads:
            t.join(10)
    finally:
        _reap(proc)


@pytest.mark.parametrize("grace", [30.0])
def test_sigterm_lets_short_requests_finish_within_the_grace(tiny_model, tmp_path, grace):
    sock, proc = _start(tiny_model, tmp_path, grace=grace)
    try:
        answers: list[object] = []

        def one() -> None:
            with Client(str(sock), timeout=60) as c:
                answers.append(c.call("completion", {"prompt": [1, 2, 3], "n_predict": 400, "mind": "ada",
                                                     "ignore_eos": True}))

        t = threading.Thread(target=one)
        t.start()
        _wait_processing(sock, any)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=grace)
        t.join(10)
        assert rc == 0 and answers and answers[0]["stop_reason"] == "length"  # type: ignore[index]
    finally:
        _reap(proc)


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()




def test_the_issue_9_deadlock_over_the_socket_answers_both_requests(tiny_model, tmp_path, models_dir):
    """`serve --device-bytes 330000 --gene a --gene b`; a third gene paged out; slot 0 full;
    then, back to back, slot 1 naming the third gene and slot 0: both answer, and so does
    everything after."""
    from actord.testing.models import write_tiny_lora

    genes = [str(write_tiny_lora(models_dir / f"dl-lora{i}.gguf", tiny_model, seed=60 + i)) for i in range(3)]
    sock = tmp_path / "actord.sock"
    proc = subprocess.Popen(
        [PY, "-m", "actord.cli", "serve", "--model", tiny_model, "--slots", "2", "--ctx", "2048", "--threads", "1",
         "--device-bytes", "330000", "--gene", genes[0], "--gene", genes[1], "--socket", str(sock),
         "--page-dir", str(tmp_path / "pages"), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        wait_until_serving(proc, sock, timeout_s=60, poll_s=0.1)
        with Client(str(sock), timeout=30) as c:
            third = c.call("gene.load", {"path": genes[2]})["id"]
            c.call("gene.page_out", {"id": third})
            c.call("completion", {"prompt": [1] + [5 + i % 300 for i in range(899)], "n_predict": 1, "slot": 0,
                                  "ignore_eos": True})
        answers: dict[int, object] = {}

        def on(slot: int, genes: list[dict]) -> None:
            with Client(str(sock), timeout=30) as c:
                answers[slot] = c.call("completion", {"prompt": [1, 7, 8, 9, slot + 20], "n_predict": 4,
                                                      "slot": slot, "ignore_eos": True, "genes": genes})

        threads = [threading.Thread(target=on, args=(1, [{"id": third, "scale": 1.0}])),
                   threading.Thread(target=on, args=(0, []))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(answers) == [0, 1] and all(a["stop_reason"] == "length" for a in answers.values())  # type: ignore[index]
        with Client(str(sock), timeout=10) as c:
            assert len(c.call("slot.list")) == 2 and len(c.call("gene.list")) == 3
            assert c.call("health")["status"] == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        _reap(proc)
