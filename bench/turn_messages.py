"""How many mailbox deliveries (and engine jobs besides steps) one mind turn costs, from a
recorded trace: a resident mind's next turn, and a mind switch (the slot's mind paged out,
another paged in). Issue 24's bound: at most 5 deliveries for a resident turn, at most 12
for a switch.

    .venv/bin/python bench/turn_messages.py [--model PATH] [--verbose]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import anyio

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem
from actord.vocabulary.trace import Deliver, EngineDone

STEP_JOBS = {"Step", "StepJob", "RunStep"}


def _window(events: list, start: int) -> tuple[list[str], list[str]]:
    # A step is a delivery only in a recorded run (a replay orders them); the count is
    # of the messages around the steps.
    deliveries = [f"{e.actor}:{e.msg}" for e in events[start:] if isinstance(e, Deliver) and e.msg not in STEP_JOBS]
    jobs = [e.job for e in events[start:] if isinstance(e, EngineDone)]
    return deliveries, jobs


async def measure(model: str, verbose: bool) -> dict[str, tuple[int, int]]:
    events: list = []
    with tempfile.TemporaryDirectory() as d:
        cfg = Config(model=model, slots=1, ctx=1024, page_dir=str(Path(d) / "pages"), seed=1)
        out: dict[str, tuple[int, int]] = {}
        async with ActorSystem(cfg, trace=events) as system:
            prompts = {"ada": list(range(10, 60)), "bob": list(range(110, 160))}  # no prefix shared

            async def turn(mind: str, extra: list[int]) -> None:
                await system.complete(prompt=prompts[mind] + extra, mind=mind, n_predict=4, temperature=0.0)

            i = len(events)
            await turn("ada", [1])        # ada placed fresh, in an empty slot
            out["new"] = _window(events, i)
            i = len(events)
            await turn("ada", [2, 3])     # resident turn
            out["resident"] = _window(events, i)
            await turn("bob", [4])        # bob fresh: ada paged out
            i = len(events)
            await turn("ada", [5])        # switch: bob paged out, ada paged in
            out["switch"] = _window(events, i)
        res = {}
        for k, (dl, jobs) in out.items():
            other = [j for j in jobs if j not in STEP_JOBS]
            res[k] = (len(dl), len(other))
            if verbose:
                print(k, collections.Counter(dl), collections.Counter(jobs))
        return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    model = a.model
    if not model:
        from actord.testing.models import write_tiny_llama

        model = str(write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny.gguf", seed=1))
    res = anyio.run(measure, model, a.verbose)
    for k, bound in (("new", 6), ("resident", 5), ("switch", 12)):
        n, jobs = res[k]
        print(f"{k:9s} deliveries besides steps {n:3d} (bound {bound})  engine jobs besides steps {jobs}")


if __name__ == "__main__":
    main()
