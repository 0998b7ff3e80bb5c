"""Each of issue 33's attacks, one at a time, while a victim completes short requests.

A daemon (2 slots, the tiny llama or --model) serves a victim on its socket (4 tokens, one
request every 0.2 s) and a prober on HTTP (/health every 0.2 s, 1 s timeout). After a
quiet phase (the victim's quiet p90), each attack runs for --seconds, then stops, and the
victim runs on until its last five latencies are back under the bound (or 30 s pass).

Printed side by side, per attack: the victim's p90 during it, as a ratio of the quiet p90,
against the bound the issue sets (2x, or the quiet p90 + 0.5 s, whichever is larger); the
slowest /health answer and how many missed 1 s; the time back to quiet; how many of the
victim's requests failed; what the attacker's requests got (status counts). An attack that
misses one of the issue's bounds (victim p90 over the bound, a victim request failed, a
/health answer missing 1 s, not back to quiet within 30 s) is marked FAIL, and the bench
exits 1 after its table: a bound that no run can miss would be no bound.

Attacks: an ambiguous grammar on /completion; 300 streaming chats that never read; a
/tokenize list of 1,000,000 strings; logit_bias of 1.3M repeated pairs; a schema with an
11,500-string enum; a 10.9 MB tools body; 400 anonymous Responses conversations; deeply
nested JSON on 11 routes; a DNS-rebinding Host; a FIFO in the page folder restored; and
`per_key`: one API key's holder flooding past its share (shares.py), from 8 addresses so no
address's own share binds it: generations back to back and streams that read nothing.

`per_address`: one address's load tool, 16 clients at once generating 1,000 tokens back to
back, with no key: alone, its share of generations would hold every slot; the rest wait in
the front's line. It runs beside the socket's victim, and again as `per_address_http` on a
keyless daemon of its own, whose victim completes the same requests over HTTP from its
own address (127.0.0.2). `per_socket` is the same load tool on the socket (16 connections
of one process) beside that HTTP victim.

`per_key` runs on a daemon of its own, started with two keys (VICTIM_KEY, ATTACKER_KEY)
and `--http-max-generations-per-key 1` (below the slot count, as one address's share must
be for the others to keep their pace: at 2 slots, a key holding 2 generations holds every
slot; the default with several keys is now every slot but one, the same here, and the flag
keeps the attack's setting whatever the default), with its own quiet phase; its victim completes the same requests over HTTP, under
its own key and from its own address (127.0.0.2). The other attacks keep a daemon without
a key: the Host check they try (rebinding) is the keyless daemon's, and a key would make
them all a 401 before any work.

Usage: .venv/bin/python bench/abuse.py [--quick] [--model M.gguf] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import socket
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
VICTIM_KEY, ATTACKER_KEY = "abuse-victim-key", "abuse-attacker-key"
KEYED = ("--api-key", f"{VICTIM_KEY},{ATTACKER_KEY}", "--http-max-generations-per-key", "1")
VICTIM_ADDRESS = "127.0.0.2"  # the keyed victim's own address: only its key's share is in question
ATTACKER_ADDRESSES = [f"127.0.1.{i}" for i in range(1, 9)]  # one key, many addresses (a NAT, a fleet)


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


def socket_victim(sock: Path) -> Callable[[int], None]:
    """The victim on the daemon's socket: 4 tokens of a short prompt."""
    c = Client(str(sock), timeout=600)
    return lambda i: c.call("completion", {"prompt": [1, 2, 3, 4 + i % 50], "n_predict": 4, "ignore_eos": True})


def http_victim(url: str, key: str, source: str) -> Callable[[int], None]:
    """The same victim over HTTP (native /completion) under `key` (""; none), from the address `source`."""
    h = httpx.Client(timeout=600, headers={"authorization": f"Bearer {key}"} if key else {},
                     transport=httpx.HTTPTransport(local_address=source))

    def call(i: int) -> None:
        r = h.post(url + "/completion", json={"prompt": [1, 2, 3, 4 + i % 50], "n_predict": 4, "ignore_eos": True})
        r.raise_for_status()

    return call


class Watch:
    """The victim and the prober, run in threads for the whole bench; each latency stamped."""

    def __init__(self, victim: Callable[[int], None], url: str) -> None:
        self.call, self.url = victim, url
        self.victim: list[tuple[float, float]] = []  # (start, seconds)
        self.failed: list[tuple[float, str]] = []  # (start, what the victim's request got)
        self.health: list[tuple[float, float, bool]] = []  # (start, seconds, answered within 1 s)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._victim, daemon=True),
                        threading.Thread(target=self._probe, daemon=True)]
        for t in self.threads:
            t.start()

    def _victim(self) -> None:
        i = 0
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                self.call(i)
            except Exception as e:  # noqa: BLE001 (a refused or failed victim request is a bound missed)
                what = e.response.status_code if isinstance(e, httpx.HTTPStatusError) else getattr(e, "type", None)
                self.failed.append((t0, str(what or type(e).__name__)))
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

    def failed_between(self, a: float, b: float) -> collections.Counter:
        return collections.Counter(what for t, what in self.failed if a <= t < b)


def p90(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


# -- the attacks: each loops until `stop`, counting what its requests got ---------------------


def _loop(stop: threading.Event, counts: collections.Counter, send: Callable[[httpx.Client], int],
          workers: int = 1, clients: Callable[[int], httpx.Client] = lambda i: httpx.Client(timeout=120)) -> None:
    def one(i: int) -> None:
        with clients(i) as h:
            while not stop.is_set():
                try:
                    counts[str(send(h))] += 1
                except httpx.HTTPError as e:
                    counts[type(e).__name__] += 1

    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(workers)]
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


def per_key(url: str, **_: Any) -> Callable[..., None]:
    """One key's flood from 8 addresses: on each, 2 clients generating 64 tokens back to back
    and 4 that open streams of 3,000 tokens and read nothing (each holding at most 8 of
    them, oldest closed first), all under ATTACKER_KEY. Without the key's share the key
    would hold 32 generations (the addresses' shares) on 2 slots."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    auth = {"authorization": f"Bearer {ATTACKER_KEY}"}
    gen = {"prompt": "x", "n_predict": 64, "ignore_eos": True}
    body = json.dumps({"prompt": "x", "n_predict": 3000, "ignore_eos": True, "stream": True}).encode()
    head = (b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + ATTACKER_KEY.encode() + b"\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    n = len(ATTACKER_ADDRESSES)

    def client(i: int) -> httpx.Client:
        return httpx.Client(timeout=120, headers=auth,
                            transport=httpx.HTTPTransport(local_address=ATTACKER_ADDRESSES[i % n]))

    def streams(i: int, stop: threading.Event, counts: collections.Counter) -> None:
        held: collections.deque[socket.socket] = collections.deque()
        while not stop.is_set():
            s = socket.socket()
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.settimeout(10)
                s.bind((ATTACKER_ADDRESSES[i % n], 0))
                s.connect((host, int(port)))
                s.sendall(head + body)
                status = s.recv(12)[9:12].decode(errors="replace") or "closed"
            except OSError as e:
                counts[type(e).__name__] += 1
                s.close()
                stop.wait(0.05)
                continue
            counts["stream_" + status] += 1
            if status == "200":
                held.append(s)  # read no further: its output backs up in the daemon
                if len(held) > 8:
                    held.popleft().close()
            else:
                s.close()
                stop.wait(0.02)
        for s in held:
            s.close()

    def run(stop: threading.Event, counts: collections.Counter) -> None:
        ts = [threading.Thread(target=streams, args=(i, stop, counts), daemon=True) for i in range(4 * n)]
        for t in ts:
            t.start()
        _loop(stop, counts, lambda h: h.post(url + "/completion", json=gen).status_code, 2 * n, client)
        for t in ts:
            t.join(30)

    return run


def per_address(url: str, **_: Any) -> Callable[..., None]:
    """One address's load tool: 16 clients at once, each generating 1,000 tokens back to back
    (a benchmark at concurrency 16, or an agent fleet behind one NAT), with no key. Its
    share of generations (twice the slots by default) holds every slot; the rest wait in
    the front's line."""
    gen = {"prompt": "x", "n_predict": 1000, "ignore_eos": True}

    def client(i: int) -> httpx.Client:
        return httpx.Client(timeout=300, transport=httpx.HTTPTransport(local_address=ATTACKER_ADDRESSES[0]))

    return lambda stop, counts: _loop(stop, counts, lambda h: h.post(url + "/completion", json=gen).status_code,
                                      16, client)


def per_socket(sock: Path, **_: Any) -> Callable[..., None]:
    """One process's load tool on the socket: 16 connections at once, each generating 1,000
    tokens back to back. The socket's process is one client of the shares the HTTP front's
    addresses have (frontends/shares.py): without them its 16 generations all queued for
    the 2 slots, ahead of every other client's."""
    gen = {"prompt": "x", "n_predict": 1000, "ignore_eos": True}

    def run(stop: threading.Event, counts: collections.Counter) -> None:
        def one(i: int) -> None:
            with Client(str(sock), timeout=300) as c:
                while not stop.is_set():
                    try:
                        c.call("completion", gen)
                        counts["ok"] += 1
                    except Exception as e:
                        counts[getattr(e, "type", type(e).__name__)] += 1
                        stop.wait(0.1)

        ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(16)]
        for t in ts:
            t.start()
        stop.wait()
        for t in ts:
            t.join(130)

    return run


ATTACKS = {"grammar": grammar, "no_readers": no_readers, "tokenize_list": tokenize_list, "logit_bias": logit_bias,
           "enum_schema": enum_schema, "tools_body": tools_body, "anonymous": anonymous, "deep_json": deep_json,
           "rebinding": rebinding, "fifo": fifo, "per_key": per_key, "per_address": per_address,
           "per_address_http": per_address, "per_socket": per_socket}
# Where each attack runs (the module's docstring says why): the daemon with two keys and a
# victim on HTTP under its own key, a daemon without a key and a victim on HTTP from its
# own address, else a daemon without a key and a victim on its socket.
ON_KEYED = {"per_key"}
ON_HTTP = {"per_address_http", "per_socket"}
SETTINGS = ("socket", "http", "keyed")


def setting_of(name: str) -> str:
    return "keyed" if name in ON_KEYED else "http" if name in ON_HTTP else "socket"


def phase(model: str, folder: Path, names: list[str], quiet_s: float, attack_s: float, quick: bool,
          daemon_args: list[str], setting: str) -> tuple[float, list[dict[str, Any]], bool]:
    """One daemon, its quiet p90, then each of `names` in turn: (quiet p90, rows, alive after)."""
    folder.mkdir(exist_ok=True)
    keyed = setting == "keyed"
    proc, sock, url = start(model, folder, *(KEYED if keyed else ()), *daemon_args)
    rows = []
    try:
        victim = (socket_victim(sock) if setting == "socket"
                  else http_victim(url, VICTIM_KEY if keyed else "", VICTIM_ADDRESS))
        w = Watch(victim, url)
        t0 = time.monotonic()
        time.sleep(quiet_s)
        quiet = p90(w.victim_between(t0 + 1.0, time.monotonic()))  # the first second warms up
        bound = max(2 * quiet, quiet + 0.5)
        which = {"keyed": "daemon with two API keys, victim on HTTP under its own",
                 "http": "daemon without a key, victim on HTTP from its own address",
                 "socket": "daemon without a key, victim on its socket"}[setting]
        print(f"{which}: victim quiet p90 {quiet * 1e3:.0f} ms; bound {bound * 1e3:.0f} ms", flush=True)
        for name in names:
            stop, counts = threading.Event(), collections.Counter()
            attack = ATTACKS[name](url=url, sock=sock, folder=folder, quick=quick)
            th = threading.Thread(target=attack, args=(stop, counts), daemon=True)
            a = time.monotonic()
            th.start()
            time.sleep(attack_s)
            stop.set()
            b = time.monotonic()
            # Back to quiet is the victim's, timed from the attack's stop, whatever the
            # attack's own requests in flight still take to end (joined after).
            back = float("nan")
            while time.monotonic() - b < 30:
                time.sleep(0.2)
                last = [dt for t, dt in w.victim if t >= b][-5:]
                if len(last) == 5 and max(last) <= bound:
                    back = time.monotonic() - b
                    break
            th.join(180)
            during = p90(w.victim_between(a, b))
            health = w.health_between(a, time.monotonic())
            failed = w.failed_between(a, time.monotonic())
            row = {"attack": name, "setting": setting, "keyed": keyed, "quiet_p90_ms": round(quiet * 1e3, 1),
                   "bound_ms": round(bound * 1e3, 1), "victim_p90_ms": round(during * 1e3, 1),
                   "ratio": round(during / quiet, 2), "within_bound": during <= bound,
                   "health_max_ms": round(max(d for d, _ in health) * 1e3, 1),
                   "health_missed_1s": sum(1 for _, ok in health if not ok),
                   "back_to_quiet_s": round(back, 1), "victim_failed": dict(failed), "answers": dict(counts)}
            row["missed"] = missed(row)
            rows.append(row)
            print(f"{name:14} victim p90 {row['victim_p90_ms']:8.0f} ms  x{row['ratio']:<6} "
                  f"{'ok ' if row['within_bound'] else 'OVER'}  health max {row['health_max_ms']:6.0f} ms "
                  f"missed {row['health_missed_1s']:2}  back in {row['back_to_quiet_s']} s  "
                  f"victim failed {sum(failed.values())}  {'FAIL' if row['missed'] else 'pass'}  {dict(counts)}",
                  flush=True)
        w.stop.set()
        return quiet, rows, proc.poll() is None
    finally:
        stop_daemon(proc)


def missed(row: dict[str, Any]) -> list[str]:
    """The issue's bounds that an attack's row missed, in words (empty: it kept them all)."""
    out = []
    if not row["within_bound"]:
        out.append(f"victim p90 {row['victim_p90_ms']} ms over its bound {row['bound_ms']} ms")
    if row["victim_failed"]:
        out.append(f"victim requests failed: {row['victim_failed']}")
    if row["health_missed_1s"]:
        out.append(f"{row['health_missed_1s']} /health answers missed 1 s")
    if math.isnan(row["back_to_quiet_s"]):
        out.append("not back to quiet within 30 s")
    return out


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
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"no attack named {', '.join(unknown)} (there are {', '.join(ATTACKS)})")
    rows, quiets, alive = [], {}, True
    with tempfile.TemporaryDirectory(prefix="actord-abuse-") as tmp:
        folder = Path(tmp)
        if args.model:
            model = args.model
        else:
            from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama

            model = str(write_tiny_llama(folder / "tiny.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE))
        for setting in SETTINGS:
            mine = [n for n in names if setting_of(n) == setting]
            if mine:
                quiet, got, up = phase(model, folder / setting, mine, quiet_s, attack_s, args.quick,
                                       args.daemon_arg, setting)
                quiets[setting] = round(quiet * 1e3, 1)
                rows += got
                alive = alive and up
    print(f"daemons alive after all attacks: {alive}")
    _out.write("abuse", quiet_p90_ms=quiets, rows=rows, model=Path(model).name, quick=args.quick)
    failed = [f"{r['attack']}: {why}" for r in rows for why in r["missed"]]
    if not alive:
        failed.append("a daemon died under the attacks")
    for line in failed:
        print(f"FAIL {line}", file=sys.stderr)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
