"""The engine thread's doorbell: how a finished job wakes the event loop, once per batch.

Kept apart from the thread (engine/thread.py) because it is the one place that knows the
loop's backend: on asyncio an eventfd (else a pipe) the loop reads, rung with the GIL held;
on trio, or a loop without readers, the loop's thread-safe callback hook. Both cost per
step, so the measurements that chose them are kept beside them.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Callable

import sniffio


def _loop_waker() -> Callable[[Callable[[], None]], None]:
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    import asyncio

    return asyncio.get_running_loop().call_soon_threadsafe


def _gil_holding_write() -> Callable[[int, bytes, int], int] | None:
    """libc's write(2) called with the GIL held (ctypes.PyDLL), or None where there is none.

    Why: `os.write` and a socket's `send` let the GIL go for the syscall. The loop thread,
    woken by that very write, takes the GIL first, and the engine thread then waits for it
    until the loop blocks again: every step's decode started only after the loop had routed
    the step before (measured: 48 us of a 310 us step at 8 slots on the tiny model). Written
    with the GIL held, the loop waits for the GIL until the engine enters llama_decode."""
    import ctypes

    try:
        fn = ctypes.PyDLL(None).write
    except (AttributeError, OSError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    fn.restype = ctypes.c_ssize_t
    return fn


class Doorbell:
    """The engine thread's wake-up for the loop: a finished job goes on `done` (a deque:
    appends and pops are atomic) and the loop is woken once for however many are there.

    On asyncio (a loop with add_reader): an eventfd (else a pipe) the loop reads, written
    with the GIL held (`_gil_holding_write`): ~2.5 us here, where asyncio's own self-pipe (a
    socketpair) took ~8. Elsewhere (trio, a loop without add_reader): the loop's thread-safe
    hook, once per batch of finished jobs."""

    def __init__(self, drain: Callable[[], None]) -> None:
        self.done: collections.deque[Any] = collections.deque()
        self.armed = False  # a wake-up is on its way: the loop will drain `done`
        self._drain_cb = drain
        self._rfd = self._wfd = -1
        self._loop: Any = None
        self._signal: Callable[[], None]
        write = _gil_holding_write()
        if sniffio.current_async_library() != "trio" and write is not None:
            import asyncio

            loop = asyncio.get_running_loop()
            if hasattr(os, "eventfd"):
                self._rfd = self._wfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            else:
                self._rfd, self._wfd = os.pipe()
                os.set_blocking(self._rfd, False)
                os.set_blocking(self._wfd, False)  # never blocks the engine thread (a full pipe rings anyway)
            try:
                loop.add_reader(self._rfd, self._on_readable)
            except (NotImplementedError, AttributeError):  # a loop without readers (Windows' proactor)
                self._close_fds()
            else:
                self._loop = loop
                one, fd = (1).to_bytes(8, "little"), self._wfd

                def ring() -> None:
                    write(fd, one, 8)  # a full eventfd/pipe (EAGAIN) is already readable: fine

                self._signal = ring
        if self._loop is None:
            wake, cb = _loop_waker(), self._drain_cb

            def post() -> None:
                wake(cb)

            self._signal = post

    def defer(self, p: Any) -> None:
        """Engine thread: hand `p` to the loop with the next ring, without waking it now."""
        self.done.append(p)

    def ring(self, p: Any) -> None:
        """Engine thread (or any thread): hand `p` (and whatever was deferred) to the loop."""
        self.done.append(p)
        if not self.armed:
            self.armed = True
            try:
                self._signal()
            except RuntimeError:  # the loop is gone: nobody is waiting any more
                pass

    def _on_readable(self) -> None:  # on the loop
        try:  # read before disarming: a ring after this read is a wake-up of its own
            os.read(self._rfd, 4096)
        except (BlockingIOError, InterruptedError):
            pass
        self._drain_cb()

    def close(self) -> None:
        """On the loop, once the engine thread has exited."""
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._rfd)
            except Exception:  # the loop is closing
                pass
            self._loop = None
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in {self._rfd, self._wfd} - {-1}:
            try:
                os.close(fd)
            except OSError:
                pass
        self._rfd = self._wfd = -1
