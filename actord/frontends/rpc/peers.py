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

TCP peers (the HTTP front on loopback): a TCP socket carries no SO_PEERCRED, but when the
client is on this host its own socket is in this kernel, and the kernel knows who owns it.
`tcp_peer` asks for exactly that socket (the client's end: source = the peer's address,
destination = ours) with one NETLINK_SOCK_DIAG request (`inet_diag`, the interface `ss`
uses: an exact lookup, about 10 us, no privileges); where netlink is unavailable it scans
/proc/net/tcp{,6} for the same 4-tuple (the same kernel table, O(sockets)). The owner is the
uid that created the socket, like SO_PEERCRED's: it cannot be forged by the client. A
socket with no owning file (inode 0: its process closed it, or a TIME_WAIT stub, which the
kernel reports as uid 0) proves nothing and is refused, so a client cannot send a request,
close, and be taken for root. TCP carries no gid either: `allow_gid` is matched against the
uid's primary group in the user database. Where neither lookup works the HTTP front
refuses to start without an API key (`check_tcp_peers`), rather than serve unchecked.

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
import pwd
import resource
import socket
import stat
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

from actord.vocabulary.errors import InvalidParams, SocketInUse
from actord.vocabulary.log import get

log = get("actord.frontends.rpc")

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


# -- TCP peers on this host ------------------------------------------------------------

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_TCP_TIME_WAIT = 6
_DIAG_TIMEOUT_S = 1.0


def _addr16(family: int, host: str) -> bytes:
    raw = socket.inet_pton(family, host)
    return raw + bytes(16 - len(raw))


def _diag_lookup(family: int, src: tuple, dst: tuple) -> tuple[int, int, int] | None:
    """(state, uid, inode) of the TCP socket bound to `src` and connected to `dst`, by
    netlink inet_diag; None when no such socket exists. Raises OSError where netlink or
    inet_diag is unavailable."""
    sockid = (struct.pack("!HH", src[1], dst[1]) + _addr16(family, src[0]) + _addr16(family, dst[0])
              + struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE))
    # inet_diag_req_v2: family, protocol, ext, pad, states; then the socket id. No DUMP flag:
    # the kernel looks up this one socket.
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
    try:
        nl.settimeout(_DIAG_TIMEOUT_S)
        nl.send(_NLMSG_HDR.pack(_NLMSG_HDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + req)
        data = nl.recv(65536)
    finally:
        nl.close()
    if len(data) < _NLMSG_HDR.size:
        raise OSError(errno.EPROTO, "short netlink answer")
    _, typ, _, _, _ = _NLMSG_HDR.unpack_from(data)
    if typ == _NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, _NLMSG_HDR.size)
        if -err == errno.ENOENT:
            return None
        raise OSError(-err, os.strerror(-err))
    # inet_diag_msg: family, state, timer, retrans (4 B), the socket id (48 B), then
    # expires, rqueue, wqueue, uid, inode.
    off = _NLMSG_HDR.size
    state = data[off + 1]
    _, _, _, uid, inode = struct.unpack_from("=IIIII", data, off + 4 + 48)
    return state, uid, inode


def _proc_hex(family: int, host: str, port: int) -> str:
    raw = socket.inet_pton(family, host)
    words = struct.unpack(f"={len(raw) // 4}I", raw)  # the kernel prints each 32-bit word in host order
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _proc_lookup(family: int, src: tuple, dst: tuple) -> tuple[int, int, int] | None:
    """The same answer as `_diag_lookup`, from /proc/net/tcp{,6}."""
    table = "/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp"
    want_local, want_remote = _proc_hex(family, *src[:2]), _proc_hex(family, *dst[:2])
    with open(table, encoding="ascii") as f:
        next(f, None)
        for line in f:
            fields = line.split()
            if len(fields) >= 10 and fields[1] == want_local and fields[2] == want_remote:
                return int(fields[3], 16), int(fields[7]), int(fields[9])
    return None


def _primary_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return -1  # no such user in the database: matches no allow_gid


def tcp_peer(local: tuple, remote: tuple, *, gid: bool = True) -> Peer | None:
    """The owner of the client socket at `remote` (on this host) connected to our `local`,
    or None where it cannot be told. pid is 0: a TCP socket does not name a process; gid is
    the uid's primary group, looked up only when asked for (`gid=False`: -1), because the
    user database may be a network service and this runs on the event loop."""
    if not sys.platform.startswith("linux"):
        return None
    family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
    try:
        try:
            found = _diag_lookup(family, remote, local)
        except OSError:
            found = _proc_lookup(family, remote, local)
    except (OSError, ValueError):
        return None
    if found is None:
        return None
    state, uid, inode = found
    if inode == 0 or state == _TCP_TIME_WAIT:
        return None  # an orphan or a TIME_WAIT stub: no process owns it any more
    return Peer(0, uid, _primary_gid(uid) if gid else -1)


def check_tcp_peers(host: str) -> str | None:
    """Why TCP peers on `host` cannot be told apart here, or None when they can (a connection
    to a throwaway listener must come back as this process's own uid)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as lst, socket.socket(family, socket.SOCK_STREAM) as cli:
            lst.bind((host, 0))
            lst.listen(1)
            cli.settimeout(_DIAG_TIMEOUT_S)
            cli.connect(lst.getsockname())
            conn, _ = lst.accept()
            with conn:
                peer = tcp_peer(conn.getsockname(), conn.getpeername())
    except OSError as e:
        return f"a test connection on {host} failed: {e.strerror or e}"
    if peer is None:
        return "this platform does not tell a loopback TCP peer's uid (no inet_diag, no /proc/net/tcp)"
    if peer.uid != os.geteuid():
        return f"a test connection came back as uid {peer.uid}, not this process's {os.geteuid()}"
    return None


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
