"""A mind arriving while long generations hold every slot: her wait, with and without
generations giving their slot up (policy/yielding.py), side by side in one run.

Why: a slot used to be held from a request's first token to its last, so a mind arriving
while every slot generated waited for a whole generation to end. With `yield_after_tokens`
a long generation gives its slot up at a clean boundary (her state pages out, a memory
copy) and goes on after the waiting mind. What it costs the long generations is the page
moves and the turns they wait; what it buys the newcomer is her time to first token.

How: `--slots` minds each start a generation of `--long` tokens (greedy, ignore_eos) on a
prompt of `--prompt` tokens; once every one has streamed a token, a new mind sends a turn
of `--short` tokens. Timed: the newcomer's time to first token and to her answer, and the
long generations' wall time and the makespan (until all of it is done: the same work either
way, so what it adds is the switches); each run `--reps` times under `yield_after_tokens` 0
(before) and `--after` (after), alternating. The long answers are checked equal between the
two (a yield changes no token). Targets (printed, not asserted): the newcomer's TTFT after /
before <= 0.35 (she waits about a quantum of `--after` tokens instead of a generation of
`--long`), the makespan after / before <= 1.1.

Run: .venv/bin/python bench/yield_fairness.py [--gemma] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402

from actord.service.system import ActorSystem  # noqa: E402
from actord.vocabulary import log  # noqa: E402
from actord.vocabulary.config import Config  # noqa: E402

TTFT_TARGET, MAKESPAN_TARGET = 0.35, 1.1


def prompt_of(k: int, n: int) -> list[int]:
    return [1] + [3 + (k * 131 + i * 17) % 400 for i in range(n - 1)]


async def one(model: str, slots: int, after: int, args: argparse.Namespace, rep: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="actord-yield-") as d:
        cfg = Config(model=model, slots=slots, ctx=slots * (args.prompt + args.long) + args.prompt + args.short + 64,
                     batch=64, page_dir=d, yield_after_tokens=after)
        async with ActorSystem(cfg) as s:
            started = [anyio.Event() for _ in range(slots)]
            longs: dict[int, list[int]] = {}
            out: dict[str, float] = {}

            async def long(i: int) -> None:
                t0 = time.perf_counter()
                r = await s.complete(prompt=prompt_of(100 * rep + i, args.prompt), n_predict=args.long,
                                     ignore_eos=True, mind=f"long{i}", stream=True, logprobs=True, top_logprobs=4,
                                     on_token=lambda c, e=started[i]: e.set())
                longs[i] = r
                out[f"wall{i}"] = time.perf_counter() - t0

            async def newcomer() -> None:
                for e in started:
                    await e.wait()
                first: list[float] = []
                t0 = time.perf_counter()
                await s.complete(prompt=prompt_of(100 * rep + 99, args.prompt), n_predict=args.short, ignore_eos=True,
                                 mind="new", stream=True,
                                 on_token=lambda c: first.append(time.perf_counter()) if c["tokens"] else None)
                out["ttft"] = first[0] - t0
                out["answer"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(slots):
                    tg.start_soon(long, i)
                tg.start_soon(newcomer)
            out["makespan"] = time.perf_counter() - t0
            out["yields"] = s.metrics.registry.get_sample_value("generations_yielded_total")
            out["wall"] = statistics.mean(out[f"wall{i}"] for i in range(slots))
            out["results"] = [longs[i] for i in range(slots)]  # type: ignore[assignment]
            return out


async def main(args: argparse.Namespace) -> None:
    log.configure(level="warning")
    if args.gemma:
        from actord.testing.models import gemma3_270m_path

        model = str(gemma3_270m_path())
    else:
        from actord.testing.models import write_tiny_llama

        model = str(write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny.gguf", seed=1))
    runs: dict[int, list[dict]] = {0: [], args.after: []}
    for rep in range(args.reps):
        for after in (0, args.after):
            runs[after].append(await one(model, args.slots, after, args, rep))
    # Greedy either way: the two agree token for token up to a near tie (another batch shape
    # moves a logit by a few hundredths of a nat: replay/sim_oracle.py), judged by the
    # unbroken run's own log probabilities.
    from actord.replay.sim_oracle import parted

    pairs = [(b, a) for rb, ra in zip(runs[0], runs[args.after]) for b, a in zip(rb["results"], ra["results"])]
    partings = [parted(tuple(a.tokens), b) for b, a in pairs]
    same = all(p is None for p in partings)
    ties = sum(p is None and a.tokens != b.tokens for p, (b, a) in zip(partings, pairs))

    def med(after: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[after])

    print(f"model {Path(model).name}, {args.slots} slots busy with {args.long}-token generations on "
          f"{args.prompt}-token prompts; a new mind's {args.short}-token turn; {args.reps} reps, medians")
    print(f"{'':30}{'before (0)':>14}{f'after ({args.after})':>14}{'after/before':>14}")
    for key, name in (("ttft", "newcomer first token s"), ("answer", "newcomer answer s"),
                      ("wall", "long generations' wall s"), ("makespan", "all of it done s")):
        b, a = med(0, key), med(args.after, key)
        print(f"{name:30}{b:14.3f}{a:14.3f}{a / b:14.3f}")
    print(f"{'yields per run':30}{med(0, 'yields'):14.0f}{med(args.after, 'yields'):14.0f}")
    ttft, span = med(args.after, "ttft") / med(0, "ttft"), med(args.after, "makespan") / med(0, "makespan")
    print(f"long answers the same with and without yields: {same} ({len(partings)} answers, {ties} parting at a near "
          f"tie{'' if same else '; ' + next(p for p in partings if p)})")
    print(f"target: newcomer TTFT ratio <= {TTFT_TARGET}: {'met' if ttft <= TTFT_TARGET else 'NOT met'} ({ttft:.3f}); "
          f"makespan ratio <= {MAKESPAN_TARGET}: {'met' if span <= MAKESPAN_TARGET else 'NOT met'} ({span:.3f})")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", action="store_true", help="Gemma 3 270M (default: the tiny f32 llama)")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--long", type=int, default=600)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--after", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    anyio.run(main, ap.parse_args())
