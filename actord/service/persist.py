"""Minds that outlive the process: write-behind, and a graceful stop that persists them all.

A mind's state is 10k-100k tokens that take minutes to prefill again; before this, a RAM
page lived in the daemon's memory only and a stop lost it. Two duties, one owner:

- Write-behind: a mind unchanged for `write_behind_s` (a RAM page whose generation is not
  in her file, an idle slot whose sequence is not) is written to her page file `<mind>.page`
  in the background. The page stays in RAM: the file is its backup, no read waits on it,
  and a kill -9 loses at most about the window. The page RAM ceiling charges the page and
  the disk budget its file, so both copies are counted, each where it lives.
- A graceful stop (`persist_all`), once requests have ended or been cancelled: every slot's
  mind and every RAM page not yet in its file are written, in parallel on the disk threads,
  within `shutdown_persist_s`; a mind not written is logged by name. A restart brings them
  back lazily: the placer restores a mind from her file at her next request, and the page
  folder's index (storage/disk_index.py) is made at start from names and sizes alone.

Time is read here, at the top (a client of every actor, like the idle clock), and passed
to `tick(now)`: the page store only knows which generations are not yet persisted
(`Unpersisted`), never when, so a seeded simulation can run ticks at chosen instants.
Writes go through the same spill the `page.spill` verb runs, and a slot's through
`SaveSlot(mind=...)`, which writes only while the slot holds that mind and her sequence
changed since it was last written (or read).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Awaitable, Callable, Sequence

import anyio

from actord.serving.kernel import Actor
from actord.serving.messages import Info, SaveSlot
from actord.serving.page_store import Unpersisted
from actord.vocabulary.errors import ActordError, PageNotFound, ShuttingDown
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics
from actord.vocabulary.names import MIND_FILE_SUFFIX, check_mind, is_cache_mind

log = get("actord.service.persist")

PASSES = 3  # a stop's passes over the slots and pages at most

# (page, file, drop) -> the spill's report (service/spill.py through the system).
Spill = Callable[[str, str, bool], Awaitable[dict[str, Any]]]


def mind_file(mind: str) -> str:
    return f"{mind}{MIND_FILE_SUFFIX}"


class Persister:
    def __init__(self, slots: Sequence[Actor[Any]], pages: Actor[Any], spill: Spill, metrics: Metrics, *,
                 window_s: float, threads: int, ask_timeout_s: float) -> None:
        self.slots = slots
        self.pages = pages
        self.spill = spill
        self.metrics = metrics
        self.window_s = window_s
        self.threads = max(1, threads)
        self.bound_s = ask_timeout_s
        self.seen: dict[str, tuple[int, float]] = {}  # page -> (generation, first seen unpersisted)
        self.slot_seen: dict[int, tuple[tuple[str, int], float]] = {}  # slot -> ((mind, n_tokens), since)
        self.slot_done: dict[int, tuple[str, int]] = {}  # slot -> (mind, n_tokens) last found persisted
        self.failed: dict[str, int] = {}  # page -> generation whose write failed (retried next window)
        self._scope: anyio.CancelScope | None = None
        self._tg: Any = None  # run()'s task group: slot saves go there, else are awaited in the pass
        self.saving: set[int] = set()  # slots whose save is under way
        self.writes = 0

    # -- write-behind ------------------------------------------------------------------

    async def run(self) -> None:
        """The write-behind loop (the daemon starts it; an embedding host may too)."""
        if self.window_s <= 0:
            return
        tick_s = min(1.0, max(0.05, self.window_s / 4))
        with anyio.CancelScope() as self._scope:
            # A slot's save waits for a request that arrived meanwhile (a page move on a busy
            # slot is deferred, not refused): each runs in this group, so one long request
            # never holds up the other minds' writes.
            async with anyio.create_task_group() as self._tg:
                while True:
                    await anyio.sleep(tick_s)
                    try:
                        await self.tick(time.monotonic())
                    except ShuttingDown:
                        return
                    except ActordError as e:
                        log.warning("write_behind.failed", error=e.to_dict())

    async def tick(self, now: float) -> int:
        """One pass: write every mind unchanged for the window. Returns the writes made."""
        dirty: list[tuple[str, int]] = await self.pages.ask(Unpersisted(), timeout=self.bound_s)
        seen: dict[str, tuple[int, float]] = {}
        for name, gen in dirty:
            if is_cache_mind(name):
                continue  # the prompt cache's minds end with the process (service/prompt_cache.py)
            old = self.seen.get(name)
            seen[name] = old if old is not None and old[0] == gen else (gen, now)
        self.seen = seen
        n = 0
        for name, (gen, t) in list(seen.items()):
            if now - t < self.window_s or self.failed.get(name) == gen and now - t < 2 * self.window_s:
                continue
            if check_mind(name) is not None:
                continue  # a page name no file can carry: kept in RAM only (a stop logs it)
            n += await self._spill(name, gen, now)
        n += await self._slots(now)
        self._age(now)
        return n

    async def _spill(self, name: str, gen: int, now: float) -> int:
        try:
            await self.spill(name, mind_file(name), False)
        except PageNotFound:
            self.seen.pop(name, None)  # paged in or dropped meanwhile
            return 0
        except ActordError as e:
            self.failed[name] = gen
            self.seen[name] = (gen, now)  # again after another window, not at every tick
            log.warning("write_behind.page_failed", mind=name, error=e.to_dict())
            return 0
        self.seen.pop(name, None)
        self.failed.pop(name, None)
        self.writes += 1
        self.metrics.page_write_behind_total.inc()
        return 1

    async def _slots(self, now: float) -> int:
        n = 0
        for slot in self.slots:
            try:
                info = await slot.ask(Info(), timeout=self.bound_s)
            except ShuttingDown:
                raise  # the daemon is going down: the stop's own pass writes what is left
            except ActordError as e:  # a failed slot: the others are still written
                log.warning("write_behind.slot_unreadable", slot=slot.name, error=e.to_dict())
                continue
            if info.mind is None or not info.n_tokens or is_cache_mind(info.mind):
                self.slot_seen.pop(info.id, None)
                continue
            key = (info.mind, info.n_tokens)
            if self.slot_done.get(info.id) == key:
                continue
            seen = self.slot_seen.get(info.id)
            if seen is None or seen[0] != key:
                self.slot_seen[info.id] = (key, now)
                continue
            if now - seen[1] < self.window_s or info.state != "idle" or info.deferred or info.id in self.saving:
                continue
            if self._tg is not None:
                self.saving.add(info.id)
                self._tg.start_soon(self._save, slot, info.id, key, now)
            else:
                n += await self._save(slot, info.id, key, now)
        return n

    async def _save(self, slot: Actor[Any], sid: int, key: tuple[str, int], now: float) -> int:
        try:
            out = await slot.ask(SaveSlot(file=mind_file(key[0]), mind=key[0]), timeout=self.bound_s)
        except ActordError as e:
            self.slot_seen[sid] = (key, now)
            log.warning("write_behind.slot_failed", slot=sid, mind=key[0], error=e.to_dict())
            return 0
        finally:
            self.saving.discard(sid)
        self.slot_done[sid] = key
        if self.slot_seen.get(sid, (None,))[0] == key:
            del self.slot_seen[sid]
        if "skipped" in out:
            return 0
        self.writes += 1
        self.metrics.page_write_behind_total.inc()
        return 1

    def _age(self, now: float) -> None:
        times = [t for _, t in self.seen.values()]
        times += [t for s, (k, t) in self.slot_seen.items() if self.slot_done.get(s) != k]
        self.metrics.page_unpersisted_age_seconds.set(now - min(times) if times else 0.0)
        self.metrics.minds_unpersisted.set(len(times))

    # -- a graceful stop ---------------------------------------------------------------

    def stop_background(self) -> None:
        """Write-behind ends (a stop's own pass writes what is left)."""
        if self._scope is not None:
            self._scope.cancel()

    async def persist_all(self, bound_s: float) -> dict[str, int]:
        """Write every mind not yet in her file: slots first (each one's state copy runs on
        the engine thread in turn, its write beside the others'), then the RAM pages, by
        `threads` workers at once. Within `bound_s`; the minds left are logged by name."""
        t0 = time.perf_counter()
        left: dict[str, str] = {}  # mind -> why not written (yet)
        written = {"slots": 0, "pages": 0}
        queue: deque[str] = deque()
        unreadable: list[str] = []  # slots a stop could not ask (crashed, stopped)

        async def one_slot(slot: Actor[Any]) -> None:
            try:
                info = await slot.ask(Info(), timeout=self.bound_s)
            except ActordError as e:
                # A slot that crashed or stopped holds nothing a save could reach: the stop
                # goes on with the others, and says which slot it could not ask.
                log.warning("persist.slot_unreadable", slot=slot.name, error=e.to_dict())
                unreadable.append(slot.name)
                return
            if info.mind is None or not info.n_tokens or is_cache_mind(info.mind):
                return  # the prompt cache's minds end with the process (service/prompt_cache.py)
            left[info.mind] = "in a slot"
            try:
                out = await slot.ask(SaveSlot(file=mind_file(info.mind), mind=info.mind), timeout=self.bound_s)
            except ActordError as e:
                left[info.mind] = f"its slot's save failed: {e.type}"
                return
            left.pop(info.mind, None)  # two slots may hold one name (a restore of her file by slot)
            written["slots"] += "skipped" not in out

        async def worker() -> None:
            while queue:
                name = queue.popleft()
                try:
                    await self.spill(name, mind_file(name), False)
                except PageNotFound:
                    left.pop(name, None)  # gone meanwhile: nothing of hers in RAM to keep
                    continue
                except ActordError as e:
                    left[name] = f"its spill failed: {e.type}"
                    continue
                left.pop(name, None)
                written["pages"] += 1

        with anyio.move_on_after(bound_s) as scope:
            # Again while a pass wrote something: a move under way at the stop (a page-in a
            # cancelled placement was making, an eviction) may have put a mind where the
            # pass had looked already. An unchanged mind costs a pass nothing.
            for _ in range(PASSES):
                before = written["slots"] + written["pages"]
                async with anyio.create_task_group() as tg:
                    for slot in self.slots:
                        tg.start_soon(one_slot, slot)
                try:
                    dirty = await self.pages.ask(Unpersisted(), timeout=self.bound_s)
                except ActordError as e:  # the page store crashed or stopped: its pages are lost
                    log.warning("persist.pages_unreadable", error=e.to_dict())
                    break
                for name, _ in dirty:
                    if is_cache_mind(name):
                        continue
                    why = check_mind(name)
                    if why is not None:
                        left[name] = f"its name cannot be a page file's: {why}"
                        continue
                    left[name] = "in RAM"
                    queue.append(name)
                async with anyio.create_task_group() as tg:
                    for _ in range(min(self.threads, len(queue))):
                        tg.start_soon(worker)
                if written["slots"] + written["pages"] == before:
                    break
        t_ms = (time.perf_counter() - t0) * 1e3
        for mind, why in sorted(left.items()):
            self.metrics.minds_not_persisted_total.inc()
            log.warning("mind.not_persisted", mind=mind, why=why if not scope.cancelled_caught else
                        f"{why} (the stop's bound of {bound_s} s ran out)")
        log.info("daemon.persisted", slots=written["slots"], pages=written["pages"], not_persisted=len(left),
                 slots_unreadable=sorted(set(unreadable)), t_ms=round(t_ms, 1))
        return {"persisted_slots": written["slots"], "persisted_pages": written["pages"],
                "not_persisted": len(left)}
