"""The idle clock: after `sleep_idle_s` with nothing in flight, the daemon sleeps.

Why: a daemon that holds minds for months is idle most of the night, and its model and
context (the KV cache: gigabytes at long contexts, on the device) are the memory everyone
else on the machine wants back. llama-server unloads its model after `--sleep-idle-seconds`;
actord does the same without losing anything: each slot's mind pages out first (to its RAM
page, else its page file; an unnamed cache is dropped, as a KV-pressure eviction drops it),
then the engine frees libllama's objects (engine/sleep.py). The next request that needs the
engine loads them again by itself, and a mind comes back from her page as she would after
any eviction. Reads that need no engine (health, props, models, metrics, the dashboard) do
not wake it.

"Nothing in flight" is read off two counters, so no request path needs a hook: the façade's
requests in flight, and the engine thread's count of jobs that are not quiet (engine/jobs.py
`QUIET`: the memory report's reads do not keep the daemon awake). A sleep that meets a
busy slot, or a request arriving meanwhile, is simply not taken; the clock starts again.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from actord.engine import jobs as J
from actord.serving.messages import Evict
from actord.vocabulary.errors import ActordError
from actord.vocabulary.log import get

log = get("actord.service.sleep")


class IdleClock:
    def __init__(self, system: Any, idle_s: float) -> None:
        self.system = system
        self.idle_s = idle_s
        self.tick_s = min(1.0, max(0.05, idle_s / 8))
        self.sleeps = 0

    def _activity(self) -> int:
        return self.system.engine.busy_jobs

    async def run(self) -> None:
        s = self.system
        seen, since = self._activity(), time.monotonic()
        while True:
            await anyio.sleep(self.tick_s)
            now, cur = time.monotonic(), self._activity()
            if s.engine.asleep or len(s.inflight) or cur != seen or s.closing:
                seen, since = cur, now
                continue
            if now - since >= self.idle_s:
                await self.sleep()
                seen, since = self._activity(), time.monotonic()

    async def sleep(self) -> bool:
        """Page every slot out, then free the engine's model and context; False (and awake)
        where a slot refused or work arrived meanwhile."""
        s = self.system
        t0 = time.perf_counter()
        for slot in s.slots:
            try:
                await slot.ask(Evict(reason="sleep"))
            except ActordError as e:
                log.info("daemon.sleep_refused", slot=slot.id, error=e.to_dict())
                return False
        if len(s.inflight):
            return False
        try:
            await s.engine.run(J.Sleep())
        except ActordError as e:  # a request took a slot meanwhile: it keeps the engine awake
            log.info("daemon.sleep_refused", error=e.to_dict())
            return False
        self.sleeps += 1
        s.metrics.sleeps_total.inc()
        log.info("daemon.asleep", idle_s=self.idle_s, t_ms=round((time.perf_counter() - t0) * 1e3, 1))
        return True
