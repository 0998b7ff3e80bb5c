"""Where a benchmark leaves its figures: `bench/out/NAME.json`, beside what it prints.

Why: the printed tables are for a person; `bench/report.py` draws plots from these files
(`make bench` runs it last), so every benchmark it draws writes its rows here through this
one helper, in one shape: {"bench": NAME, "written": unix time, "argv": [...], "host": ...,
plus the benchmark's own keys (its "rows" at least)}. ACTORD_BENCH_OUT names another folder.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("ACTORD_BENCH_OUT") or Path(__file__).resolve().parent / "out")


def path(name: str) -> Path:
    return OUT / f"{name}.json"


def write(name: str, **figures: Any) -> Path:
    """Write NAME's figures (atomically: a report never reads half a file) and say where."""
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {"bench": name, "written": round(time.time(), 1), "argv": sys.argv[1:],
           "host": {"machine": platform.machine(), "cpus": len(os.sched_getaffinity(0))}, **figures}
    target = path(name)
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(target)
    print(f"figures: {target}", flush=True)
    return target


def read(name: str) -> dict[str, Any] | None:
    """NAME's figures, or None where it has not been run (or left an unreadable file)."""
    try:
        return json.loads(path(name).read_text())
    except (OSError, ValueError):
        return None
