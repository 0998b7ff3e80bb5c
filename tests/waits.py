"""Wait for a condition with a bound, instead of sleeping and hoping it holds by then.

A fixed sleep before an assertion is slow where the machine is fast and flaky where it is
loaded; polling a condition is neither. The bound is a hang guard, not a measure: it fails
with what was awaited and the last value seen. `eventually` is for code on an event loop,
`wait_until` its synchronous twin for threads and for tests that drive a daemon from outside.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable

import anyio


async def eventually(check: Callable[[], Any], what: str, timeout: float = 30.0, every: float = 0.002) -> Any:
    """Poll until `check()` is truthy and return its value; AssertionError naming `what`
    (and the last value) if it is not within `timeout` seconds. A `check` that returns an
    awaitable (an actor's answer, say) is awaited, inside the same bound."""
    last: Any = None
    with anyio.move_on_after(timeout):
        while True:
            last = check()
            if inspect.isawaitable(last):
                last = await last
            if last:
                return last
            await anyio.sleep(every)
    raise AssertionError(f"{what}: not reached in {timeout} s (last: {last!r})")


def wait_until(check: Callable[[], Any], what: str, timeout: float = 60.0, every: float = 0.05) -> Any:
    """`eventually` for a caller that may block: poll `check()` until it is truthy and return
    its value; AssertionError naming `what` (and the last value) past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not reached in {timeout} s (last: {last!r})")
        time.sleep(every)


async def slot_in(system: Any, slot: int, state: str) -> bool:
    """Whether an ActorSystem's `slot` is in `state` ("idle", "processing"): a condition for `eventually`."""
    return (await system.slot_list())[slot].state == state
