"""Files a client names (gene.load) are read safely: regular files only, bounded, timed, confined."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import anyio
import pytest

from actord.vocabulary.errors import (
    FileNotFound, FileReadTimeout, FileTooLarge, InvalidParams, NotARegularFile, Overloaded, PathRefused,
)
from actord.storage.clientfiles import ByteBudget, ClientFiles, read_fd_bounded
from tests.waits import eventually

pytestmark = pytest.mark.anyio


def test_a_regular_file_is_read_whole(tmp_path):
    f = tmp_path / "g.gguf"
    f.write_bytes(b"x" * 1000)
    assert ClientFiles(max_bytes=1000).read_sync(str(f)) == b"x" * 1000


@pytest.mark.parametrize("dev", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_devices_are_refused_without_reading(dev):
    if not os.path.exists(dev):
        pytest.skip(f"{dev} is absent")
    with pytest.raises(NotARegularFile, match="character device"):
        ClientFiles().read_sync(dev)


def test_a_fifo_nobody_writes_to_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotARegularFile, match="FIFO"):
        ClientFiles().read_sync(str(fifo))


def test_a_fifo_swapped_in_after_the_stat_is_caught_by_fstat_without_blocking(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real_stat = os.stat
    # The name looked like a regular file when stat'ed: the open (O_NONBLOCK) must not wait
    # for a writer, and fstat on the descriptor must refuse it.
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(__file__) if str(p) == str(fifo) else real_stat(p, *a, **k))
    with pytest.raises(NotARegularFile, match="FIFO"):
        ClientFiles().read_sync(str(fifo))


def test_folders_and_sockets_are_refused(tmp_path):
    import socket

    with pytest.raises(NotARegularFile, match="folder"):
        ClientFiles().read_sync(str(tmp_path))
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "s"))
    try:
        with pytest.raises(NotARegularFile, match="socket"):
            ClientFiles().read_sync(str(tmp_path / "s"))
    finally:
        s.close()


def test_a_huge_sparse_file_is_refused_by_its_size_before_reading(tmp_path):
    f = tmp_path / "sparse"
    with open(f, "wb") as fh:
        fh.truncate(20 << 30)  # 20 GB, no blocks
    with pytest.raises(FileTooLarge) as e:
        ClientFiles(max_bytes=1 << 30).read_sync(str(f))
    assert e.value.data["n_bytes"] == 20 << 30


def test_the_size_limit_is_exact(tmp_path):
    f = tmp_path / "g"
    f.write_bytes(b"a" * 100)
    assert ClientFiles(max_bytes=100).read_sync(str(f)) == b"a" * 100
    with pytest.raises(FileTooLarge):
        ClientFiles(max_bytes=99).read_sync(str(f))


def test_a_file_that_grows_while_read_stops_at_the_limit(tmp_path):
    f = tmp_path / "g"
    f.write_bytes(b"a" * 100)
    fd = os.open(f, os.O_RDONLY)
    try:
        with open(f, "ab") as fh:  # grows after it was measured
            fh.write(b"b" * 100)
        # read_fd_bounded measures again, so shrink the limit to what it was "before"
        with pytest.raises(FileTooLarge):
            read_fd_bounded(fd, 150)
        os.lseek(fd, 0, os.SEEK_SET)
        assert read_fd_bounded(fd, 200) == b"a" * 100 + b"b" * 100
    finally:
        os.close(fd)


def test_missing_and_unreachable_files_read_the_same(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    cf = ClientFiles()
    with pytest.raises(FileNotFound) as a:
        cf.read_sync(str(tmp_path / "absent"))
    with pytest.raises(FileNotFound) as b:
        cf.read_sync(str(tmp_path / "file" / "below-a-file"))  # ENOTDIR, not ENOENT
    assert "not found or not readable" in a.value.message and "not found or not readable" in b.value.message
    assert "errno" not in str(a.value.to_dict()) and "Errno" not in b.value.message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid for EACCES")
def test_a_forbidden_file_reads_like_a_missing_one(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x")
    secret.chmod(0o600)
    os.chmod(tmp_path, 0o755)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        os.setuid(65534)
        out = []
        for p in (secret, tmp_path / "absent"):
            try:
                ClientFiles().read_sync(str(p))
                out.append("read")
            except FileNotFound as e:
                out.append(e.message.replace(str(p), "P"))
        os.write(w, "|".join(out).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    got = os.read(r, 4096).decode().split("|")
    os.close(r)
    assert got[0] == got[1] and "not found or not readable" in got[0]


def test_nul_and_overlong_names_are_refused():
    with pytest.raises(PathRefused, match="NUL"):
        ClientFiles().read_sync("a\x00b")
    with pytest.raises(PathRefused, match="over"):
        ClientFiles().read_sync("a" * 5000)


# ---- --gene-dir confinement -------------------------------------------------------------


@pytest.fixture
def genes(tmp_path):
    root, outside = tmp_path / "genes", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "a.gguf").write_bytes(b"A")
    (root / "sub").mkdir()
    (root / "sub" / "b.gguf").write_bytes(b"B")
    (outside / "secret").write_bytes(b"S")
    (root / "in-link.gguf").symlink_to(root / "sub" / "b.gguf")
    (root / "out-link").symlink_to(outside / "secret")
    (root / "dangling-out").symlink_to(outside / "absent")
    return root, outside


def test_confined_names_inside_the_folder_are_read(genes):
    root, _ = genes
    cf = ClientFiles(root=str(root))
    assert cf.read_sync("a.gguf") == b"A"
    assert cf.read_sync("./sub/b.gguf") == b"B"
    assert cf.read_sync("in-link.gguf") == b"B"  # a link that stays inside is fine


@pytest.mark.parametrize("name,why", [
    ("/etc/passwd", "absolute"), ("../outside/secret", "'..'"), ("sub/../../outside/secret", "'..'"),
    ("out-link", "leads outside"), ("dangling-out", "leads outside"),
])
def test_confined_names_outside_are_refused_alike(genes, name, why):
    root, _ = genes
    with pytest.raises(PathRefused, match=why) as e:
        ClientFiles(root=str(root)).read_sync(name)
    # The same words whether the target exists (out-link) or not (dangling-out).
    assert "only files under the gene file folder" in e.value.message


def test_confined_names_use_the_page_name_character_set(genes):
    root, _ = genes
    with pytest.raises(PathRefused, match="characters outside"):
        ClientFiles(root=str(root)).read_sync("a b.gguf")
    with pytest.raises(PathRefused, match="components"):
        ClientFiles(root=str(root)).read_sync("/".join(["d"] * 20))


def test_a_symlink_swapped_in_after_the_check_is_not_followed(genes, monkeypatch):
    root, outside = genes
    # Resolution saw a plain name; by the time of the open it is a link leading out.
    monkeypatch.setattr(Path, "resolve", lambda self, strict=False: Path(os.path.abspath(self)))
    with pytest.raises(PathRefused, match="symlink appeared"):
        ClientFiles(root=str(root)).read_sync("out-link")


# ---- the worker thread: timeout, bounded hung threads --------------------------------------


async def test_a_read_that_hangs_times_out_and_stuck_threads_are_bounded(tmp_path):
    f = tmp_path / "g"
    f.write_bytes(b"x")
    release = threading.Event()

    def hang(fd: int, max_bytes: int) -> bytes:
        release.wait(30)
        return b"late"

    cf = ClientFiles(timeout=0.2, threads=2, read_fd=hang)
    async with anyio.create_task_group() as tg:  # two at once: both time out
        for _ in range(2):
            tg.start_soon(_expect_timeout, cf, str(f))
    assert cf.stuck == 2  # both threads still stuck, and counted
    with pytest.raises(Overloaded):
        await cf.read(str(f))  # refused at once instead of queueing behind them
    release.set()
    await eventually(lambda: cf.stuck == 0, "the released threads are no longer counted as stuck", timeout=10)


async def _expect_timeout(cf: ClientFiles, name: str) -> None:
    with pytest.raises(FileReadTimeout):
        await cf.read(name)


async def test_more_reads_than_threads_wait_their_turn(tmp_path):
    f = tmp_path / "g"
    f.write_bytes(b"x")
    cf = ClientFiles(threads=1)
    got: list[bytes] = []

    async def one() -> None:
        got.append(await cf.read(str(f)))

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(one)
    assert got == [b"x"] * 8 and cf.stuck == 0


async def test_async_read_returns_the_bytes(tmp_path):
    f = tmp_path / "g"
    f.write_bytes(b"hello")
    assert await ClientFiles().read(str(f)) == b"hello"
    assert stat.S_ISREG(os.stat(f).st_mode)


def test_a_confined_name_through_a_file_reads_as_not_found(genes):
    root, _ = genes
    with pytest.raises(FileNotFound, match="not found or not readable"):
        ClientFiles(root=str(root)).read_sync("a.gguf/x")
    with pytest.raises(FileNotFound, match="not found or not readable"):
        ClientFiles(root=str(root)).read_sync("sub/absent.gguf")


# ---- reads are bounded in total and released (issue 19.7) ----------------------------------


async def test_a_file_without_the_expected_magic_is_refused_without_being_read(tmp_path):
    f = tmp_path / "zeros.gguf"
    with open(f, "wb") as fh:
        fh.truncate(1 << 30)  # a sparse GB of zeros
    read = []
    budget = ByteBudget(2 << 30)
    cf = ClientFiles(magic=b"GGUF", budget=budget, read_fd=lambda fd, n: read.append(fd) or b"")
    with pytest.raises(InvalidParams, match="not a GGUF"):
        await cf.read(str(f))
    assert read == [] and budget.held == 0


async def test_reads_hold_the_shared_budget_until_their_caller_is_done_and_wait_their_turn(tmp_path):
    files = []
    for i in range(3):
        f = tmp_path / f"g{i}.gguf"
        f.write_bytes(b"GGUF" + bytes(596))  # 600 bytes each
        files.append(str(f))
    budget = ByteBudget(1000)  # one at a time
    cf = ClientFiles(magic=b"GGUF", budget=budget)
    order: list[str] = []
    peak = [0]

    async def load(name: str) -> None:
        async with cf.reading(name) as data:
            peak[0] = max(peak[0], budget.held)
            order.append(name)
            assert len(data) == 600
            # The caller still holds the bytes while every read after it waits its turn.
            await eventually(lambda: len(budget._waiting) == len(files) - len(order), "the later reads queue up")
        assert budget.held <= 600

    async with anyio.create_task_group() as tg:
        for name in files:
            tg.start_soon(load, name)
    assert sorted(order) == files and peak[0] == 600 and budget.held == 0


async def test_a_failed_or_timed_out_read_gives_its_reservation_back(tmp_path):
    f = tmp_path / "g.gguf"
    f.write_bytes(b"GGUF" + bytes(96))
    budget = ByteBudget(1000)

    def fail(fd: int, n: int) -> bytes:
        raise OSError(5, "EIO")

    with pytest.raises(FileNotFound):
        await ClientFiles(magic=b"GGUF", budget=budget, read_fd=fail).read(str(f))
    assert budget.held == 0
    release = threading.Event()
    cf = ClientFiles(magic=b"GGUF", budget=budget, timeout=0.2, read_fd=lambda fd, n: release.wait(10) and b"")
    with pytest.raises(FileReadTimeout):
        await cf.read(str(f))
    release.set()
    assert budget.held == 0
    with pytest.raises(FileTooLarge):  # larger than the whole budget: never fits, refused at once
        await ClientFiles(budget=ByteBudget(10)).read(str(f))
