"""Which CPUs the engine thread runs on: `--engine-cpus auto|off|LIST`.

Why: the engine thread and the event loop hand every step to each other (the loop plans
and routes while llama_decode runs). Left to the kernel, the loop, woken by the engine's
doorbell, is often placed on the engine's own CPU: the two then take turns on one core
while the other idles. Measured on the 2-CPU build machine (bench/hot_path.py (b), 8 slots
on the tiny model): ~1 involuntary context switch of the engine thread per step and 1.13x
the raw loop's time per step; with the engine thread kept off one CPU, 0 switches and 1.01x.

"auto" (the default) keeps the engine thread, and so the compute threads libllama starts
from it (they inherit its mask), off the first CPU this process may use, which the loop and
everything else are left free to take; the engine's threads must fit in the others (the
default `threads` is all CPUs but one), else nothing is pinned. "off" pins nothing. A list
("1-3,6") names the engine's CPUs outright; each must be one this process may use.

Pure: the engine thread applies what this decides.
"""

from __future__ import annotations

import msgspec

from actord.vocabulary.config import parse_cpu_list
from actord.vocabulary.errors import InvalidParams


class CpuChoice(msgspec.Struct, frozen=True):
    cpus: frozenset[int] | None  # None: the engine thread keeps the mask it inherited
    reason: str


def choose_engine_cpus(mode: str, allowed: set[int] | frozenset[int], threads: int) -> CpuChoice:
    """The engine thread's CPUs, given the CPUs this process may use and libllama's threads."""
    if mode == "off":
        return CpuChoice(None, "off")
    if mode != "auto":
        cpus = parse_cpu_list(mode)
        foreign = sorted(cpus - set(allowed))
        if foreign:
            raise InvalidParams(f"engine_cpus names CPUs this process may not use: {foreign}",
                                engine_cpus=mode, allowed=sorted(allowed))
        return CpuChoice(cpus, "asked")
    if len(allowed) < 2:
        return CpuChoice(None, "one CPU: nothing to keep apart")
    rest = frozenset(sorted(allowed)[1:])
    if threads > len(rest):
        return CpuChoice(None, f"{threads} engine threads need every CPU: the loop shares them")
    return CpuChoice(rest, "auto: the first CPU is left to the loop")
