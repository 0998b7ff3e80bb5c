"""The one adapter between page-file publication and the operating system.

Every OS call that crash-safe publication depends on lives here, and nowhere else: write a
file and fsync it, fsync a directory, rename (plain and durable), unlink, list, stat, mkdir,
remove a stage, read a file, advisory locks, pid liveness. The publication logic
(`publish.py`) and the format (`pagefile.py`) contain no OS branches; they call these
methods and get back values or a typed `StorageError`. That split is what makes the crash
matrix testable: `FaultyFs` fails or abandons any single call, and the tests walk every one.

Rules the methods keep, because the original C++ server learned each of them the hard way:

- A failed fsync or directory sync raises. It is never a warning (the caller decides the
  single case where a failed sync is tolerated).
- Absence is a value, not an exception, and only where the caller needs it: `stat` and
  `read_file` return None for "not found" (ENOENT). Any other failure (EACCES, EIO,
  ENOTDIR, ...) raises `StorageError`; it is never read as absence.
- Locks are `flock` locks on a file. They belong to an open file description, so two
  threads of one process exclude each other as two processes do, and a process that dies
  (or a publisher that is abandoned in a simulated crash) releases them.

Rejected: translating errors in the publisher (every call site would need a try), and
`os.replace` wrappers spread across modules (the fault seam would have to be too).

The seam: each OS call is bracketed by `_enter(op, target)` / `_exit(op, target)`, no-ops
here. `FaultyFs` counts calls per fault and, at the Nth matching call, raises `OSError`
(translated like a real one), or raises `SimulatedCrash` before or after the call. The
publisher also marks named steps with `step(name)`, so a simulation can stop it there.
`SimulatedCrash` is a BaseException: cleanup code that catches `Exception` does not run,
exactly as it would not in a process that died.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, TypeVar

T = TypeVar("T")

from actord.vocabulary.errors import NotARegularFile, StorageError

Buffer = bytes | bytearray | memoryview


class SimulatedCrash(BaseException):
    """The publisher stops dead here; whatever is on disk stays as it is."""


@contextmanager
def _typed(op: str, target: Path | str) -> Iterator[None]:
    """The one place an OSError becomes a StorageError (the second rule above); a
    SimulatedCrash, a BaseException, passes through untouched, as a dead process would."""
    try:
        yield
    except OSError as e:
        code = e.errno
        name = _errno.errorcode.get(code, str(code)) if code is not None else "?"
        raise StorageError(
            f"{op} {target}: {e.strerror or e} ({name})", op=op, path=str(target), errno=code
        ) from e


class FileLock:
    """A held flock. Release it once; releasing twice is harmless."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock

    def count(self) -> int:
        """The number the lock file holds (0: none yet): publishers count their holds of
        the page folder's lock in it (storage/publish.py `_locked`)."""
        assert self._fd is not None
        with _typed("read", self.path):
            raw = os.pread(self._fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else 0

    def set_count(self, n: int) -> None:
        assert self._fd is not None
        with _typed("write", self.path):
            os.pwrite(self._fd, n.to_bytes(8, "little"), 0)

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class OsFs:
    """The real operating system. Methods raise StorageError on any OS failure."""

    # ---- seam (no-ops here) ----------------------------------------------------------

    def _enter(self, op: str, target: Path | str) -> None:
        pass

    def _exit(self, op: str, target: Path | str) -> None:
        pass

    def step(self, name: str) -> None:
        """A named point in a publication; does nothing on the real OS."""
        with _typed("step", name):
            self._enter("step", name)
            self._exit("step", name)

    # ---- files ------------------------------------------------------------------------

    def write_file(self, path: Path, parts: Iterable[Buffer]) -> int:
        """Create/truncate `path`, write every part, fsync, close. Returns bytes written."""
        with _typed("write_file", path):
            self._enter("write", path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                total = 0
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                        total += n
                self._exit("write", path)
                self._enter("fsync", path)
                os.fsync(fd)
                self._exit("fsync", path)
                return total
            finally:
                os.close(fd)

    def read_file(self, path: Path, limit: int | None = None) -> bytearray | None:
        """The file's bytes (at most `limit`), or None when it does not exist.

        The buffer is sized from fstat (or `limit`), never from anything inside the file.
        A name that is not a regular file (a FIFO, a device, a socket) is refused before
        anything is read: opened with O_NONBLOCK (a FIFO with no writer would block the open
        itself, a read on it for ever, holding a worker thread past shutdown) and fstat'ed.
        """
        with _typed("read_file", path):
            try:
                self._enter("read", path)
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
            except FileNotFoundError:
                self._exit("read", path)
                return None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    # A client's doing (a folder or FIFO where a file is named), not the disk's:
                    # refused typed, as a 4xx, naming the file but not the folder it is in.
                    raise NotARegularFile(f"{path.name!r} is not a regular file; only regular files are read",
                                          reason="not a regular file")
                size = st.st_size
                if limit is not None:
                    size = min(size, limit)
                buf = bytearray(size)
                view = memoryview(buf)
                got = 0
                while got < size:
                    n = os.readv(fd, [view[got:]])
                    if n == 0:
                        break  # the file shrank under us: hand back what is there
                    got += n
                del view
                if got < size:
                    del buf[got:]
            finally:
                os.close(fd)
            self._exit("read", path)
            return buf

    def _op(self, op: str, path: Path, fn: Callable[[], T], shown: object = None) -> T:
        """One OS call behind the fault seam (`_enter`/`_exit`); an OSError comes out typed."""
        with _typed(op, path if shown is None else shown):
            self._enter(op, path)
            out = fn()
            self._exit(op, path)
            return out

    def stat(self, path: Path) -> os.stat_result | None:
        """lstat; None only for "not found". Every other error raises, never "absent"."""
        with _typed("stat", path):
            try:
                self._enter("stat", path)  # an injected ENOENT is "not found" too
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            self._exit("stat", path)
            return st

    def unlink(self, path: Path) -> None:
        self._op("unlink", path, lambda: os.unlink(path))

    # ---- directories ------------------------------------------------------------------

    def dirsync(self, path: Path) -> None:
        """fsync a directory, so the names created, renamed or removed in it are durable."""
        with _typed("dirsync", path):
            self._enter("dirsync", path)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
                self._exit("dirsync", path)
            finally:
                os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        """Atomically replace `dst` with `src` (same filesystem). Not yet durable."""
        self._op("rename", src, lambda: os.rename(src, dst), shown=f"{src} -> {dst}")

    def durable_rename(self, src: Path, dst: Path) -> None:
        """rename, then fsync the destination's folder (and the source's, if different)."""
        self.rename(src, dst)
        self.dirsync(dst.parent)
        if src.parent != dst.parent:
            self.dirsync(src.parent)

    def listdir(self, path: Path) -> list[str]:
        return self._op("listdir", path, lambda: sorted(os.listdir(path)))

    def scan(self, path: Path) -> list[tuple[str, int, int, int]]:
        """(name, st_mode, size, mtime ns) of every entry in `path`, links not followed: one
        scandir, so indexing 10,000 page files at start costs no path object per file."""
        def entries() -> list[tuple[str, int, int, int]]:
            out = []
            with os.scandir(path) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed meanwhile
                    out.append((e.name, st.st_mode, st.st_size, st.st_mtime_ns))
            return out

        return self._op("listdir", path, entries)

    def mkdir(self, path: Path, *, exist_ok: bool = False) -> bool:
        """Create one folder. Returns True if it was created, False if it already existed."""
        def make() -> bool:
            try:
                os.mkdir(path, 0o755)
                return True
            except FileExistsError:
                if not exist_ok or not os.path.isdir(path):
                    raise
                return False

        return self._op("mkdir", path, make)

    def makedirs(self, path: Path) -> None:
        """The folder and its missing parents; one that exists is left alone (nothing is
        written to a read-only file system that already holds it)."""
        with _typed("makedirs", path):
            self._enter("mkdir", path)
            if not os.path.isdir(path):
                os.makedirs(path, 0o755, exist_ok=True)
            self._exit("mkdir", path)

    def rmtree(self, path: Path) -> None:
        """Remove a staging folder and everything in it. A folder already gone is fine."""
        with _typed("rmtree", path):
            self._enter("rmtree", path)
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                pass
            self._exit("rmtree", path)

    # ---- processes and locks ------------------------------------------------------------

    def getpid(self) -> int:
        return os.getpid()

    def pid_alive(self, pid: int) -> bool:
        """True unless the OS says no such process. Unsure (EPERM) counts as alive."""
        with _typed("pid_alive", str(pid)):
            self._enter("pid_alive", str(pid))
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True  # it exists, it is just not ours
            self._exit("pid_alive", str(pid))
            return alive

    def lock(self, path: Path, *, blocking: bool = True) -> FileLock | None:
        """An exclusive flock on `path` (created if missing). Non-blocking: None if held."""
        with _typed("lock", path):
            self._enter("lock", path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            held = FileLock(fd, path)  # its release closes fd, on every way out below
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                except BlockingIOError:
                    held.release()
                    self._exit("lock", path)
                    return None
                self._exit("lock", path)
            except BaseException:
                held.release()  # an abandoned caller never got the lock; a dead process drops it
                raise
            return held


# ---- fault injection ----------------------------------------------------------------------


Action = Literal["fail", "crash", "crash_after"]


@dataclass(frozen=True)
class Fault:
    """At the `nth` call (1-based) of `op` whose target contains `match`, do `action`;
    with `times` > 1 at that many calls from the nth on, with `times` = 0 at every one (a
    disk that stays full or read-only).

    op: "write", "fsync", "read", "stat", "unlink", "dirsync", "rename", "listdir",
    "mkdir", "rmtree", "pid_alive", "lock", or "step" (target = the step's name).
    action: "fail" raises OSError(errno) inside the call (so the caller sees the same
    StorageError a real failure gives); "crash" raises SimulatedCrash before the call;
    "crash_after" raises it after the call took effect.
    """

    op: str
    nth: int = 1
    action: Action = "fail"
    errno: int = _errno.EIO
    match: str | None = None
    times: int = 1


class FaultyFs(OsFs):
    """OsFs with a fault plan. Records every call in `trace`; `fired` lists faults hit."""

    def __init__(
        self, faults: Iterable[Fault] = (), *, dead_pids: Iterable[int] = (), pid: int | None = None
    ) -> None:
        self.faults = list(faults)
        self.dead_pids = frozenset(dead_pids)
        self._pid = pid
        self.trace: list[tuple[str, str]] = []
        self.fired: list[Fault] = []
        self._counts = [0] * len(self.faults)
        self._after: list[tuple[str, str]] = []

    def _enter(self, op: str, target: Path | str) -> None:
        t = str(target)
        self.trace.append((op, t))
        for i, f in enumerate(self.faults):
            if f.op != op or (f.match is not None and f.match not in t):
                continue
            self._counts[i] += 1
            k = self._counts[i] - f.nth
            if k < 0 or (f.times and k >= f.times):
                continue
            self.fired.append(f)
            if f.action == "crash":
                raise SimulatedCrash(f"crash before {op} {t}")
            if f.action == "crash_after":
                self._after.append((op, t))
            else:
                raise OSError(f.errno, os.strerror(f.errno), t)

    def _exit(self, op: str, target: Path | str) -> None:
        if (op, str(target)) in self._after:
            self._after.remove((op, str(target)))
            raise SimulatedCrash(f"crash after {op} {target}")

    def getpid(self) -> int:
        return self._pid if self._pid is not None else super().getpid()

    def pid_alive(self, pid: int) -> bool:
        alive = super().pid_alive(pid)
        return alive and pid not in self.dead_pids
