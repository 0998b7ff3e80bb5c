"""Generation latency while other clients flood the daemon with control calls (issue 19.3).

A control flood: `--connections` connections, each keeping `--in-flight` calls of one
method in flight (a new call the moment an answer comes back): `page.in` (asks the
scheduler for KV room, MakeRoom, then the slot), `slot.list` (asks every slot) or
`gene.list` (asks the residency and the engine thread). Beside it, another client runs
`--n` completions of `--n-predict` tokens on slot 0, one after the other, and the latency
of each is recorded, before the flood (alone) and during it.

Reported, never asserted: median and max latency alone and under the flood, and how many
control calls were answered (by outcome).

Usage: .venv/bin/python bench/control_flood.py [--model M.gguf | --tiny] [--method page.in]
       [--connections 8] [--in-flight 60] [--n 10] [--n-predict 8]
"""

from __future__ import annotations

import argparse
import collections
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

from actord.frontends.client import Client  # noqa: E402
from actord.testing.daemon import stop_daemon, wait_until_serving  # noqa: E402


def start_daemon(model: str, folder: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    sock = folder / "flood.sock"
    log = open(folder / "flood.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "actord.cli", "serve", "--model", model, "--slots", "2",
                             "--ctx", "4096", "--batch", "64", "--threads", "1", "--socket", str(sock),
                             "--page-dir", str(folder / "pages"), "--log-level", "warning", *extra],
                            stdout=log, stderr=log, cwd=str(ROOT))
    wait_until_serving(proc, sock, lambda: (folder / "flood.log").read_text()[-2000:])
    return proc, sock


async def flood(sock: Path, method: str, params: dict, in_flight: int, stop: anyio.Event,
                counts: collections.Counter) -> None:
    stream = await anyio.connect_unix(str(sock))
    async with stream:
        buf = b""
        sent = 0

        async def send(n: int) -> None:
            nonlocal sent
            lines = b"".join(json.dumps({"jsonrpc": "2.0", "id": sent + i, "method": method,
                                         "params": params}).encode() + b"\n" for i in range(n))
            sent += n
            await stream.send(lines)

        await send(in_flight)
        while not stop.is_set():
            try:
                with anyio.fail_after(120):
                    chunk = await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, TimeoutError):
                counts["connection_lost"] += 1
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                counts[msg["error"]["data"]["type"] if "error" in msg else "ok"] += 1
            if lines and not stop.is_set():
                await send(len(lines))


def latencies(sock: Path, n: int, n_predict: int) -> list[float]:
    out = []
    with Client(str(sock), timeout=600) as c:
        for i in range(n):
            t0 = time.perf_counter()
            r = c.call("completion", {"prompt": [1, 2, 3, 4 + i % 50], "n_predict": n_predict, "slot": 0,
                                      "ignore_eos": True})
            out.append(time.perf_counter() - t0)
            assert len(r["tokens"]) == n_predict
    return out


def prepare(sock: Path, method: str) -> tuple[dict, list[str]]:
    extra: list[str] = []
    with Client(str(sock), timeout=60) as c:
        if method == "page.in":
            # A page held in RAM and a slot that holds a sequence: every page.in asks the
            # scheduler for room (MakeRoom), then is refused by the slot (SlotBusy).
            c.call("completion", {"prompt": [1] + list(range(5, 300)), "n_predict": 1, "slot": 1})
            c.call("page.out", {"slot": 1, "page": "p"})
            c.call("completion", {"prompt": [1, 9, 9, 9], "n_predict": 1, "slot": 1})
            return {"slot": 1, "page": "p"}, extra
    return {}, extra


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--method", default="page.in", choices=["page.in", "slot.list", "gene.list"])
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=60)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--n-predict", type=int, default=8)
    ap.add_argument("--daemon-arg", action="append", default=[])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="actord-flood-") as tmp:
        folder = Path(tmp)
        if args.tiny or not args.model:
            from actord.testing.models import write_tiny_llama

            model = str(write_tiny_llama(folder / "tiny.gguf", seed=1))
        else:
            model = args.model
        proc, sock = start_daemon(model, folder, *args.daemon_arg)
        try:
            params, _ = prepare(sock, args.method)
            alone = latencies(sock, args.n, args.n_predict)
            counts: collections.Counter = collections.Counter()
            under: list[float] = []

            async def run() -> None:
                stop = anyio.Event()
                async with anyio.create_task_group() as tg:
                    for _ in range(args.connections):
                        tg.start_soon(flood, sock, args.method, params, args.in_flight, stop, counts)
                    await anyio.sleep(1.0)  # the flood is on
                    under.extend(await anyio.to_thread.run_sync(latencies, sock, args.n, args.n_predict))
                    stop.set()
                    tg.cancel_scope.cancel()

            t0 = time.perf_counter()
            anyio.run(run)
            wall = time.perf_counter() - t0
            print(json.dumps({
                "method": args.method, "connections": args.connections, "in_flight": args.in_flight,
                "n_predict": args.n_predict,
                "alone_ms": {"median": round(statistics.median(alone) * 1e3, 1), "max": round(max(alone) * 1e3, 1)},
                "flood_ms": {"median": round(statistics.median(under) * 1e3, 1), "max": round(max(under) * 1e3, 1)},
                "control_answers": dict(counts), "control_per_s": round(sum(counts.values()) / wall, 1),
            }, indent=1))
        finally:
            stop_daemon(proc)


if __name__ == "__main__":
    main()
