"""Real-model check of the checkpoint policies: prompt tokens processed, oldest vs divergence vs placement.

Gemma 3 270M (SWA 512): three minds over two slots, each prompt ~1.4k tokens with a
"volatile" block about halfway in that changes every turn (a memory summary an agent
rewrites), so every turn diverges near the same point. Minds switch slots through pages
(placed by the daemon), and the checkpoint budget is tight. Under the old rule a page keeps
the head and the newest checkpoints, so the resume falls back to the head; the
divergence-aware rule keeps the ones just under the break; placement makes and keeps them
where each mind's history says it diverges. Same workload, same seed, all policies in one
run (SWA cache not full: `--swa-full off`, or no checkpoint would be needed); prints prompt
tokens processed per turn and in total.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import anyio

from actord.vocabulary import log
from actord.vocabulary.config import Config
from actord.service.system import ActorSystem
from actord.testing.models import gemma3_270m_path

STABLE = ("The harbour town of Veln sits between two cliffs. Its lighthouse has burned for three hundred years, "
          "tended by one family at a time. Fishing boats leave at dawn and return at dusk. ")


def prompt(mind: int, turn: int) -> str:
    head = f"Mind {mind}. " + STABLE * 12
    volatile = f"\n[memory, turn {turn}: the ferry ran {turn * 3 + mind} times this week]\n"
    tail = STABLE * 12 + f"\nQ{turn}: what changed?\nA:"
    return head + volatile + tail


async def run(policy: str, model: str, turns: int, budget_mb: int) -> tuple[int, int, list[int]]:
    with tempfile.TemporaryDirectory() as d:
        cfg = Config(model=model, slots=2, ctx=8192, batch=256, threads=1, page_dir=d, checkpoint_every=128,
                     ctx_checkpoints=4, ctx_checkpoints_bytes=budget_mb << 20, checkpoint_policy=policy,
                     swa_full="off")
        per_turn: list[int] = []
        async with ActorSystem(cfg) as s:
            for t in range(turns):
                for m in range(3):
                    r = await s.complete(prompt=prompt(m, t), n_predict=2, mind=f"m{m}")
                    if t > 0:
                        per_turn.append(r.n_prompt_processed)
            snap = s.metrics.snapshot()
        return sum(per_turn), int(snap["ctx_checkpoint_restores_total"]), per_turn


async def main(ns: argparse.Namespace) -> None:
    model = ns.model or str(gemma3_270m_path())
    print(f"model {model}; 3 minds over 2 slots; {ns.turns} turns each; checkpoint budget {ns.budget_mb} MB")
    out = {}
    for policy in ("oldest", "divergence", "placement"):
        t0 = time.perf_counter()
        out[policy] = await run(policy, model, ns.turns, ns.budget_mb)
        total, restores, per_turn = out[policy]
        print(f"{policy:<11} prompt tokens processed after turn 0: {total:>6}  checkpoint resumes {restores:>2}  "
              f"per turn {per_turn}  ({time.perf_counter() - t0:.0f} s)")
    old = out["oldest"][0]
    print(f"divergence / oldest processed tokens: {out['divergence'][0] / max(1, old):.2f}; "
          f"placement / oldest: {out['placement'][0] / max(1, old):.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--budget-mb", type=int, default=64)
    log.configure(level="warning")
    anyio.run(main, ap.parse_args())
