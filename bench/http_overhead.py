"""Tokens/s through the OpenAI-compatible HTTP front vs the Unix socket, same work, one run.

Why: the HTTP front (Starlette + uvicorn in the daemon's event loop) must cost (almost)
nothing per token next to the JSON-RPC socket, streamed (one SSE event per token) or not.

One `actord serve --http 127.0.0.1:0` subprocess serves both. Each repetition runs the same
work three ways, interleaved so load from other work on a shared machine hits all alike:
- socket: `completion` over the Unix socket (AsyncClient), token-list prompt;
- http: POST /v1/completions (httpx), the same token-list prompt, not streamed;
- socket-stream: `completion` with "stream": true, every chunk notification read;
- http-stream: /v1/completions with "stream": true, every SSE event read.
`--concurrency` requests run at once (one per slot), greedy, same n_predict; every slot is
erased before each mode, so each prefills the whole prompt. tok/s = completion tokens
(from the answers' usage) / wall time as the client sees it. Ratios are paired: each
repetition's own ratio, then the median over `--reps` (on a shared machine the load moves
between repetitions far more than within one).

Target (reported, never asserted): http/socket and http-stream/socket >= 0.95.

Usage: .venv/bin/python bench/http_overhead.py [--model M.gguf | --tiny] [--n-predict 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import httpx  # noqa: E402

from actord.frontends.client import AsyncClient, Client  # noqa: E402


def start(model: str, slots: int, threads: int, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    sock = tmp / "actord.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "actord.cli", "serve", "--model", model, "--slots", str(slots), "--ctx", "4096",
         "--batch", "256", "--threads", str(threads), "--socket", str(sock), "--page-dir", str(tmp / "pages"),
         "--http", "127.0.0.1:0", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
    )
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-2000:])
        try:
            with Client(str(sock), timeout=5) as c:
                return proc, str(sock), "http://" + c.call("props")["http"]
        except OSError:
            time.sleep(0.1)
    raise TimeoutError("daemon did not start")


async def erase(sock: str, slots: int) -> None:
    async with AsyncClient(sock) as c:
        for i in range(slots):
            await c.call("slot.erase", {"slot": i})


async def run_socket(sock: str, prompt: list[int], n: int, conc: int, stream: bool) -> int:
    total = 0

    async def one() -> None:
        nonlocal total
        async with AsyncClient(sock) as c:
            r = await c.call("completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "stream": stream},
                             on_chunk=(lambda ch: None) if stream else None)
            total += len(r["tokens"])

    async with anyio.create_task_group() as tg:
        for _ in range(conc):
            tg.start_soon(one)
    return total


async def run_http(http: httpx.AsyncClient, prompt: list[int], n: int, conc: int, stream: bool) -> int:
    total = 0
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}

    async def one() -> None:
        nonlocal total
        if not stream:
            r = await http.post("/v1/completions", json=body)
            r.raise_for_status()
            total += r.json()["usage"]["completion_tokens"]
            return
        async with http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if ev.get("usage"):
                        total += ev["usage"]["completion_tokens"]

    async with anyio.create_task_group() as tg:
        for _ in range(conc):
            tg.start_soon(one)
    return total


async def bench(args: argparse.Namespace, sock: str, url: str) -> dict[str, list[float]]:
    # A token-list prompt, so both fronts send identical work (ids valid in any vocab >= 512).
    prompt = [300 + (7 * i) % 200 for i in range(args.prompt_tokens)]
    rates: dict[str, list[float]] = {"socket": [], "http": [], "socket-stream": [], "http-stream": []}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await run_http(http, prompt, 4, args.concurrency, False)  # warm-up: connections, caches
        for rep in range(args.reps):
            for mode in rates:
                await erase(sock, args.slots)
                t0 = time.perf_counter()
                if mode.startswith("socket"):
                    n = await run_socket(sock, prompt, args.n_predict, args.concurrency, mode == "socket-stream")
                else:
                    n = await run_http(http, prompt, args.n_predict, args.concurrency, mode == "http-stream")
                rates[mode].append(n / (time.perf_counter() - t0))
            print(f"rep {rep + 1}: " + "  ".join(f"{m} {v[-1]:.1f} tok/s" for m, v in rates.items()), flush=True)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--tiny", action="store_true", help="a generated tiny model (fast: overhead shows most)")
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="actord-http-bench-") as tmp:
        if args.tiny:
            from actord.testing.models import write_tiny_llama

            model = str(write_tiny_llama(Path(tmp) / "tiny.gguf", seed=1, n_embd=256, n_layer=4, n_ff=512))
        else:
            from actord.vocabulary.models import default_model

            model = args.model or str(default_model())
        proc, sock, url = start(model, args.slots, args.threads, Path(tmp))
        try:
            rates = anyio.run(bench, args, sock, url)
        finally:
            proc.terminate()
            proc.wait(30)
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(f"\nmodel {Path(model).name}, {args.concurrency} concurrent x {args.n_predict} tokens, "
          f"prompt {args.prompt_tokens} tokens, median of {args.reps}:")
    for m, v in med.items():
        print(f"  {m:14s} {v:8.1f} tok/s")
    print("ratios: median over repetitions of each repetition's own ratio (paired, so load that")
    print("changes between repetitions cancels out):")
    for m, base in (("http", "socket"), ("http-stream", "socket-stream"), ("http-stream", "socket")):
        ratio = statistics.median(a / b for a, b in zip(rates[m], rates[base]))
        print(f"  {m}/{base} = {ratio:.3f}  (target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})")

if __name__ == "__main__":
    main()
