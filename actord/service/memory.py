"""What holds the daemon's memory (`stats memory`, `actord_memory_bytes{component}`), and
the allocator care that keeps its RSS flat for months.

Why a module of its own: a daemon that runs for months must be able to say, at any time,
which part holds its bytes, so growth is found by reading a report rather than by bisecting
a soak. The figures come from three independent sources, so that a leak cannot hide in
the arithmetic:

- the actors' own statistics (the page store's StoreStats, the checkpoint budget's
  BudgetStats), the chat turn memory's and the fronts' own byte counts (stored responses,
  connection buffers: a front registers a reader with `MemorySources.add`), the engine's
  step-record ring (its StepRecords job) and the context's KV size (model props);
- the kernel's view of the process (/proc/self/smaps): RSS, the model file's resident
  pages (libllama maps its weights), other file-backed pages (the interpreter and shared
  libraries: code), anonymous pages;
- glibc's view of its heap (mallinfo2): bytes in use, bytes free but held (what
  fragmentation costs, what `malloc_trim` gives back).

`python_heap` is malloc's bytes in use less the named parts that live there (Python's
objects over 512 B, the extensions' and libllama's own allocations): measured by glibc, not
guessed. With tracemalloc on (`--trace-malloc-s`) it is tracemalloc's traced total less
the named Python-held parts instead. `heap_other` is anonymous resident memory that malloc
does not count as in use: pymalloc's arenas (Python's small objects), glibc's free chunks
whose pages are still resident (fragmentation: `malloc.free` is glibc's own figure, resident
or not), thread stacks; this report cannot split it further without pymalloc's statistics.
`unaccounted` is RSS less the sum of the parts: near zero by construction (the parts
partition the kernel's figure); negative when two sources overlap (named parts larger than
malloc's in-use bytes).

`housekeeping` is the daemon's periodic task: the report into the gauges, `malloc_trim(0)`
on a worker thread (glibc keeps freed page-sized chunks in its arenas otherwise: a daemon
that moves pages sees its RSS climb with no live object behind it), and, when asked, a
tracemalloc snapshot diffed against the first one, its top growth logged by file:line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import tracemalloc
from typing import Any, Awaitable, Callable

import anyio
import msgspec

from actord.chat.state import ChatState
from actord.engine import jobs as J
from actord.engine.jobs import ModelProps
from actord.service.builder import Actors
from actord.vocabulary.config import Config
from actord.vocabulary.log import get
from actord.serving.checkpoint_budget import BudgetStats
from actord.serving.page_store import StoreStats

log = get("actord.service.memory")

# The order the report lists its parts in (and the gauge's label values).
COMPONENTS = ("page_store", "checkpoints", "chat_turn_memory", "stored_responses", "connection_buffers",
              "trace_ring", "libllama_kv", "libllama_model", "code", "python_heap", "heap_other")


class MemoryReport(msgspec.Struct, frozen=True):
    """`stats memory`: bytes by what holds them, the process's RSS and what is left over.

    components: the parts above (see the module docstring for how each is measured);
    accounted = their sum; unaccounted = rss - accounted; device: bytes held off the host
    (the KV cache when the model runs on a GPU); malloc: glibc's raw figures."""

    rss: int
    components: dict[str, int]
    accounted: int
    unaccounted: int
    accounted_share: float
    python_heap_method: str  # "malloc_in_use" or "tracemalloc"
    device: dict[str, int] = {}
    malloc: dict[str, int] = {}


class MemorySources:
    """Readers of bytes held outside the actors, registered by whoever holds them (the
    fronts): component -> list of callables answering bytes now. A reader that fails is
    dropped and logged, never a reason for the report to fail."""

    def __init__(self) -> None:
        self._readers: dict[str, list[Callable[[], int]]] = {}

    def add(self, component: str, reader: Callable[[], int]) -> None:
        assert component in COMPONENTS, component
        self._readers.setdefault(component, []).append(reader)

    def read(self, component: str) -> int:
        total = 0
        for reader in list(self._readers.get(component, [])):
            try:
                total += max(0, int(reader()))
            except Exception as e:  # noqa: BLE001  (a front's reader must not break the report)
                log.warning("memory.reader_failed", component=component, error=repr(e))
                self._readers[component].remove(reader)
        return total


# -- the process, as the kernel and the allocator see it ----------------------------------


class Smaps(msgspec.Struct, frozen=True):
    rss: int
    anon: int
    model: int  # resident pages of the named files (the model's weights, mapped by libllama)
    files: int  # resident pages of every other file (the interpreter, shared libraries)


def read_smaps(model_paths: set[str], pid: str = "self") -> Smaps:
    """Resident bytes by kind of mapping, from /proc/<pid>/smaps (Linux; zeros elsewhere)."""
    rss = anon = model = files = 0
    path: str | None = None
    try:
        with open(f"/proc/{pid}/smaps", "rb") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if not head.endswith(b":"):  # a mapping's first line: its range, ..., its path
                    parts = line.split(None, 5)
                    path = parts[5].decode(errors="replace").strip() if len(parts) > 5 else ""
                    continue
                if head != b"Rss:":
                    continue
                n = int(line.split()[1]) * 1024
                rss += n
                if path and path.startswith("/"):
                    if path in model_paths:
                        model += n
                    else:
                        files += n
                else:
                    anon += n  # [heap], [stack], anonymous mmaps
    except OSError:
        pass
    return Smaps(rss=rss, anon=anon, model=model, files=files)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def mallinfo() -> dict[str, int]:
    """glibc's heap figures (empty where there is no mallinfo2): arena (bytes its arenas
    took from the system), mmapped (chunks it mmapped on their own), in_use, free (held in
    its arenas, not handed out: what a trim may give back)."""
    fn = getattr(_LIBC, "mallinfo2", None) if _LIBC is not None else None
    if fn is None:
        return {}
    fn.restype = _Mallinfo2
    m = fn()
    return {"arena": m.arena, "mmapped": m.hblkhd, "in_use": m.uordblks + m.hblkhd, "free": m.fordblks}


M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_arenas(n: int) -> bool:
    """At most `n` malloc arenas (glibc's default is 8 per core): every thread that
    allocates (the engine, the disk and render workers, anyio's pool) otherwise gets an
    arena of its own, and each keeps the free chunks its page-sized buffers left."""
    fn = getattr(_LIBC, "mallopt", None) if _LIBC is not None and n > 0 else None
    return bool(fn(M_ARENA_MAX, n)) if fn is not None else False


def malloc_trim() -> bool:
    """Give glibc's free arena pages back to the system (every arena, not only the top)."""
    fn = getattr(_LIBC, "malloc_trim", None) if _LIBC is not None else None
    return bool(fn(0)) if fn is not None else False


# -- the report ------------------------------------------------------------------------


def _ring_bytes(records: list[Any]) -> int:
    """The step-record ring's bytes: a sample's deep size, scaled to the ring's length."""
    if not records:
        return 0
    sample = records[-64:]
    each = 0
    for r in sample:
        each += sys.getsizeof(r) + sum(sys.getsizeof(getattr(r, f)) for f in r.__struct_fields__)
        each += sum(sys.getsizeof(x) for x in r.seqs) + sum(sys.getsizeof(d) for d in r.drafts)
    return each * len(records) // len(sample)


def _model_paths(config: Config) -> set[str]:
    out = set()
    for p in (config.model, config.spec_draft_model):
        if p:
            out.add(os.path.realpath(p))
    return out


async def report(a: Actors, engine: Any, config: Config, props: ModelProps, chat_state: ChatState,
                 sources: MemorySources) -> MemoryReport:
    """The report, each actor asked through its own stats message (bounded by ask_timeout_s);
    `engine` is the engine thread's door (its step records)."""
    pages = await a.pages.ask(StoreStats())
    ckpt = await a.ckpt_budget.ask(BudgetStats())
    records = await engine.run(J.StepRecords())
    prompter = chat_state.prompter
    kv = props.n_ctx * props.kv_bytes_per_token + props.n_seq_max * props.recurrent_state_bytes
    on_host = props.device.backend.upper() == "CPU" or not props.device.gpu_offload
    named = {
        "page_store": pages.live_bytes + pages.pooled,
        "checkpoints": ckpt.used,
        "chat_turn_memory": prompter.memory.held * 4 if prompter is not None else 0,
        "stored_responses": sources.read("stored_responses"),
        "connection_buffers": sources.read("connection_buffers"),
        "trace_ring": _ring_bytes(records),
        "libllama_kv": kv if on_host else 0,
    }
    smaps = await anyio.to_thread.run_sync(read_smaps, _model_paths(config))
    heap = mallinfo()
    in_use = heap.get("in_use", 0)
    if tracemalloc.is_tracing():
        method = "tracemalloc"
        python_held = sum(named[k] for k in ("page_store", "checkpoints", "chat_turn_memory", "stored_responses",
                                             "connection_buffers", "trace_ring"))
        python_heap = max(0, tracemalloc.get_traced_memory()[0] - python_held)
    else:
        method = "malloc_in_use"
        python_heap = max(0, in_use - sum(named.values()))
    heap_other = max(0, smaps.anon - max(in_use, sum(named.values()) + python_heap)) if heap else 0
    parts = {**named, "libllama_model": smaps.model, "code": smaps.files, "python_heap": python_heap,
             "heap_other": heap_other}
    components = {k: parts[k] for k in COMPONENTS}
    accounted = sum(components.values())
    return MemoryReport(rss=smaps.rss, components=components, accounted=accounted,
                        unaccounted=smaps.rss - accounted,
                        accounted_share=round(accounted / smaps.rss, 4) if smaps.rss else 0.0,
                        python_heap_method=method, device={} if on_host else {"libllama_kv": kv}, malloc=heap)


def publish(metrics: Any, r: MemoryReport) -> None:
    """The report into `actord_memory_bytes{component}` (rss and unaccounted beside the parts)."""
    g = metrics.memory_bytes
    for k, v in r.components.items():
        g.labels(component=k).set(v)
    g.labels(component="rss").set(r.rss)
    g.labels(component="unaccounted").set(r.unaccounted)


# -- the daemon's periodic care ------------------------------------------------------------


class MallocTracer:
    """tracemalloc snapshots diffed against the first one taken: what grew, by file:line."""

    def __init__(self, frames: int = 1, top: int = 15) -> None:
        self.top = top
        self.first: tracemalloc.Snapshot | None = None
        if not tracemalloc.is_tracing():
            tracemalloc.start(frames)

    def diff(self) -> list[str]:
        snap = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
        if self.first is None:
            self.first = snap
            return []
        stats = snap.compare_to(self.first, "lineno")
        return [f"{s.size_diff / 1024:+.1f} KiB {s.count_diff:+d} blocks {s.traceback[0].filename}:"
                f"{s.traceback[0].lineno}" for s in stats[: self.top]]


async def housekeeping(metrics: Any, report: Callable[[], Awaitable[MemoryReport]], every_s: float, *,
                       trim: bool = True, trace_malloc_s: float = 0.0) -> None:
    """Forever: every `every_s`, trim malloc (worker thread) and refresh the gauges; every
    `trace_malloc_s` (0: never), log tracemalloc's top growth since the first snapshot."""
    tracer = MallocTracer() if trace_malloc_s > 0 else None
    last_trace = -float("inf")
    while True:
        if trim:
            await anyio.to_thread.run_sync(malloc_trim)
        try:
            publish(metrics, await report())
        except Exception as e:  # noqa: BLE001  (a report that cannot be made now is tried again)
            log.warning("memory.report_failed", error=repr(e))
        now = anyio.current_time()
        if tracer is not None and now - last_trace >= trace_malloc_s:
            last_trace = now
            top = await anyio.to_thread.run_sync(tracer.diff)
            if top:
                log.info("memory.growth", rss=read_smaps(set()).rss, traced=tracemalloc.get_traced_memory()[0],
                         top=top)
        await anyio.sleep(every_s)
