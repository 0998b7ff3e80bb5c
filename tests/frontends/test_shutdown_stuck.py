"""Shutdown is bounded whatever a worker thread does (issue 33): a disk read that never
returns (here a page-file read patched to block for ever, as a hung network disk would)
held the daemon past SIGTERM for ever; now the process exits, logged, at most
`--shutdown-exit-margin-s` after its grace. No assertion is on time: the test waits for
the exit the deadline must produce."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from actord.frontends.client import Client
from actord.testing.daemon import wait_until_serving

pytestmark = pytest.mark.slow  # a daemon that must outlast a stuck worker thread

STUCK = '''
import os
import threading
import actord.storage.osfs as osfs

_read = osfs.OsFs.read_file


def read_file(self, path, limit=None):
    if "stuck" in str(path):
        open(os.environ["STUCK_MARK"], "w").close()  # the test's sign that a worker is in the read
        threading.Event().wait()  # never returns: a read on a hung disk
    return _read(self, path, limit)


osfs.OsFs.read_file = read_file
'''


def test_sigterm_ends_the_daemon_while_a_worker_is_stuck_in_a_read(tiny_model, tmp_path):
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(STUCK)
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "stuck.page").write_bytes(b"x" * 64)
    sock = tmp_path / "actord.sock"
    mark = tmp_path / "reading"
    env = {**os.environ, "PYTHONPATH": f"{patch}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "STUCK_MARK": str(mark)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "actord.cli", "serve", "--model", tiny_model, "--slots", "1",
         "--ctx", "512", "--batch", "64", "--socket", str(sock), "--page-dir", str(tmp_path / "pages"),
         "--shutdown-grace-s", "0.5", "--shutdown-exit-margin-s", "2", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    wait_until_serving(proc, sock, timeout_s=60, poll_s=0.1)

    def restore() -> None:
        try:
            with Client(str(sock), timeout=600) as c:
                c.call("slot.restore", {"slot": 0, "file": "stuck.page"})
        except Exception:  # noqa: BLE001 - cut off by the exit
            pass

    t = threading.Thread(target=restore, daemon=True)
    t.start()
    while not mark.exists():
        pass  # until a worker thread is in the read
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate()  # what the deadline must produce: the process gone
    assert proc.returncode == 1, err.decode()[-2000:]
    assert b"daemon.exit_forced" in err + out
