"""systemd's side of the daemon: readiness, stopping and watchdog notices, and the sockets
systemd binds for it (socket activation). Without systemd every function here does nothing.

Why written here and not taken from a library: both protocols are a few lines of stable,
documented wire (sd_notify(3), sd_listen_fds(3)), and a dependency for them would be the
only one the daemon has no other use for.

- Notices: one datagram to the AF_UNIX socket named by `$NOTIFY_SOCKET` (a path, or an
  abstract name written with a leading `@`), `KEY=VALUE` lines. The daemon sends `READY=1`
  once the model is loaded and the socket serves (`Type=notify` units start their
  dependants then), `STOPPING=1` when a signal starts shutdown, and `WATCHDOG=1` every half
  `$WATCHDOG_USEC` when the unit sets `WatchdogSec=` (and `$WATCHDOG_PID`, if set, is this
  process): the pings come from the event loop, so a loop that hangs stops them and systemd
  restarts the daemon. A notice that cannot be sent is logged and dropped: systemd's
  absence never stops a daemon.
- Socket activation: `$LISTEN_PID` (this process) and `$LISTEN_FDS` (N) mean fds 3..3+N-1
  are listening sockets systemd bound, named by `$LISTEN_FDNAMES` (colon-separated, from
  each socket's `FileDescriptorName=`). The Unix socket is the one named `rpc` (else the
  one AF_UNIX stream socket), the HTTP front's the one named `http` (else the one TCP
  socket). The variables are removed once read, so no child inherits them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, MutableMapping

import anyio

from actord.vocabulary.errors import InvalidParams
from actord.vocabulary.log import get

log = get("actord.frontends.systemd")

LISTEN_FDS_START = 3


def notify(state: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send `state` ("READY=1", ...) to systemd; whether it was sent (False: no systemd)."""
    addr = env.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":  # an abstract socket: a leading NUL byte
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("systemd.notify_failed", state=state.split("\n", 1)[0], error=repr(e))
        return False


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between WATCHDOG=1 pings (half the unit's WatchdogSec), or None: none asked
    of this process."""
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


async def watchdog(interval: float) -> None:
    """Ping systemd's watchdog until cancelled."""
    while True:
        notify("WATCHDOG=1")
        await anyio.sleep(interval)


@dataclass
class Inherited:
    """The listening sockets systemd passed: the Unix socket's and the HTTP front's."""

    rpc: socket.socket | None = None
    http: socket.socket | None = None


def _is_listening_stream(s: socket.socket) -> bool:
    return (s.type == socket.SOCK_STREAM
            and bool(s.getsockopt(socket.SOL_SOCKET, getattr(socket, "SO_ACCEPTCONN", 30))))


def listen_fds(env: MutableMapping[str, str] = os.environ) -> Inherited:
    """The sockets systemd passed to this process (none: an empty Inherited). InvalidParams:
    a passed fd the daemon has no use for (say so at start, rather than leave it unserved)."""
    pid, n = env.get("LISTEN_PID", ""), env.get("LISTEN_FDS", "")
    names = env.get("LISTEN_FDNAMES", "")
    if pid != str(os.getpid()) or not n.isdigit():
        return Inherited()
    for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(k, None)
    socks = []
    for i, name in zip(range(int(n)), [*names.split(":"), *[""] * int(n)]):
        fd = LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        try:
            s = socket.socket(fileno=fd)
        except OSError as e:
            raise InvalidParams(f"systemd passed fd {fd}, which is not a socket: {e.strerror}", fd=fd) from None
        if not _is_listening_stream(s):
            raise InvalidParams(f"systemd passed fd {fd} ({name or 'unnamed'}), which is not a listening "
                                f"stream socket (ListenStream=)", fd=fd)
        socks.append((name, s))
    out = Inherited()
    for name, s in socks:
        unix = s.family == socket.AF_UNIX
        role = name if name in ("rpc", "http") else ("rpc" if unix else "http")
        if role == "rpc" and not unix or role == "http" and s.family not in (socket.AF_INET, socket.AF_INET6):
            raise InvalidParams(f"systemd passed fd {s.fileno()} named {name!r} of the wrong family", fd=s.fileno())
        if getattr(out, role) is not None:
            raise InvalidParams(f"systemd passed more than one socket for {role} (name them with "
                                f"FileDescriptorName=rpc / http)", fd=s.fileno())
        setattr(out, role, s)
    log.info("systemd.sockets", rpc=_where(out.rpc), http=_where(out.http))
    return out


def _where(s: socket.socket | None) -> str | None:
    if s is None:
        return None
    name = s.getsockname()
    return name if isinstance(name, str) else f"{name[0]}:{name[1]}"
