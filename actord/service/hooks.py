"""Runtime hooks below the system façade: recording a trace, digesting state for it.

Why a seam: `system.py` is the embedded API and must not depend on the replay package (the
layering test checks it). Recording is an instrument the dispatcher carries, like trio's
instruments: it costs nothing when none is installed, and the replay package owns how a
trace is written. The import happens only when a trace is asked for.
"""

from __future__ import annotations

from typing import Any


def attach_recorder(trace: Any, config: Any, dispatcher: Any) -> Any:
    """A trace recorder for `trace` (a path, or a list to append events to) attached to
    `dispatcher`; None when no trace is asked for."""
    if trace is None or trace == "":
        return None
    from actord.replay.trace import TraceRecorder

    recorder = TraceRecorder(trace, config)
    # A replay delivers every step as a message: record the run the same way.
    dispatcher.loop_in_handler = False
    recorder.attach(dispatcher)
    return recorder


def state_digest(obj: Any) -> str:
    """The digest a trace uses for `obj` (path-independent, timings left out)."""
    from actord.replay.trace import digest

    return digest(obj)
