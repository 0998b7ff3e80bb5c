"""Reading files that clients name (`gene.load`): regular files only, bounded, hang-proof.

A client once named `/dev/zero` (read whole into RAM), a FIFO nobody writes to (a worker
thread blocked for good; forty of them took every worker thread and one blocked SIGTERM),
a 20 GB sparse file, and `/etc/shadow` (the error told whether it existed). So a file a
client names is read like this:

- The name is a non-empty string without NUL bytes, at most `MAX_PATH` characters.
- With a root folder (`--gene-dir`) the name is relative to it: no absolute paths, no `..`,
  each component from the page-name character set (`paths.CHARSET`), at most `MAX_DEPTH`
  deep. Symlinks are resolved; one that leads outside is refused with the same words
  whether its target exists or not. The resolved path is then opened one component at a
  time with O_NOFOLLOW from the folder's descriptor, so a link swapped in between the
  check and the open fails instead of escaping.
- Without a root folder the daemon reads what its own uid can read (the peer-credential
  check keeps other uids out by default); symlinks are followed, as adapter caches use them.
- Every open is O_NONBLOCK | O_NOCTTY: a FIFO opens at once instead of waiting for a
  writer, a terminal is never adopted. The file is `stat`ed before it is opened (a device
  or FIFO is refused without opening it) and `fstat`ed after (the descriptor, not the name,
  decides): only a regular file of at most `max_bytes` is read, and reading stops at
  `max_bytes` even if the file grows meanwhile.
- Failures to find or open a file read "not found or not readable" whatever the errno, so
  an answer does not tell a missing file from a forbidden one.
- Reads in flight hold at most a shared byte budget in all (`--max-gene-read-bytes`,
  `ByteBudget`): a file's size is reserved after its checks and before its read, waits its
  turn when the budget is taken, and is released when the caller is done with the bytes
  (loaded or refused). A gene file must start with `GGUF`, checked with one 4-byte read
  before anything is reserved or read (four 1 GB sparse files of zeros once held 4 GB).
- The read runs on a worker thread under a timeout; at most `threads` reads run at once
  and more wait their turn (the wait counts towards the timeout). A thread that hangs
  anyway (a dead network mount) is abandoned by its caller but still counted: once
  `threads` abandoned reads are stuck, new reads are refused with `Overloaded` at once
  rather than queued behind them, so at most 2 x `threads` threads ever exist for this.
  The limiter is this module's own, so it never starves the page files' threads.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import stat
import threading
from pathlib import Path, PurePosixPath
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio

from actord.vocabulary.errors import (
    FileNotFound, FileReadTimeout, FileTooLarge, InvalidParams, NotARegularFile, Overloaded, PathRefused,
)
from actord.vocabulary.log import get
from actord.vocabulary.names import check_part

log = get("actord.clientfiles")

MAX_PATH = 4096
MAX_DEPTH = 8
_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR = getattr(os, "O_DIRECTORY", 0)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


class ClientFiles:
    def __init__(self, *, root: str | None = None, max_bytes: int = 4 << 30, timeout: float = 60.0,
                 threads: int = 4, what: str = "gene file",
                 read_fd: Callable[[int, int], bytes] | None = None,
                 run_sync: Callable[..., Awaitable[Any]] | None = None,
                 budget: "ByteBudget | None" = None, magic: bytes = b"") -> None:
        self.root = Path(root).resolve() if root else None
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.threads = threads
        self.what = what
        self._read_fd = read_fd or read_fd_bounded  # a seam: tests make a read hang
        # anyio.to_thread.run_sync's signature; a deterministic dispatcher passes its own so
        # that it counts the read as in flight.
        self._run_sync = run_sync or anyio.to_thread.run_sync
        self._limiter = anyio.CapacityLimiter(threads)
        self._lock = threading.Lock()
        self.stuck = 0  # reads whose caller timed out and whose thread has not returned
        self.budget = budget  # bytes of files being read or held by callers, shared (None: unbounded)
        self.magic = magic  # what a file must start with (b"GGUF" for genes); b"": anything

    # -- the async face ----------------------------------------------------------------

    async def read(self, name: str) -> bytes:
        """The bytes of the file a client named, or a typed error; never blocks the loop."""
        async with self.reading(name) as data:
            return data

    @contextlib.asynccontextmanager
    async def reading(self, name: str) -> AsyncIterator[bytes]:
        """The file's bytes, counted against the shared byte budget until the block ends.

        The file is opened and checked first (kind, size, the expected magic): a refused file
        costs no reservation and no read. Then its size is reserved (waiting its turn, FIFO,
        within the timeout), then it is read. So reads in flight across every caller hold at
        most `budget` bytes, and a refused load's bytes are released when its block ends."""
        self.check_name(name)
        if self.stuck >= self.threads:
            raise Overloaded(f"{self.stuck} {self.what} reads are stuck; try again later", stuck=self.stuck)
        size = 0
        reserved = False
        try:
            with anyio.fail_after(self.timeout):
                fd, size = await self._tracked(name, self.open_checked, name)
                try:
                    if self.budget is not None:
                        await self.budget.acquire(size)
                        reserved = True
                except BaseException:
                    os.close(fd)
                    raise
                data = await self._tracked(name, self._read_and_close, fd, name)
        except TimeoutError:
            if reserved:
                self.budget.release(size)  # type: ignore[union-attr]
            log.warning("client_file.timeout", file=name[:256], timeout_s=self.timeout, stuck=self.stuck)
            raise FileReadTimeout(f"reading {self.what} {name[:256]!r} took over {self.timeout} s",
                                  timeout_s=self.timeout) from None
        except BaseException:
            if reserved:
                self.budget.release(size)  # type: ignore[union-attr]
            raise
        try:
            yield data
        finally:
            del data
            if reserved:
                self.budget.release(size)  # type: ignore[union-attr]

    async def _tracked(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` on a worker thread; a caller that gives up leaves it counted as stuck
        until it returns."""
        state = {"done": False, "abandoned": False}

        def run() -> Any:
            try:
                return fn(*args)
            finally:
                with self._lock:
                    state["done"] = True
                    if state["abandoned"]:
                        self.stuck -= 1

        try:
            return await self._run_sync(run, abandon_on_cancel=True, limiter=self._limiter)
        except BaseException:
            with self._lock:
                if not state["done"]:  # its thread runs on: count it until it returns
                    state["abandoned"] = True
                    self.stuck += 1
            raise

    # -- the checks ----------------------------------------------------------------------

    def check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidParams(f"{self.what} name is empty")
        if "\x00" in name:
            raise PathRefused(f"{self.what} name holds a NUL byte", reason="NUL byte in name")
        if len(name) > MAX_PATH:
            raise PathRefused(f"{self.what} name is over {MAX_PATH} characters", reason="name too long")
        if self.root is None:
            return
        pure = PurePosixPath(name)
        if pure.is_absolute() or name.startswith("~"):
            raise self._outside(name, "absolute path")
        parts = [p for p in pure.parts if p != "."]
        if ".." in parts:
            raise self._outside(name, "'..' component")
        if not parts or len(parts) > MAX_DEPTH:
            raise PathRefused(f"{self.what} name {name[:64]!r} refused: 1 to {MAX_DEPTH} components",
                              reason="depth")
        for p in parts:
            why = check_part(p)
            if why is not None:
                raise PathRefused(f"{self.what} name {name[:64]!r} refused: {why}", reason=why)

    def _outside(self, name: str, why: str) -> PathRefused:
        return PathRefused(f"{self.what} {name[:256]!r} refused: only files under the {self.what} folder "
                           f"may be loaded ({why})", reason="outside the folder")

    def _unreadable(self, name: str) -> FileNotFound:
        return FileNotFound(f"{self.what} {name[:256]!r} not found or not readable", path=name[:256])

    # -- the worker-thread side ----------------------------------------------------------

    def read_sync(self, name: str) -> bytes:
        """Open, check and read `name` (blocking: runs on a worker thread)."""
        self.check_name(name)
        fd, _ = self.open_checked(name)
        return self._read_and_close(fd, name)

    def open_checked(self, name: str) -> tuple[int, int]:
        """Open `name` and check it (a regular file, within the size limit, starting with
        the expected magic): (fd, size). Blocking: runs on a worker thread."""
        fd = self._open_confined(name) if self.root is not None else self._open_plain(name)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFile(f"{self.what} {name[:256]!r} is {_kind(st.st_mode)}; only regular files "
                                      f"are read", reason="not a regular file")
            if st.st_size > self.max_bytes:
                raise FileTooLarge(f"{self.what} {name[:256]!r} is {st.st_size} bytes, over the limit of "
                                   f"{self.max_bytes}", n_bytes=st.st_size, max_bytes=self.max_bytes)
            if self.magic:
                try:
                    head = os.pread(fd, len(self.magic), 0)
                except OSError:
                    raise self._unreadable(name) from None
                if head != self.magic:  # a sparse file of zeros, a tarball: refused before reading it
                    raise InvalidParams(f"{self.what} {name[:256]!r} is not a {self.magic.decode(errors='replace')} "
                                        "file", reason="bad magic")
            return fd, st.st_size
        except BaseException:
            os.close(fd)
            raise

    def _read_and_close(self, fd: int, name: str) -> bytes:
        try:
            return self._read_fd(fd, self.max_bytes)
        except OSError:  # EIO, or EAGAIN from a special file that honours O_NONBLOCK
            raise self._unreadable(name) from None
        finally:
            os.close(fd)

    def _open_plain(self, name: str) -> int:
        try:
            before = os.stat(name)
        except (OSError, ValueError):
            raise self._unreadable(name) from None
        if not stat.S_ISREG(before.st_mode):  # refused without opening (a tape, a FIFO, a tty)
            raise NotARegularFile(f"{self.what} {name[:256]!r} is {_kind(before.st_mode)}; only regular "
                                  f"files are read", reason="not a regular file")
        try:
            return os.open(name, _OPEN)
        except (OSError, ValueError):
            raise self._unreadable(name) from None

    def _open_confined(self, name: str) -> int:
        assert self.root is not None
        try:
            target = (self.root / name).resolve()
        except (OSError, RuntimeError):  # a symlink loop
            raise self._unreadable(name) from None
        if target == self.root or not target.is_relative_to(self.root):
            raise self._outside(name, "leads outside")
        parts = target.relative_to(self.root).parts
        try:
            fd = os.open(self.root, os.O_RDONLY | _DIR | os.O_CLOEXEC)
        except OSError as e:
            raise FileNotFound(f"the {self.what} folder cannot be opened: {os.strerror(e.errno)}") from None
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                before = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(before.st_mode):  # resolved away above: swapped in since
                    raise self._outside(name, "a symlink appeared while opening")
                if not last and not stat.S_ISDIR(before.st_mode):
                    raise self._unreadable(name)
                if last:
                    if not stat.S_ISREG(before.st_mode):
                        raise NotARegularFile(f"{self.what} {name[:256]!r} is {_kind(before.st_mode)}; only "
                                              f"regular files are read", reason="not a regular file")
                flags = (_OPEN if last else os.O_RDONLY | _DIR | os.O_CLOEXEC) | _NOFOLLOW
                nxt = os.open(part, flags, dir_fd=fd)
                os.close(fd)
                fd = nxt
            return fd
        except OSError as e:
            os.close(fd)
            if e.errno == errno.ELOOP:  # swapped for a symlink after the check
                raise self._outside(name, "a symlink appeared while opening") from None
            raise self._unreadable(name) from None
        except BaseException:
            os.close(fd)
            raise


class ByteBudget:
    """Bytes that reads in flight may hold, in all: `acquire(n)` waits its turn (FIFO, so a
    large read is not starved by small ones), `release(n)` gives them back."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.held = 0
        self._waiting: collections.deque[tuple[int, anyio.Event]] = collections.deque()

    async def acquire(self, n: int) -> None:
        if n > self.total:
            raise FileTooLarge(f"a file of {n} bytes is over the {self.total} bytes that reads may hold at once",
                               n_bytes=n, max_bytes=self.total)
        if not self._waiting and self.held + n <= self.total:
            self.held += n
            return
        ev = anyio.Event()
        entry = (n, ev)
        self._waiting.append(entry)
        try:
            await ev.wait()
        except BaseException:
            if entry in self._waiting:
                self._waiting.remove(entry)
            else:  # granted as we were cancelled: give it back
                self.release(n)
            raise

    def release(self, n: int) -> None:
        self.held -= n
        while self._waiting and self.held + self._waiting[0][0] <= self.total:
            m, ev = self._waiting.popleft()
            self.held += m
            ev.set()


def read_fd_bounded(fd: int, max_bytes: int) -> bytes:
    """Read a regular file's descriptor to its end, refusing to go past `max_bytes`."""
    size = min(os.fstat(fd).st_size, max_bytes)
    first = os.read(fd, size) if size else b""  # one read, no copy, in the common case
    if len(first) == size:
        extra = os.read(fd, 1)
        if not extra:
            return first
        chunks, n = [first, extra], size + 1  # the file grew since fstat
    else:
        chunks, n = [first], len(first)  # a short read (Linux reads at most ~2 GB at once)
    while True:
        if n > max_bytes:
            raise FileTooLarge(f"file grew past the limit of {max_bytes} bytes while being read",
                               max_bytes=max_bytes)
        chunk = os.read(fd, min(1 << 24, max_bytes + 1 - n))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        n += len(chunk)
