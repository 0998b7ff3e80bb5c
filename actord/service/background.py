"""The services a running system keeps beside its requests: the memory report (and malloc
trim), the idle clock that puts the engine to sleep, and write-behind of minds' pages.

Why one place: `actord serve` (frontends/daemon.py) and a cluster node (cluster/node.py)
host the same system, and each started these by hand; the node started none, so its
`--write-behind-s` did nothing and a node killed after any quiet lost every mind not
spilled by hand. Each runs as its config says, never while a trace is recorded (its reads
would be deliveries no recorded input explains: the replay would diverge at the first).
"""

from __future__ import annotations

from typing import Any

import anyio

from actord.vocabulary.config import Config
from actord.vocabulary.log import get

log = get("actord.service.background")


async def run_background(system: Any, config: Config) -> None:
    """Run `system`'s background services until cancelled (returns at once when none is on)."""
    async with anyio.create_task_group() as tg:
        if config.memory_report_s > 0 and config.trace:
            log.info("memory.report_off", why="a trace is being recorded", trace=config.trace)
        elif config.memory_report_s > 0:
            from actord.service.memory import housekeeping

            tg.start_soon(lambda: housekeeping(system.metrics, system.memory_report, config.memory_report_s,
                                               trim=config.malloc_trim, trace_malloc_s=config.trace_malloc_s))
        if config.sleep_idle_s > 0 and config.trace:
            log.info("sleep.off", why="a trace is being recorded", trace=config.trace)
        elif config.sleep_idle_s > 0:
            from actord.service.sleep import IdleClock

            tg.start_soon(IdleClock(system, config.sleep_idle_s).run)
        if config.write_behind_s > 0 and config.trace:
            log.info("write_behind.off", why="a trace is being recorded", trace=config.trace)
        elif config.write_behind_s > 0:
            tg.start_soon(system.write_behind)
