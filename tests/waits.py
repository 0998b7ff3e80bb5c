"""Wait for a condition with a bound, instead of sleeping and hoping it holds by then.

A fixed sleep before an assertion is slow where the machine is fast and flaky where it is
loaded; polling a condition is neither. The daemon tests' synchronous twin is
`tests/frontends/daemons.py` `eventually`.
"""

from __future__ import annotations

from typing import Any, Callable

import anyio


async def eventually(check: Callable[[], Any], what: str, timeout: float = 30.0, every: float = 0.002) -> Any:
    """Poll until `check()` is truthy and return its value; AssertionError naming `what`
    (and the last value) if it is not within `timeout` seconds."""
    last: Any = None
    with anyio.move_on_after(timeout):
        while True:
            last = check()
            if last:
                return last
            await anyio.sleep(every)
    raise AssertionError(f"{what}: not reached in {timeout} s (last: {last!r})")
