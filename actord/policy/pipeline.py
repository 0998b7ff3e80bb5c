"""How many engine steps the Scheduler keeps in flight: `--pipeline-depth` (0 = auto).

Why it is a choice: with depth d, steps k+1..k+d-1 are planned before step k's samples reach
Python, and the engine feeds each sequence's last sample itself, so it never waits for the
loop; and at d >= 3 the engine lets a finished decode step's result wait for the loop's next
wake-up (engine/thread.py `_announce`), so the loop is woken once per few steps. That pays
where a step is cheap: measured with the tiny model at 8 slots (a ~0.25 ms step,
bench/hot_path.py (b)), actord took 1.09-1.20x the raw loop's time per step at depth 2 and
1.02-1.05x at depth 4. It costs where a step is slow, and gains nothing there (a 40 ms step
hides Python's ~40 us per step): a new request's prompt joins after the d-1 steps already
planned, and a request that ends by its sample is answered d-1 steps after it. Its KV ends
at its end-of-generation or stop token whatever d is (the engine skips the feeds planned
after it), but a stop string or a cancel leaves up to d-1 tokens past the end, which a
recurrent or SWA model's next turn cannot cut back: it resumes from a checkpoint.

"auto" takes depth 4 where the model runs on a GPU backend (the accelerator actord is for:
steps of a few ms and less) and 2 on the CPU. It is decided from the engine's device report,
never from timings, so a recorded trace replays with the same plans.

Pure: the system resolves it once the engine reports its device.
"""

from __future__ import annotations

FAST = 4  # on a device whose step is cheap
SLOW = 2  # the CPU: one step planned ahead hides the loop


def pipeline_depth(asked: int, backend: str) -> int:
    if asked:
        return asked
    return SLOW if backend.upper() == "CPU" else FAST
