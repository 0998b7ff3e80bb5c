"""A verb's entry at the façade (`@entry`): the one place an external input is refused
while the system closes, bounded, and recorded for traces.

Why one hook: a trace holds every external input under its JSON-RPC method name, so a replay
can re-execute it by that name (actord/replay/replay.py). Written out in each verb, the same lines repeat and
their order is easy to get wrong; here it is fixed: closing, then the bounds (`check`: what
it refuses is not recorded), then the record, then the verb. (`complete` and `chat` record
their checked request themselves: their record is the request, not the call's arguments.)
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Awaitable, Callable, TypeVar

from actord.service import tenancy

V = TypeVar("V", bound=Callable[..., Awaitable[Any]])


def entry(method: str, *, check_open: bool = True, check: Callable[..., None] | None = None,
          **names: str) -> Callable[[V], V]:
    """A verb's entry at the façade: refused once the system is closing (`check_open`) or
    when `check(limits, *args)` refuses its arguments (a bound on their size: what is refused
    is not recorded), then recorded as the external input `method` with its arguments (under
    the RPC's parameter names: `names` maps an RPC name to the argument's), so a replay
    re-executes it. One hook here instead of the same lines in every verb."""
    def deco(fn: V) -> V:
        sig = inspect.signature(fn)
        rpc_name = {arg: rpc for rpc, arg in names.items()}

        @functools.wraps(fn)
        async def verb(self: Any, *args: Any, **kwargs: Any) -> Any:
            if check_open:
                self.check_open()
            if check is not None:
                check(self.request_limits(), *args, **kwargs)
            bound = sig.bind(self, *args, **kwargs)
            bound.apply_defaults()
            params = {rpc_name.get(k, k): v for k, v in list(bound.arguments.items())[1:]}
            await self.dispatcher.input(method, params, tenancy.current())
            return await fn(self, *args, **kwargs)

        return verb  # type: ignore[return-value]

    return deco


