"""`actord replay TRACE --model PATH` and `actord simulate --seed N --steps K [--seeds M]`."""

from __future__ import annotations

import argparse
import sys
import time

import anyio

from actord import log


def main(cmd: str, argv: list[str]) -> int:
    log.configure(level="error")
    if cmd == "replay":
        ap = argparse.ArgumentParser(prog="actord replay")
        ap.add_argument("trace")
        ap.add_argument("--model", required=True)
        ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
        ns = ap.parse_args(argv)
        from actord.replay.replay import replay_file

        r = replay_file(ns.trace, ns.model, ns.backend)
        if r.ok:
            print(f"replayed {r.events} events: no divergence")
            return 0
        print(f"{r.message}\n  expected: {r.expected}\n  got:      {r.got}")
        return 1
    ap = argparse.ArgumentParser(prog="actord simulate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1, help="run seeds seed..seed+seeds-1")
    ap.add_argument("--steps", type=int, default=8, help="operations per client")
    ap.add_argument("--model", help="GGUF (default: a generated tiny llama)")
    ap.add_argument("--lora", help="a LoRA for --model (default: generated with the tiny model)")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ns = ap.parse_args(argv)
    from actord.replay.sim import InvariantViolated, repro, simulate

    model, lora = ns.model, ns.lora
    if model is None:
        import tempfile

        from actord.testing.models import write_tiny_llama, write_tiny_lora

        d = tempfile.mkdtemp(prefix="actord-simmodel-")
        model = str(write_tiny_llama(f"{d}/tiny.gguf", seed=1))
        lora = lora or str(write_tiny_lora(f"{d}/lora.gguf", model, seed=3))

    async def run() -> int:
        t0 = time.perf_counter()
        for seed in range(ns.seed, ns.seed + ns.seeds):
            try:
                r = await simulate(seed, ns.steps, model, lora)
            except InvariantViolated as e:
                cmd = repro(seed, ns.steps, model) if ns.model else f"actord simulate --seed {seed} --steps {ns.steps}"
                print(f"FAILED: {e}\nreproduce: {cmd}")
                return 1
            if ns.seeds <= 20:
                print(f"seed {seed}: {r.ops} ops, {r.events} events, trace {r.trace_hash}, refusals {r.errors}")
        print(f"{ns.seeds} seed(s) passed in {time.perf_counter() - t0:.1f} s")
        return 0

    return anyio.run(run, backend=ns.backend)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
