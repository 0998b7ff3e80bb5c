"""`actord replay TRACE --model PATH` and `actord simulate --seed N --steps K [--seeds M]`."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import anyio

from actord.vocabulary import log


def main(cmd: str, argv: list[str]) -> int:
    log.configure(level="critical")
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
    ap.add_argument("--lora", action="append", help="a LoRA for --model (default: three generated with the tiny model)")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--device-budgets", action=argparse.BooleanOptionalAction, default=True,
                    help="seeded tight device budgets shared by genes and slot states (default on)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (seeds are split between them)")
    ap.add_argument("--spec", action="store_true",
                    help="speculative decoding on every memory kind: llama and SWA drafted by their first block "
                         "(write_pruned_draft), a model with an MTP layer by its MTP head, a recurrent one by a "
                         "tiny llama of the same vocabulary")
    ap.add_argument("--verbose", "-v", action=argparse.BooleanOptionalAction, default=None,
                    help="a line per seed with its trace hash (default: with one job and at most 20 seeds)")
    ns = ap.parse_args(argv)
    verbose = ns.verbose if ns.verbose is not None else ns.jobs <= 1 and ns.seeds <= 20

    tmpdir = None
    if ns.model is not None:
        models = [(ns.model, ns.lora or [])]
    else:
        # Four generated models, one per memory kind, rotating by seed: a plain llama, an SWA
        # one and a hybrid one (memory that cannot be cut back, so checkpoints, their budget
        # and resumes are exercised) and a pure recurrent one (no KV cells at all).
        import tempfile

        from actord.testing.models import (
            write_tiny_llama, write_tiny_lora, write_tiny_mamba2, write_tiny_qwen35, write_tiny_swa,
        )

        tmpdir = tempfile.TemporaryDirectory(prefix="actord-simmodel-")
        d = tmpdir.name
        models = []
        for name, m, targets in (
            ("tiny", write_tiny_llama(f"{d}/tiny.gguf", seed=1), None),
            ("swa", write_tiny_swa(f"{d}/swa.gguf", seed=2), None),
            ("hybrid", write_tiny_qwen35(f"{d}/hybrid.gguf", seed=3), None),
            ("recurrent", write_tiny_mamba2(f"{d}/recurrent.gguf", seed=5), ["ssm_in", "ssm_out"]),
        ):
            kw = {"targets": targets} if targets else {}
            models.append((str(m), [str(write_tiny_lora(f"{d}/{name}-lora{i}.gguf", str(m), seed=3 + i, **kw))
                                    for i in range(3)]))
    if ns.spec:
        import tempfile

        from actord.testing.draft_models import has_mtp_layers, has_recurrent_layers, write_pruned_draft
        from actord.testing.models import write_tiny_llama

        # Recurrent and hybrid memory roll rejected drafts back in the verify (engine/step.py
        # `_verify`); a pruned copy of one is no model (its first block is recurrent alone),
        # so an MTP layer drafts where there is one, else a tiny llama of the same vocabulary.
        spec_dir = tempfile.TemporaryDirectory(prefix="actord-simdraft-")

        def _draft(i: int, m: str) -> str:
            if not has_recurrent_layers(m):
                return str(write_pruned_draft(m, f"{spec_dir.name}/draft{i}.gguf", 1))
            if has_mtp_layers(m):
                return "mtp"
            return str(write_tiny_llama(f"{spec_dir.name}/draft{i}.gguf", seed=7))

        models = [(m, loras, _draft(i, m)) for i, (m, loras, *_) in enumerate(models)]
    seeds = list(range(ns.seed, ns.seed + ns.seeds))
    t0 = time.perf_counter()
    if ns.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        chunks = [seeds[i::ns.jobs] for i in range(ns.jobs)]
        with ProcessPoolExecutor(ns.jobs) as pool:
            outs = list(pool.map(_run_seeds, chunks, [ns.steps] * ns.jobs, [models] * ns.jobs,
                                 [ns.backend] * ns.jobs, [ns.device_budgets] * ns.jobs, [verbose] * ns.jobs))
    else:
        outs = [_run_seeds(seeds, ns.steps, models, ns.backend, ns.device_budgets, verbose)]
    failed = sorted((o for o in outs if o[0] is not None), key=lambda o: o[0])
    if failed:
        seed, msg = failed[0]
        flags = ("" if ns.device_budgets else " --no-device-budgets") + (" --spec" if ns.spec else "")
        cmd = (f"actord simulate --seed {seed} --steps {ns.steps}{flags}"
               + (f" --model {ns.model}" + "".join(f" --lora {x}" for x in ns.lora or []) if ns.model else ""))
        print(f"FAILED: {msg}\nreproduce: {cmd}")
        return 1
    print(f"{ns.seeds} seed(s) x {ns.steps} steps passed in {time.perf_counter() - t0:.1f} s "
          f"(device budgets {'on' if ns.device_budgets else 'off'}, {ns.jobs} job(s))")
    return 0


def _run_seeds(seeds: list[int], steps: int, models: list[tuple[Any, ...]], backend: str, device: bool,
               verbose: bool) -> tuple[int | None, str]:
    """Run seeds in order (seed i on models[i % len(models)]); the first failure stops this
    worker: (seed, message)."""
    log.configure(level="critical")
    from actord.replay.sim import InvariantViolated, simulate

    async def run() -> tuple[int | None, str]:
        for seed in seeds:
            model, loras, *draft = models[seed % len(models)]
            try:
                r = await simulate(seed, steps, model, loras, device=device, draft=draft[0] if draft else None)
            except InvariantViolated as e:
                print(f"FAILED: {e}", file=sys.stderr, flush=True)  # now, not when every worker is done
                return seed, str(e)
            if verbose:
                print(f"seed {seed}: {r.ops} ops, {r.events} events, trace {r.trace_hash}, refusals {r.errors}"
                      + (f", {r.yields} yields" if r.yields else ""), flush=True)
        return None, ""

    return anyio.run(run, backend=backend)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
