"""Each of issue 33's attacks, one at a time, while a victim completes short requests.

A daemon (2 slots, the tiny llama or --model) serves a victim on its socket (4 tokens, one
request every 0.2 s) and a prober on HTTP (/health every 0.2 s, 1 s timeout). After a
quiet phase (the victim's quiet p90), each attack runs for --seconds, then stops, and the
victim runs on until its last five latencies are back under the bound (or 30 s pass).

Printed side by side, never asserted (noisy machines): per attack, the victim's p90 during
it, as a ratio of the quiet p90, against the bound the issue sets (2x, or the quiet p90 +
0.5 s, whichever is larger); the slowest /health answer and how many missed 1 s; the time
back to quiet; what the attacker's requests got (status counts).

Attacks: an ambiguous grammar on /completion; 300 streaming chats that never read; a
/tokenize list of 1,000,000 strings; logit_bias of 1.3M repeated pairs; a schema with an
11,500-string enum; a 10.9 MB tools body; 400 anonymous Responses conversations; deeply
nested JSON on 11 routes; a DNS-rebinding Host; a FIFO in the page folder restored.

Usage: .venv/bin/python bench/abuse.py [--quick] [--model M.gguf] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from actord.frontends.client import Client  # noqa: E402
from actord.testing.daemon import stop_daemon, wait_until_serving  # noqa: E402
import _out  # noqa: E402  (bench/ is on the path: this script's folder)

AMBIGUOUS = 'root ::= e\ne ::= "[" e b | "[" e c\nb ::= "]"\nc ::= "]"\n'
MSGS = [{"role": "user", "content": "hi"}]


def start(model: str, folder: Path, *extra: str) -> tuple[subprocess.Popen, Path, str]:
    sock = folder / "abuse.sock"
    log = open(folder / "abuse.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "actord.cli", "serve", "--model", model, "--slots", "2",
                             "--ctx", "4096", "--batch", "64", "--socket", str(sock), "--page-dir",
                             str(folder / "pages"), "--log-level", "warning", "--http", "127.0.0.1:0", *extra],
                            stdout=log, stderr=log, cwd=str(ROOT))
    wait_until_serving(proc, sock, lambda: (folder / "abuse.log").read_text()[-2000:])
    with Client(str(sock), timeout=60) as c:
        url = "http://" + c.call("props")["http"]
    return proc, sock, url


class Watch:
    """The victim and the prober, run in threads for the whole bench; each latency stamped."""

    def __init__(self, sock: Path, url: str) -> None:
        self.sock, self.url = sock, url
        self.victim: list[tuple[float, float]] = []  # (start, seconds)
        self.health: list[tuple[float, float, bool]] = []  # (start, seconds, answered within 1 s)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._victim, daemon=True),
                        threading.Thread(target=self._probe, daemon=True)]
        for t in self.threads:
            t.start()

    def _victim(self) -> None:
        with Client(str(self.sock), timeout=600) as c:
            i = 0
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    c.call("completion", {"prompt": [1, 2, 3, 4 + i % 50], "n_predict": 4, "ignore_eos": True})
                except Exception:
                    pass
                dt = time.monotonic() - t0
                self.victim.append((t0, dt))
                i += 1
                time.sleep(max(0.0, 0.2 - dt))

    def _probe(self) -> None:
        with httpx.Client(timeout=1.0) as h:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = h.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                dt = time.monotonic() - t0
                self.health.append((t0, dt, ok and dt <= 1.0))
                time.sleep(max(0.0, 0.2 - dt))

    def victim_between(self, a: float, b: float) -> list[float]:
        return [dt for t, dt in self.victim if a <= t < b]

    def health_between(self, a: float, b: float) -> list[tuple[float, bool]]:
        return [(dt, ok) for t, dt, ok in self.health if a <= t < b]


def p90(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


# -- the attacks: each loops until `stop`, counting what its requests got ---------------------


def _loop(stop: threading.Event, counts: collections.Counter, send: Callable[[httpx.Client], int],
          workers: int = 1) -> None:
    def one() -> None:
        with httpx.Client(timeout=120) as h:
            while not stop.is_set():
                try:
                    counts[str(send(h))] += 1
                except httpx.HTTPError as e:
                    counts[type(e).__name__] += 1

    ts = [threading.Thread(target=one, daemon=True) for _ in range(workers)]
    for t in ts:
        t.start()
    stop.wait()
    for t in ts:
        t.join(130)


def grammar(url: str, **_: Any) -> Callable[..., None]:
    body = {"prompt": "x", "n_predict": 24, "grammar": AMBIGUOUS}
    return lambda stop, counts: _loop(stop, counts, lambda h: h.post(url + "/completion", json=body).status_code, 2)


def no_readers(url: str, quick: bool = False, **_: Any) -> Callable[..., None]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "m", "messages": MSGS, "max_tokens": 3000, "stream": True}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")

    def run(stop: threading.Event, counts: collections.Counter) -> None:
        held = []
        for _ in range(300):
            try:
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect((host, int(port)))
                s.sendall(head + body)
                held.append(s)
                counts["opened"] += 1
            except OSError as e:
                counts[type(e).__name__] += 1
        stop.wait()
        for s in held:
            s.close()

    return run


def tokenize_list(url: str, **_: Any) -> Callable[..., None]:
    body = json.dumps({"content": ["a"] * 1_000_000}).encode()
    return lambda stop, counts: _loop(stop, counts, lambda h: h.post(url + "/tokenize", content=body).status_code)


def logit_bias(url: str, **_: Any) -> Callable[..., None]:
    body = json.dumps({"prompt": "x", "n_predict": 4, "logit_bias": [[5, 1.0]] * 1_300_000}).encode()
    return lambda stop, counts: _loop(stop, counts, lambda h: h.post(url + "/completion", content=body).status_code)


def enum_schema(url: str, **_: Any) -> Callable[..., None]:
    schema = {"type": "string", "enum": [f"value-{i}" for i in range(11_500)]}
    body = json.dumps({"model": "m", "messages": MSGS, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).encode()
    return lambda stop, counts: _loop(stop, counts,
                                      lambda h: h.post(url + "/v1/chat/completions", content=body).status_code)


def tools_body(url: str, **_: Any) -> Callable[..., None]:
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 1000,
                                               "parameters": {"type": "object", "properties": {}}}}
             for i in range(10_000)]
    body = json.dumps({"model": "m", "messages": MSGS, "max_tokens": 4, "tools": tools}).encode()
    return lambda stop, counts: _loop(stop, counts,
                                      lambda h: h.post(url + "/v1/chat/completions", content=body).status_code)


def anonymous(url: str, **_: Any) -> Callable[..., None]:
    n = iter(range(10**9))

    def send(h: httpx.Client) -> int:
        i = next(n)
        return h.post(url + "/v1/responses", json={"model": "m", "input": f"conversation {i}: hello",
                                                    "max_output_tokens": 4}).status_code

    return lambda stop, counts: _loop(stop, counts, send)


ROUTES = ["/v1/chat/completions", "/chat/completions", "/v1/completions", "/completion", "/completions",
          "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/embeddings", "/tokenize", "/apply-template"]


def deep_json(url: str, **_: Any) -> Callable[..., None]:
    body = b'{"model": "m", "x": ' + b"[" * 60_000 + b"]" * 60_000 + b"}"
    it = iter(range(10**9))
    return lambda stop, counts: _loop(
        stop, counts, lambda h: h.post(url + ROUTES[next(it) % len(ROUTES)], content=body).status_code)


def rebinding(url: str, **_: Any) -> Callable[..., None]:
    return lambda stop, counts: _loop(
        stop, counts, lambda h: h.get(url + "/dashboard/state", headers={"host": "evil.example"}).status_code)


def fifo(url: str, sock: Path, folder: Path, **_: Any) -> Callable[..., None]:
    pages = folder / "pages"
    pages.mkdir(exist_ok=True)
    name = pages / "trap.page"
    if not name.exists():
        os.mkfifo(name)

    def run(stop: threading.Event, counts: collections.Counter) -> None:
        with Client(str(sock), timeout=30) as c:
            while not stop.is_set():
                try:
                    c.call("slot.restore", {"slot": 1, "file": "trap.page"})
                    counts["ok"] += 1
                except Exception as e:
                    counts[getattr(e, "type", type(e).__name__)] += 1
                time.sleep(0.1)

    return run


ATTACKS = {"grammar": grammar, "no_readers": no_readers, "tokenize_list": tokenize_list, "logit_bias": logit_bias,
           "enum_schema": enum_schema, "tools_body": tools_body, "anonymous": anonymous, "deep_json": deep_json,
           "rebinding": rebinding, "fifo": fifo}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--quick", action="store_true", help="4 s quiet, 5 s per attack")
    ap.add_argument("--seconds", type=float, default=20.0, help="each attack's length")
    ap.add_argument("--only", default="", help="comma-separated attack names")
    ap.add_argument("--daemon-arg", action="append", default=[])
    args = ap.parse_args()
    quiet_s, attack_s = (4.0, 5.0) if args.quick else (10.0, args.seconds)
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="actord-abuse-") as tmp:
        folder = Path(tmp)
        if args.model:
            model = args.model
        else:
            from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama

            model = str(write_tiny_llama(folder / "tiny.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE))
        proc, sock, url = start(model, folder, *args.daemon_arg)
        try:
            w = Watch(sock, url)
            t0 = time.monotonic()
            time.sleep(quiet_s)
            quiet = p90(w.victim_between(t0 + 1.0, time.monotonic()))  # the first second warms up
            bound = max(2 * quiet, quiet + 0.5)
            print(f"victim quiet p90 {quiet * 1e3:.0f} ms; bound {bound * 1e3:.0f} ms", flush=True)
            for name in names:
                stop, counts = threading.Event(), collections.Counter()
                attack = ATTACKS[name](url=url, sock=sock, folder=folder, quick=args.quick)
                th = threading.Thread(target=attack, args=(stop, counts), daemon=True)
                a = time.monotonic()
                th.start()
                time.sleep(attack_s)
                stop.set()
                b = time.monotonic()
                th.join(180)
                back = float("nan")
                while time.monotonic() - b < 30:
                    time.sleep(0.2)
                    last = [dt for t, dt in w.victim if t >= b][-5:]
                    if len(last) == 5 and max(last) <= bound:
                        back = time.monotonic() - b
                        break
                during = p90(w.victim_between(a, b))
                health = w.health_between(a, time.monotonic())
                row = {"attack": name, "victim_p90_ms": round(during * 1e3, 1), "ratio": round(during / quiet, 2),
                       "within_bound": during <= bound, "health_max_ms": round(max(d for d, _ in health) * 1e3, 1),
                       "health_missed_1s": sum(1 for _, ok in health if not ok),
                       "back_to_quiet_s": round(back, 1), "answers": dict(counts)}
                rows.append(row)
                print(f"{name:14} victim p90 {row['victim_p90_ms']:8.0f} ms  x{row['ratio']:<6} "
                      f"{'ok ' if row['within_bound'] else 'OVER'}  health max {row['health_max_ms']:6.0f} ms "
                      f"missed {row['health_missed_1s']:2}  back in {row['back_to_quiet_s']} s  {dict(counts)}",
                      flush=True)
            w.stop.set()
            alive = proc.poll() is None
            print(f"daemon alive after all attacks: {alive}")
            _out.write("abuse", quiet_p90_ms=round(quiet * 1e3, 1), bound_ms=round(bound * 1e3, 1), rows=rows,
                       model=Path(model).name, quick=args.quick)
        finally:
            stop_daemon(proc)


if __name__ == "__main__":
    main()
