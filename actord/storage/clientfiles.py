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
- The read runs on a worker thread under a timeout; at most `threads` reads run at once
  and more wait their turn (the wait counts towards the timeout). A thread that hangs
  anyway (a dead network mount) is abandoned by its caller but still counted: once
  `threads` abandoned reads are stuck, new reads are refused with `Overloaded` at once
  rather than queued behind them, so at most 2 x `threads` threads ever exist for this.
  The limiter is this module's own, so it never starves the page files' threads.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path, PurePosixPath
from typing import Any, Awaitable, Callable

import anyio

from actord.errors import (
    FileNotFound, FileReadTimeout, FileTooLarge, InvalidParams, NotARegularFile, Overloaded, PathRefused,
)
from actord.log import get
from actord.storage.paths import check_part

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
                 run_sync: Callable[..., Awaitable[Any]] | None = None) -> None:
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

    # -- the async face ----------------------------------------------------------------

    async def read(self, name: str) -> bytes:
        """The bytes of the file a client named, or a typed error; never blocks the loop."""
        self.check_name(name)
        if self.stuck >= self.threads:
            raise Overloaded(f"{self.stuck} {self.what} reads are stuck; try again later", stuck=self.stuck)
        state = {"done": False, "abandoned": False}
        try:
            with anyio.fail_after(self.timeout):
                return await self._run_sync(self._read_tracked, name, state, abandon_on_cancel=True,
                                            limiter=self._limiter)
        except TimeoutError:
            with self._lock:
                if not state["done"]:  # its thread runs on: count it until it returns
                    state["abandoned"] = True
                    self.stuck += 1
            log.warning("client_file.timeout", file=name[:256], timeout_s=self.timeout, stuck=self.stuck)
            raise FileReadTimeout(f"reading {self.what} {name[:256]!r} took over {self.timeout} s",
                                  timeout_s=self.timeout) from None

    def _read_tracked(self, name: str, state: dict[str, bool]) -> bytes:
        try:
            return self.read_sync(name)
        finally:
            with self._lock:
                state["done"] = True
                if state["abandoned"]:
                    self.stuck -= 1

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
        fd = self._open_confined(name) if self.root is not None else self._open_plain(name)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFile(f"{self.what} {name[:256]!r} is {_kind(st.st_mode)}; only regular files "
                                      f"are read", reason="not a regular file")
            if st.st_size > self.max_bytes:
                raise FileTooLarge(f"{self.what} {name[:256]!r} is {st.st_size} bytes, over the limit of "
                                   f"{self.max_bytes}", n_bytes=st.st_size, max_bytes=self.max_bytes)
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
