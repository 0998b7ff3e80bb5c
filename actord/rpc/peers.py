"""Who may use the socket, and whose socket it is.

Peer credentials: on Linux a Unix socket tells the accepting side the pid, uid and gid of
the process that connected (SO_PEERCRED, taken by the kernel at connect time, so the peer
cannot lie about them). The socket is created owner-only, but a mode can be widened by
anyone who owns it (chmod 0666) and a process of another uid could then use every verb,
`gene.load` of any path the daemon may read included. So each connection's credentials
are checked: by default only the daemon's own (effective) uid is served; `allow_uid` and
`allow_gid` (the peer's primary gid: SO_PEERCRED does not carry supplementary groups) add
more. Where SO_PEERCRED does not exist the check cannot be made, and the connection is
refused rather than trusted.

Owning the socket path: start-up used to unlink whatever socket was at the path, so a
second daemon silently took over a live one, and the first, when it stopped, deleted the
second's socket. Now a daemon takes an exclusive `flock` on `<socket>.lock` (kept for its
whole life; the kernel drops it if the process dies, so a crash leaves no stale lock) and,
should a daemon without that lock (an older version) be there, probes the path with a
connect: an answer means it is live and start-up fails with `SocketInUse`; a refused
connect means a stale socket, which is removed. A stopping daemon removes the path only
if it is still the very socket it bound (same device and inode). The lock file itself is
left in place: unlinking a lock file races with the next daemon opening it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import socket
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from actord.errors import InvalidParams, SocketInUse
from actord.log import get

log = get("actord.rpc")

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer | None:
    """The connecting process's credentials, or None where the OS cannot tell."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, opt, _UCRED.size))
    except OSError:
        return None
    return Peer(pid, uid, gid)


@dataclass(frozen=True)
class PeerPolicy:
    uid: int = field(default_factory=os.geteuid)
    allow_uid: frozenset[int] = frozenset()
    allow_gid: frozenset[int] = frozenset()

    def allows(self, peer: Peer | None) -> bool:
        if peer is None:
            return False
        return peer.uid == self.uid or peer.uid in self.allow_uid or peer.gid in self.allow_gid


@dataclass
class SocketClaim:
    """This daemon's hold on a socket path: the lock, and the identity of the socket it bound."""

    path: Path
    lock_fd: int
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the bound socket

    def bound(self) -> None:
        st = os.lstat(self.path)
        self.ident = (st.st_dev, st.st_ino)

    def release(self) -> None:
        """Remove the socket if it is still ours, then drop the lock."""
        try:
            if self.ident is not None:
                try:
                    st = os.lstat(self.path)
                except FileNotFoundError:
                    st = None
                if st is not None and (st.st_dev, st.st_ino) == self.ident:
                    os.unlink(self.path)
                elif st is not None:
                    log.warning("rpc.socket_not_ours", socket=str(self.path))
        finally:
            if self.lock_fd >= 0:
                os.close(self.lock_fd)
                self.lock_fd = -1


def claim_socket(path: str | Path, *, probe_timeout: float = 2.0) -> SocketClaim:
    """Take the socket path for this daemon, or raise SocketInUse / InvalidParams."""
    path = Path(path)
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as e:
        raise InvalidParams(f"cannot open the socket lock {lock_path}: {os.strerror(e.errno)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SocketInUse(f"another daemon holds {lock_path}: {path} is in use", socket=str(path)) from None
            raise
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise InvalidParams(f"{path} exists and is not a socket", socket=str(path))
            if _answers(path, probe_timeout):
                raise SocketInUse(f"a live daemon answers on {path}", socket=str(path))
            os.unlink(path)  # stale: nobody listens
            log.info("rpc.stale_socket_removed", socket=str(path))
    except BaseException:
        os.close(fd)
        raise
    return SocketClaim(path, fd)


def _answers(path: Path, timeout: float) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # a listener whose backlog is full (EAGAIN) or that hangs: someone is there
        return True
    finally:
        s.close()


def raise_fd_limit(want: int) -> int:
    """Raise the soft RLIMIT_NOFILE towards `want` (within the hard limit); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    return soft
