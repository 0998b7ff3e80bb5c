"""Runtime hooks below the system façade: recording a trace, digesting state for it.

Why a seam: `system.py` is the embedded API and must not depend on the replay package (the
layering test checks it). Recording is an instrument the dispatcher carries, like trio's
instruments: it costs nothing when none is installed, and the replay package owns how a
trace is written. The import happens only when a trace is asked for.
"""

from __future__ import annotations

from typing import Any


def open_recorder(trace: Any, config: Any) -> Any:
    """A trace recorder for `trace` (a path, or a list to append events to)."""
    from actord.replay.trace import TraceRecorder

    return TraceRecorder(trace, config)


def state_digest(obj: Any) -> str:
    """The digest a trace uses for `obj` (path-independent, timings left out)."""
    from actord.replay.trace import digest

    return digest(obj)
