"""What travels to an actor: the message in an `Envelope`, with its one-shot `Reply` channel.

The reply channel and the stream sink travel beside the message, never inside it, so every
delivery can be encoded into a trace (the kernel's docstring, `actord/serving/kernel/`).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Generic, TypeVar

import anyio

M = TypeVar("M")
StreamSink = Callable[[Any], Awaitable[None]]


class Reply:
    """A one-shot reply channel: exactly one value or one error, then it is spent."""

    __slots__ = ("_event", "_value", "_error", "done")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self.done = False

    def send(self, value: Any) -> None:
        if not self.done:
            self.done = True
            self._value = value
            self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.done = True
            self._error = error
            self._event.set()

    async def wait(self) -> Any:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Envelope(Generic[M]):
    __slots__ = ("msg", "reply", "stream", "seq", "counted", "answer", "overtakes", "client")

    def __init__(self, msg: M, reply: Reply | None = None, stream: StreamSink | None = None,
                 answer: Any = None) -> None:
        self.msg = msg
        self.reply = reply
        self.stream = stream
        self.seq = 0
        self.counted = False  # it holds a place in the client lane (see Actor._put)
        self.overtakes = False  # picked ahead of an older client message (see Actor.pick)
        self.client = False  # it came on the client lane (kept after delivery, for observers)
        # A value (or an exception) for `reply` that the receiver hands on once it has done
        # its part; like the reply channel it is never part of the message, so a trace of
        # deliveries does not depend on it (a result's timings differ run to run).
        self.answer = answer
