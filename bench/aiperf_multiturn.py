"""NVIDIA AIPerf itself against `actord serve`: its multi-turn profile, side by side over the
ways a session reaches a mind.

Why: bench/multiturn.py drives AIPerf's shape through an embedded daemon; this runs the tool
users run (`aiperf profile`, installed from PyPI in a venv of its own) against the HTTP front,
so what it reports (its TTFT, its view of /metrics) is what a user would see. Workload (issue
32): S sessions x T turns, C at a time, a P-token shared system prompt, U-token user turns, R
output tokens (`ignore_eos`), each turn resending the history, over K slots. Rows, each a
fresh daemon:

  - `unnamed`: AIPerf's default requests, which name no mind: the prompt cache finds each
    session's state by its last prompt (policy/prompt_cache.py);
  - `unnamed-no-cache`: the same with `--prompt-cache-minds 0`;
  - `named-by-header`: `--http-mind-headers X-Correlation-ID`, the session id AIPerf sends,
    makes each session a mind.

Each prints AIPerf's mean TTFT of first and of later turns, its mean request latency, and the
prompt tokens the daemon processed (its own counter) against the floor: the shared prompt
once, each session's first turn past it, each later turn's new tokens (from AIPerf's records:
a turn's prompt less the previous turn's prompt and answer). The shared prompt's length is
the common prefix of two sessions' first prompts as the daemon renders and tokenizes them.

AIPerf counts tokens with a Hugging Face tokenizer, and none is installed for a GGUF model
with no network: one is written from the model's own vocabulary (SentencePiece-BPE models,
Gemma's included; token for token the same as libllama's on Gemma 3 270M), or pass
`--tokenizer DIR`. Needs `aiperf` (`pip install aiperf` in a venv of its own: its pins are
not ours): `--aiperf PATH`, else found on PATH; without it the script says so and exits 2.

    .venv/bin/python bench/aiperf_multiturn.py --aiperf /tmp/aiperf-venv/bin/aiperf   # ~6 min
    .venv/bin/python bench/aiperf_multiturn.py --aiperf ... --sessions 8 --turns 3     # quicker
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _out  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ROWS = [
    ("unnamed", []),
    ("unnamed-no-cache", ["--prompt-cache-minds", "0"]),
    ("named-by-header", ["--http-mind-headers", "X-Correlation-ID"]),
]


def hf_tokenizer(gguf_path: str, out: Path) -> Path:
    """A Hugging Face tokenizer.json for a SentencePiece-BPE GGUF vocabulary: its tokens as
    the BPE vocabulary, and as merges every split of a token into two tokens, ranked by the
    merged token's score (SentencePiece's BPE merges the best-scored pair first)."""
    import gguf

    fields = gguf.GGUFReader(gguf_path).fields

    def strings(key: str) -> list[str]:
        f = fields[key]
        return [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]

    def numbers(key: str) -> list[float]:
        f = fields[key]
        return [float(f.parts[i][0]) for i in f.data]

    kind = bytes(fields["tokenizer.ggml.model"].parts[-1]).decode()
    if kind != "llama":
        raise SystemExit(f"{gguf_path}: a {kind!r} vocabulary; pass --tokenizer with a Hugging Face tokenizer")
    toks, scores = strings("tokenizer.ggml.tokens"), numbers("tokenizer.ggml.scores")
    types = [int(x) for x in numbers("tokenizer.ggml.token_type")]
    vocab: dict[str, int] = {}
    for i, t in enumerate(toks):
        vocab.setdefault(t, i)
    merges = []
    for i, t in enumerate(toks):
        if types[i] != 1:  # normal tokens only: control, byte and user-defined ones are not merged into
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                merges.append((-scores[i], vocab[a], vocab[b], a, b))
    merges.sort()
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": toks[int(numbers("tokenizer.ggml.unknown_token_id")[0])]
                  if "tokenizer.ggml.unknown_token_id" in fields else "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": [[m[3], m[4]] for m in merges]},
    }
    (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read().decode()
    return raw if url.endswith("/metrics") else json.loads(raw)


def _metric(base: str, name: str) -> float:
    for line in _get(base + "/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


@contextlib.contextmanager
def serving(model: str, slots: int, ctx: int, flags: list[str], tmp: Path) -> Iterator[str]:
    port = _free_port()
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(
        [str(ROOT / ".venv/bin/actord"), "serve", "-m", model, "--slots", str(slots), "--ctx", str(ctx),
         "--http", f"127.0.0.1:{port}", "--socket", str(tmp / "sock"), "--page-dir", str(tmp / "pages"), *flags],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"actord serve exited {proc.returncode}: see {tmp / 'serve.log'}")
            try:
                if _get(base + "/health").get("status") == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def shared_len(base: str, first_turns: list[list[dict[str, Any]]]) -> int:
    """The tokens two sessions' first prompts share, as the daemon renders and tokenizes them."""
    toks = [_get(base + "/tokenize", {"content": _get(base + "/apply-template", {"messages": m})["prompt"],
                                      "add_special": True})["tokens"] for m in first_turns[:2]]
    n = 0
    while n < min(map(len, toks)) and toks[0][n] == toks[1][n]:
        n += 1
    return n


def floor_of(records: list[dict[str, Any]], shared: int) -> int:
    by_session: dict[str, list[tuple[int, int, int]]] = {}
    for r in records:
        md, m = r["metadata"], r["metrics"]
        by_session.setdefault(md["conversation_id"], []).append(
            (md["turn_index"], m["usage_prompt_tokens"]["value"], m["usage_completion_tokens"]["value"]))
    floor = shared
    for turns in by_session.values():
        turns.sort()
        floor += turns[0][1] - shared
        for (_, p0, c0), (_, p1, _) in zip(turns, turns[1:]):
            floor += p1 - p0 - c0 + 1  # the last answer token no KV holds yet, as bench/multiturn.py counts it
    return floor


def run_row(name: str, flags: list[str], a: argparse.Namespace, tok: Path, work: Path) -> dict[str, Any]:
    tmp = work / name
    tmp.mkdir(parents=True)
    with serving(a.model, a.slots, a.ctx, flags, tmp) as base:
        model_id = _get(base + "/v1/models")["data"][0]["id"]
        cmd = [a.aiperf, "profile", "-m", model_id, "--url", base, "--endpoint-type", "chat", "--streaming",
               "--tokenizer", str(tok), "--conversation-num", str(a.sessions),
               "--session-turns-mean", str(a.turns), "--session-turns-stddev", "0",
               "--concurrency", str(a.concurrency), "--shared-system-prompt-length", str(a.system),
               "--isl", str(a.user), "--isl-stddev", "0", "--osl", str(a.out), "--osl-stddev", "0",
               "--extra-inputs", "ignore_eos:true", "--random-seed", "7",
               "--output-artifact-dir", str(tmp / "aiperf"), "--ui-type", "none"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, stdout=open(tmp / "aiperf.log", "w"), stderr=subprocess.STDOUT, timeout=a.timeout)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"aiperf failed ({done.returncode}): see {tmp / 'aiperf.log'}")
        art = tmp / "aiperf"
        records = [json.loads(x) for x in (art / "profile_export.jsonl").read_text().splitlines() if x.strip()]
        inputs = json.loads((art / "inputs.json").read_text())["data"]
        shared = shared_len(base, [s["payloads"][0]["messages"] for s in inputs])
        processed = _metric(base, "prompt_tokens_processed_total")
    errors = sum(1 for r in records if r.get("error"))
    ttft = {True: [], False: []}
    for r in records:
        if "time_to_first_token" in r["metrics"]:
            ttft[r["metadata"]["turn_index"] == 0].append(r["metrics"]["time_to_first_token"]["value"])
    summary = json.loads((art / "profile_export_aiperf.json").read_text())
    resets = sum(1 for line in (tmp / "aiperf.log").read_text().splitlines() if "counter reset" in line)
    floor = floor_of(records, shared)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"row": name, "requests": len(records), "errors": errors, "shared": shared,
            "processed": processed, "floor": floor, "x_floor": processed / floor,
            "first_ttft_ms": mean(ttft[True]), "later_ttft_ms": mean(ttft[False]),
            "latency_ms": summary["request_latency"]["avg"], "wall_s": wall, "counter_resets": resets}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=shutil.which("aiperf"), help="the aiperf executable (default: on PATH)")
    p.add_argument("--model", default=None, help="a GGUF model (default: Gemma 3 270M from its package)")
    p.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer folder (default: from the model)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--system", type=int, default=1000, help="shared system prompt tokens")
    p.add_argument("--user", type=int, default=64, help="user turn tokens")
    p.add_argument("--out", type=int, default=32, help="output tokens per turn")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--rows", default=",".join(r[0] for r in ROWS), help="which rows, comma-separated")
    p.add_argument("--timeout", type=int, default=900, help="seconds per aiperf run")
    a = p.parse_args()
    if not a.aiperf or not os.access(a.aiperf, os.X_OK):
        print("aiperf not found: install it in a venv of its own (python -m venv V && V/bin/pip install aiperf) "
              "and pass --aiperf V/bin/aiperf", file=sys.stderr)
        return 2
    if a.model is None:
        from actord.vocabulary.models import gemma3_270m_path

        g = gemma3_270m_path()
        if g is None:
            print("no model: pass --model (Gemma 3 270M's package is not installed)", file=sys.stderr)
            return 2
        a.model = str(g)
    wanted = [r.strip() for r in a.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="actord-aiperf-") as t:
        work = Path(t)
        tok = Path(a.tokenizer) if a.tokenizer else hf_tokenizer(a.model, work / "tokenizer")
        print(f"{Path(a.model).name}: {a.sessions} sessions x {a.turns} turns, {a.concurrency} at a time, "
              f"{a.system}-token shared prompt, {a.user}-token turns, {a.out} out, {a.slots} slots", flush=True)
        rows = []
        for name, flags in ROWS:
            if name in wanted:
                rows.append(run_row(name, flags, a, tok, work))
                r = rows[-1]
                print(f"  {name:<16} processed {r['processed']:>7.0f} / floor {r['floor']:>6} = "
                      f"{r['x_floor']:.2f}x  TTFT first {r['first_ttft_ms'] / 1e3:.2f} s, later "
                      f"{r['later_ttft_ms'] / 1e3:.2f} s ({r['first_ttft_ms'] / r['later_ttft_ms']:.2f})  "
                      f"latency {r['latency_ms'] / 1e3:.2f} s  wall {r['wall_s']:.0f} s  "
                      f"errors {r['errors']}  counter resets {r['counter_resets']}", flush=True)
    by = {r["row"]: r for r in rows}
    if "unnamed" in by and "unnamed-no-cache" in by:
        on, off = by["unnamed"], by["unnamed-no-cache"]
        print(f"prompt cache on / off: processed {on['processed'] / off['processed']:.2f}, later-turn TTFT "
              f"{on['later_ttft_ms'] / off['later_ttft_ms']:.2f}, latency {on['latency_ms'] / off['latency_ms']:.2f}")
    _out.write("aiperf_multiturn", rows=rows, model=Path(a.model).name, sessions=a.sessions, turns=a.turns,
               concurrency=a.concurrency, system=a.system, user=a.user, out=a.out, slots=a.slots)
    return 1 if any(r["errors"] or r["counter_resets"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
