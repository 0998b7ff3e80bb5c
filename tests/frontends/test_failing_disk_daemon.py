"""A real full or read-only page folder (a 2 MB tmpfs) through the daemon: a failed spill
with drop keeps the page, and the placer's spills keep every mind (issue 19, point 2).

Needs root and tmpfs (mount); skipped with the reason elsewhere. The fault seam covers the
same paths without either (tests/serving/test_failing_disk.py)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from actord.vocabulary.errors import StorageError
from tests.frontends.daemons import Daemon

pytestmark = pytest.mark.slow  # daemons on full and read-only page folders


def _mount_tmpfs(where: Path, size: str = "2m") -> str | None:
    """Mount a tmpfs at `where`; why not, or None when mounted."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs"
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}"
    return None


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "mnt"
    why = _mount_tmpfs(mnt)
    if why is not None:
        pytest.skip(why)
    started: list[Daemon] = []

    def start(model: str, *extra: str) -> Daemon:
        d = Daemon(model, tmp_path, "--page-dir", str(mnt / "pages"), *extra)
        started.append(d)
        return d

    yield mnt, start
    for d in started:
        d.kill()
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(mnt: Path) -> None:
    """Leave the tmpfs with no free space."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _read_only(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


def _prompt(seed: int, n: int) -> list[int]:
    return [1] + [5 + (seed * 31 + i * 7) % 400 for i in range(n - 1)]


@pytest.mark.parametrize("how", ["full", "read_only"])
def test_a_spill_with_drop_into_a_full_or_read_only_page_folder_keeps_the_page(tiny_model, small_disk, how):
    mnt, start = small_disk
    d = start(tiny_model)
    with d.client() as c:
        c.complete(_prompt(1, 300), n_predict=2, slot=0, ignore_eos=True)
        c.call("page.out", {"slot": 0, "page": "ada"})
        before = c.call("page.list")
        (_fill if how == "full" else _read_only)(mnt)
        with pytest.raises(StorageError) as e:
            c.call("page.spill", {"page": "ada", "file": "ada.page", "drop": True})
        assert e.value.data["errno"] == (errno.ENOSPC if how == "full" else errno.EROFS)
        assert c.call("page.list") == before
        c.call("page.in", {"slot": 0, "page": "ada"})
        r = c.complete(_prompt(1, 300) + [9, 9], n_predict=2, slot=0, ignore_eos=True)
        assert r["n_cached"] >= 300
    d.assert_clean_log()


def test_three_minds_over_one_slot_on_a_read_only_page_folder_keep_their_cached_tokens(tiny_model, small_disk):
    """The issue's case: tight page RAM, a read-only folder; a mind's 800 cached tokens must
    not become 0. A mind that cannot be placed is refused, typed; the others stay whole and
    come back once the folder is writable again."""
    mnt, start = small_disk
    d = start(tiny_model, "--slots", "1", "--page-ram-bytes", "230000")
    with d.client() as c:
        a = c.complete(_prompt(2, 800), n_predict=2, mind="ada", ignore_eos=True)
        c.complete(_prompt(3, 100), n_predict=2, mind="bo", ignore_eos=True)  # ada -> her page in RAM
        pages = c.call("page.list")
        assert [p["page"] for p in pages] == ["ada"] and pages[0]["n_tokens"] >= 800
        _read_only(mnt)
        with pytest.raises(StorageError) as e:  # bo must go to RAM, which needs ada spilled
            c.complete(_prompt(4, 50), n_predict=2, mind="cy", ignore_eos=True)
        assert e.value.data["errno"] == errno.EROFS
        assert c.call("page.list") == pages
        assert c.call("slot.list")[0]["mind"] == "bo"
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        c.complete(_prompt(4, 50), n_predict=2, mind="cy", ignore_eos=True)
        r = c.complete(_prompt(2, 800) + a["tokens"] + [7], n_predict=2, mind="ada", ignore_eos=True)
        assert r["n_cached"] >= 800
        m = d.metrics()
        assert not any(k.startswith("slot_evictions_total") and 'how="dropped"' in k and v for k, v in m.items())
    d.assert_clean_log()
