"""Hunting with the simulation: the first seed whose run breaks an invariant."""

from __future__ import annotations

from typing import Any

import anyio

from actord.replay.sim import InvariantViolated, simulate


def first_finding(model: str, loras: Any, seeds: range, steps: int, what: str = "") -> tuple[int, str]:
    """The first seed whose run reports a finding naming `what`, and the finding; a finding
    that does not name it is raised as it is, and no finding in `seeds` fails the test."""
    for seed in seeds:
        try:
            anyio.run(simulate, seed, steps, model, loras)
        except InvariantViolated as e:
            if what in str(e):
                print(f"found at seed {seed}: {e}")
                return seed, str(e)
            raise
    raise AssertionError(f"no seed in {seeds} found {what!r}")
