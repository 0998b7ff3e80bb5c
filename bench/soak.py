"""A soak: a mixed socket + HTTP workload with floods and page moves, for N minutes.

One `actord serve --http 127.0.0.1:0` daemon (its own process) and, at once:
- socket clients running completions addressed by slot, by mind and by nobody;
- HTTP clients on /v1/chat/completions (a `user` each, so minds) and /v1/completions;
- a page mover: page.out / page.in / page.spill (with drop) / page.drop / slot.erase;
- a gene client: gene.load / page_out / page_in / list of a generated LoRA;
- floods, in bursts: connections each keeping 60 calls of one method in flight
  (page.in, slot.list, gene.list), a few seconds on, a few off;
- a probe: an 8-token completion every half second, its latency filed under "flood" or
  "quiet" by whether a burst was on when it started;
- a varied HTTP client (`varied_*` outcomes): prompt sizes from a word to a few KB, stop strings,
  tools (required and auto), structured output (json_object and json_schema), n > 1, the
  Responses API with stored responses (continued by previous_response_id, retrieved,
  deleted), and hang-ups mid-stream (a stream read for two chunks, then the connection cut).

Every request has a client-side bound (`--hang-s`): one that passes it counts as a hang.
Every answer is an outcome: "ok" or its error type (untyped ones: "untyped:<...>"). Every
--sample-s (10; 2 with --attacks) the daemon's RSS and open fds are sampled. The summary (JSON, at the end) has
requests, errors by type, hangs, the probe's latency percentiles quiet vs flood, RSS and
fds over time, and whether the daemon's log holds a traceback or a crashed actor.

The daemon's bounded caches (chat turn memory, stored responses) are given bounds small
enough to fill within the warm-up, so that growth after it is a leak, not a cache filling.
The verdict: the RSS slope after warm-up (least squares over the samples after minute
`--warmup-min`, MB/min) against `--max-slope`, plus hangs, untyped errors, tracebacks and
crashed actors; any of them past its bound ends the run with exit status 1 and a FAILED
line naming it. Each slope is printed with its standard error (the samples' scatter about
the line): a slope within a few of these of the bound says nothing either way.

With `--attacks` the slope is the floor's: the least squares line through the lowest sample
of each `--floor-s` (60 s) after warm-up, sampled every 2 s. Why: the attacks' bodies of up
to 13 MB (/tokenize, logit_bias, tools) raise RSS by up to 190 MB, and it stays up until
the next malloc_trim (every --memory-report-s, 15 s): the samples of two 12-minute runs
swung 115-320 MB, and their slopes (-1.14 and +2.54 MB/min) had errors of 3.1 and 1.1,
so the 0.3 bound passed or failed by where samples fell. A leak raises the floor with
everything else; a transient raises some samples of a minute, not its lowest. The floor
still wanders by about 10 MB with the heap's state over one round of the attacks (about
2 minutes), so at 12 minutes its slope's error is 1-3 MB/min too: a leak of 0.3 MB/min is
told apart only by a longer run (the error falls as the minutes after warm-up to the
power 1.5: a 40-minute run measured 0.38 +- 0.15 MB/min). The samples
(each with the attack on as it was taken) and the summary go to bench/out/soak.json (or
`--json`), the daemon's log beside it (soak.log).
`--only socket|http|genes|pages` runs one part of the workload (with the probe), to
attribute growth to it. `--attacks` mixes in bench/abuse.py's attacks (issue 33), one at a
time, `--attack-s` on and as long off; their answers are filed under attack_NAME.

Usage: .venv/bin/python bench/soak.py --minutes 12 [--warmup-min 5] [--max-slope 0.3] [--only http]
(--sample-s sets the RSS/fd sampling period; bench/report.py plots RSS and fds from bench/out/soak.json.)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from actord.frontends.client import Client  # noqa: E402
from actord.vocabulary.errors import ActordError  # noqa: E402


class Soak:
    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.args = args
        self.folder = folder
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.hangs: collections.Counter = collections.Counter()
        self.flooding = threading.Event()
        self.probe = {"quiet": [], "flood": []}
        self.samples: list[dict[str, Any]] = []
        self.attack_now: str | None = None  # the attack on now (--attacks), filed with each RSS sample
        self.t0 = time.monotonic()

    # -- the daemon ----------------------------------------------------------------------

    def start(self) -> None:
        from actord.testing.models import HERMES_TOOL_TEMPLATE, write_tiny_llama, write_tiny_lora

        if self.args.model:
            model = self.args.model
            self.lora = None
        else:
            # A Hermes-style template: chats with tools render and parse (<tool_call> markers).
            model = str(write_tiny_llama(self.folder / "tiny.gguf", seed=1, chat_template=HERMES_TOOL_TEMPLATE,
                                         control_tokens=("<tool_call>", "</tool_call>")))
            self.lora = str(write_tiny_lora(self.folder / "lora.gguf", model, seed=5))
        self.sock = self.folder / "soak.sock"
        self.log_path = self.folder / "soak.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actord.cli", "serve", "--model", model, "--slots", "2", "--ctx", "4096",
             "--batch", "64", "--threads", "1", "--socket", str(self.sock), "--page-dir", str(self.folder / "pages"),
             "--page-ram-bytes", "600000", "--http", "127.0.0.1:0", "--log-level", "info",
             # The bounded caches small enough to fill within the warm-up: past it, growth is a leak.
             "--chat-memory-tokens", "131072", "--http-responses-max", "256", "--http-responses-max-bytes", "1000000",
             *self.args.daemon_arg],
            stdout=log, stderr=log, cwd=str(ROOT))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            if self.sock.exists():
                try:
                    with Client(str(self.sock), timeout=5) as c:
                        self.http = "http://" + c.call("props")["http"]
                    return
                except OSError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(self.log_path.read_text()[-3000:])
            time.sleep(0.05)
        raise TimeoutError("daemon did not come up")

    def finish(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    # -- bookkeeping ---------------------------------------------------------------------

    def record(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.outcomes[kind][outcome] += 1

    def call(self, c: Client, kind: str, method: str, params: Any) -> Any:
        try:
            out = c.call(method, params)
        except ActordError as e:
            self.record(kind, e.type if type(e).__name__ != "RpcError" else f"untyped:{e.message[:40]}")
            return None
        except (TimeoutError, OSError) as e:
            if isinstance(e, TimeoutError) or "timed out" in str(e):
                self.hangs[kind] += 1
                self.record(kind, "hang")
                raise
            self.record(kind, f"socket:{type(e).__name__}")
            raise
        self.record(kind, "ok")
        return out

    def client(self) -> Client:
        return Client(str(self.sock), timeout=self.args.hang_s)

    def loop(self, kind: str, body: Any) -> None:
        r = random.Random(hash(kind) & 0xFFFF)
        while not self.stop.is_set():
            try:
                with self.client() as c:
                    while not self.stop.is_set():
                        body(c, r)
            except (TimeoutError, OSError):
                time.sleep(0.2)  # a new connection

    # -- the workload --------------------------------------------------------------------

    def socket_completions(self, c: Client, r: random.Random) -> None:
        where = r.choice([{"slot": r.randrange(2)}, {"mind": f"s{r.randrange(4)}"}, {}])
        prompt = [1] + [r.randrange(3, 500) for _ in range(r.randint(4, 200))]
        self.call(c, "completion", "completion", {"prompt": prompt, "n_predict": r.choice([8, 16, 32]),
                                                  "ignore_eos": True, **where})

    def http_loop(self, kind: str) -> None:
        r = random.Random(hash(kind) & 0xFFFF)
        convos: dict[str, list[dict[str, str]]] = {}
        with httpx.Client(base_url=self.http, timeout=self.args.hang_s) as h:
            while not self.stop.is_set():
                try:
                    if r.random() < 0.6:
                        user = f"h{r.randrange(4)}"
                        msgs = convos.setdefault(user, [])
                        if len(msgs) > 12:
                            msgs.clear()
                        msgs.append({"role": "user", "content": " ".join(r.choice("the a cache mind page"
                                                                                  .split()) for _ in range(8))})
                        resp = h.post("/v1/chat/completions", json={"model": "x", "messages": msgs, "user": user,
                                                                     "max_tokens": 16, "stream": r.random() < 0.3})
                        if resp.status_code == 200 and not resp.headers.get("content-type", "").startswith(
                                "text/event-stream"):
                            msgs.append(resp.json()["choices"][0]["message"])
                        elif resp.status_code == 200:
                            msgs.clear()
                        kind2 = "http_chat"
                    else:
                        resp = h.post("/v1/completions", json={"model": "x", "prompt": "hello " * r.randint(1, 50),
                                                               "max_tokens": 16})
                        kind2 = "http_completion"
                    err = None
                    if resp.status_code != 200:
                        try:
                            err = resp.json()["error"].get("type") or str(resp.status_code)
                        except Exception:  # noqa: BLE001
                            err = f"untyped:{resp.status_code}"
                    self.record(kind2, "ok" if err is None else f"{resp.status_code}:{err}")
                except httpx.TimeoutException:
                    self.hangs[kind] += 1
                    self.record(kind, "hang")
                except httpx.HTTPError as e:
                    self.record(kind, f"http:{type(e).__name__}")
                    time.sleep(0.2)

    def varied_loop(self) -> None:
        r = random.Random(11)
        stored: list[str] = []
        with httpx.Client(base_url=self.http, timeout=self.args.hang_s) as h:
            while not self.stop.is_set():
                kind = r.choice(["stop", "tools", "json", "n", "responses", "responses", "hangup", "size"])
                try:
                    self._varied(h, r, kind, stored)
                except httpx.TimeoutException:
                    self.hangs["varied_" + kind] += 1
                    self.record("varied_" + kind, "hang")
                except httpx.HTTPError as e:
                    self.record("varied_" + kind, f"http:{type(e).__name__}")
                    time.sleep(0.2)

    def _http_outcome(self, kind: str, resp: httpx.Response) -> Any:
        if resp.status_code in (200, 204):
            self.record(kind, "ok")
            return resp.json() if resp.status_code == 200 else None
        try:
            err = resp.json()["error"].get("type") or str(resp.status_code)
        except Exception:  # noqa: BLE001
            err = f"untyped:{resp.status_code}"
        self.record(kind, f"{resp.status_code}:{err}")
        return None

    def _varied(self, h: httpx.Client, r: random.Random, kind: str, stored: list[str]) -> None:
        words = "the a cache mind page weather city json list".split()
        text = " ".join(r.choice(words) for _ in range(r.choice([1, 8, 60, 400])))
        user = r.choice([None, f"v{r.randrange(3)}"])
        base: dict[str, Any] = {"model": "x", "messages": [{"role": "user", "content": text}], "max_tokens": 12,
                                **({"user": user} if user else {})}
        k = "varied_" + kind
        if kind == "stop":
            base["stop"] = r.sample(words, r.randint(1, 4))
        elif kind == "tools":
            base["tools"] = [{"type": "function", "function": {"name": f"f{i}", "description": "a tool", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
                for i in range(r.randint(1, 3))]
            base["tool_choice"] = r.choice(["auto", "required"])
            base["max_tokens"] = 40
        elif kind == "json":
            base["response_format"] = r.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"]}}}])
            base["max_tokens"] = 24
        elif kind == "n":
            base["n"] = r.randint(2, 3)
            base["temperature"] = 0.8
        elif kind == "responses":
            op = r.random()
            if stored and op < 0.15:
                self._http_outcome(k, h.get(f"/v1/responses/{r.choice(stored)}"))
                return
            if stored and op < 0.25:
                rid = stored.pop(r.randrange(len(stored)))
                resp = h.delete(f"/v1/responses/{rid}")
                self.record(k, "ok" if resp.status_code in (200, 404) else f"{resp.status_code}")
                return
            body: dict[str, Any] = {"model": "x", "input": text, "max_output_tokens": 8, "store": r.random() < 0.8}
            if stored and r.random() < 0.5:
                body["previous_response_id"] = r.choice(stored)
            out = self._http_outcome(k, h.post("/v1/responses", json=body))
            if out is not None and body["store"]:
                stored.append(out["id"])
                del stored[:-64]
            return
        elif kind == "hangup":
            base["stream"] = True
            base["max_tokens"] = 64
            with h.stream("POST", "/v1/chat/completions", json=base) as resp:
                for i, _ in enumerate(resp.iter_lines()):
                    if i >= 2:
                        break
            self.record(k, "ok" if resp.status_code == 200 else f"{resp.status_code}")
            return
        self._http_outcome(k, h.post("/v1/chat/completions", json=base))

    def page_mover(self, c: Client, r: random.Random) -> None:
        slot, page = r.randrange(2), f"pg{r.randrange(3)}"
        op = r.choice(["out", "out", "in", "in", "spill", "drop", "erase"])
        if op == "out":
            self.call(c, "page_move", "page.out", {"slot": slot, "page": page})
        elif op == "in":
            self.call(c, "page_move", "page.in", {"slot": slot, "page": page})
        elif op == "spill":
            self.call(c, "page_move", "page.spill", {"page": page, "file": f"{page}.page", "drop": r.random() < 0.5})
        elif op == "drop":
            self.call(c, "page_move", "page.drop", {"page": page})
        else:
            self.call(c, "page_move", "slot.erase", {"slot": slot})
        time.sleep(0.05)

    def genes(self, c: Client, r: random.Random) -> None:
        if self.lora is None:
            self.stop.wait(1)
            return
        listed = self.call(c, "gene", "gene.list", {}) or []
        if len(listed) < 2 and r.random() < 0.3:
            self.call(c, "gene", "gene.load", {"path": self.lora})
        elif listed:
            g = r.choice(listed)["id"]
            op = r.choice(["gene.page_out", "gene.page_in", "gene.page_in"])
            self.call(c, "gene", op, {"id": g})
            if r.random() < 0.3:
                self.call(c, "gene_completion", "completion", {"prompt": [1, 2, 3], "n_predict": 8, "slot": r.randrange(2),
                                                               "genes": [{"id": g, "scale": 1.0}], "ignore_eos": True})
        time.sleep(0.2)

    def flooder(self) -> None:
        r = random.Random(7)
        while not self.stop.is_set():
            self.stop.wait(r.uniform(4, 10))
            if self.stop.is_set():
                return
            method = r.choice(["page.in", "slot.list", "gene.list"])
            params = {"slot": r.randrange(2), "page": "pg0"} if method == "page.in" else {}
            self.flooding.set()
            end = time.monotonic() + r.uniform(3, 6)
            threads = [threading.Thread(target=self._flood_one, args=(method, params, end), daemon=True)
                       for _ in range(self.args.flood_connections)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.args.hang_s + 10)
            self.flooding.clear()

    def _flood_one(self, method: str, params: Any, end: float) -> None:
        import socket

        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.args.hang_s)
            s.connect(str(self.sock))
        except OSError as e:
            self.record("flood", f"connect:{type(e).__name__}")
            return
        f = s.makefile("rb")
        line = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode() + b"\n"
        try:
            s.sendall(line * 60)
            out = 60
            while out:
                msg = json.loads(f.readline())
                out -= 1
                self.record("flood", msg["error"]["data"].get("type", "untyped") if "error" in msg else "ok")
                if time.monotonic() < end and not self.stop.is_set():
                    s.sendall(line)
                    out += 1
        except TimeoutError:
            self.hangs["flood"] += 1
            self.record("flood", "hang")
        except (OSError, ValueError) as e:
            self.record("flood", f"socket:{type(e).__name__}")
        finally:
            f.close()
            s.close()

    def attacker(self) -> None:
        """Issue 33's attacks (bench/abuse.py), one after another, each `--attack-s` on and as
        long off: their answers filed under attack_NAME (a 500 is untyped)."""
        import abuse

        names = [n for n in abuse.ATTACKS if n != "no_readers"] + ["no_readers"]
        i = 0
        while not self.stop.is_set():
            name = names[i % len(names)]
            i += 1
            counts: collections.Counter = collections.Counter()
            end = threading.Event()
            run = abuse.ATTACKS[name](url=self.http, sock=self.sock, folder=self.folder, quick=True)
            th = threading.Thread(target=run, args=(end, counts), daemon=True)
            self.attack_now = name
            th.start()
            self.stop.wait(self.args.attack_s)
            end.set()
            th.join(self.args.hang_s)
            self.attack_now = None
            for outcome, n in counts.items():
                key = "untyped:500" if outcome == "500" else ("hang" if outcome == "ReadTimeout" else outcome)
                with self.lock:
                    self.outcomes[f"attack_{name}"][key] += n
            self.stop.wait(self.args.attack_s)

    def prober(self, c: Client, r: random.Random) -> None:
        flood = self.flooding.is_set()
        t0 = time.perf_counter()
        out = self.call(c, "probe", "completion", {"prompt": [1, 2, 3, r.randrange(5, 400)], "n_predict": 8,
                                                   "ignore_eos": True})
        if out is not None:
            self.probe["flood" if flood else "quiet"].append(time.perf_counter() - t0)
        time.sleep(0.5)

    def sampler(self) -> None:
        printed = -1e9
        while not self.stop.is_set():
            try:
                status = Path(f"/proc/{self.proc.pid}/status").read_text()
                rss = next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
                fds = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
                self.samples.append({"t_s": round(time.monotonic() - self.t0, 1), "rss_mb": round(rss, 1), "fds": fds,
                                     **({"attack": self.attack_now} if self.args.attacks else {})})
                if self.samples[-1]["t_s"] - printed >= 10:  # a line per 10 s, however often it samples
                    printed = self.samples[-1]["t_s"]
                    print(f"[{printed:>7.1f} s] rss {rss:7.1f} MB  fds {fds:4d}  requests "
                          f"{sum(sum(c.values()) for c in self.outcomes.values()):>8d}  "
                          f"hangs {sum(self.hangs.values())}", flush=True)
            except (OSError, StopIteration):
                pass
            self.stop.wait(self.args.sample_s)

    # -- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        def t(target: Any, *args: Any) -> threading.Thread:
            return threading.Thread(target=target, args=args, daemon=True)

        parts = {
            "socket": [t(self.loop, "completion", self.socket_completions),
                       t(self.loop, "completion2", self.socket_completions), t(self.flooder)],
            "http": [t(self.http_loop, "http1"), t(self.http_loop, "http2"), t(self.varied_loop)],
            "pages": [t(self.loop, "page_move", self.page_mover)],
            "genes": [t(self.loop, "gene", self.genes)],
        }
        if self.args.attacks:
            parts["attacks"] = [t(self.attacker)]
        only = self.args.only
        workers = [w for name, ws in parts.items() if only is None or name == only for w in ws]
        workers += [t(self.loop, "probe", self.prober), t(self.sampler)]
        for w in workers:
            w.start()
        self.stop.wait(self.args.minutes * 60)
        self.stop.set()
        for w in workers:
            w.join(self.args.hang_s + 30)
        stuck = [w.name for w in workers if w.is_alive()]
        with Client(str(self.sock), timeout=30) as c:
            health = c.call("health")
            metrics = c.call("metrics")["text"]
        log = self.log_path.read_text(errors="replace")

        def pct(xs: list[float], q: float) -> float | None:
            return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 1) if xs else None

        floors = floor(self.samples, self.args.warmup_min, self.args.floor_s)
        total = collections.Counter()
        for c in self.outcomes.values():
            total.update(c)
        errors = {k: v for k, v in total.items() if k != "ok"}
        return {
            "minutes": self.args.minutes,
            "requests": sum(total.values()),
            "ok": total["ok"],
            "errors_by_type": dict(sorted(errors.items(), key=lambda kv: -kv[1])),
            "untyped_errors": sum(v for k, v in errors.items() if k.startswith(("untyped", "500"))),
            "hangs": dict(self.hangs),
            "by_kind": {k: dict(v) for k, v in self.outcomes.items()},
            "probe_8_tokens_ms": {
                mode: {"n": len(xs), "p50": pct(xs, 0.5), "p90": pct(xs, 0.9), "max": pct(xs, 1.0)}
                for mode, xs in self.probe.items()
            },
            "rss_mb": {"first": self.samples[0]["rss_mb"] if self.samples else None,
                       "last": self.samples[-1]["rss_mb"] if self.samples else None,
                       "max": max((s["rss_mb"] for s in self.samples), default=None)},
            "fds": {"first": self.samples[0]["fds"] if self.samples else None,
                    "last": self.samples[-1]["fds"] if self.samples else None,
                    "max": max((s["fds"] for s in self.samples), default=None)},
            "fds_min": min((s["fds"] for s in self.samples), default=None),
            "rss_slope_mb_per_min": slope(self.samples, self.args.warmup_min),
            "rss_slope_error_mb_per_min": slope_error(self.samples, self.args.warmup_min),
            "rss_floor_slope_mb_per_min": slope(floors, self.args.warmup_min),
            "rss_floor_slope_error_mb_per_min": slope_error(floors, self.args.warmup_min),
            "verdict_slope": "rss_floor_slope_mb_per_min" if self.args.attacks else "rss_slope_mb_per_min",
            "warmup_min": self.args.warmup_min,
            "only": self.args.only,
            "samples": self.samples,
            "health": health["status"],
            "stuck_workers": stuck,
            "log": {"tracebacks": log.count("Traceback"), "actor_crashed": log.count("actor.crashed"),
                    "warnings": log.count("[warning"), "errors": log.count("[error")},
            "page_refused_total": next((float(line.split()[-1]) for line in metrics.splitlines()
                                        if line.startswith("page_refused_total ")), None),
        }


def floor(samples: list[dict[str, Any]], warmup_min: float, window_s: float) -> list[dict[str, Any]]:
    """The lowest-RSS sample of each whole `window_s` after `warmup_min` (a window cut short
    by the run's end is left out: fewer samples would make its lowest higher)."""
    after = [s for s in samples if s["t_s"] / 60 >= warmup_min]
    if not after:
        return []
    start, end = after[0]["t_s"], after[-1]["t_s"]
    windows: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for s in after:
        i = int((s["t_s"] - start) // window_s)
        if start + (i + 1) * window_s <= end:
            windows[i].append(s)
    return [min(ws, key=lambda s: s["rss_mb"]) for _, ws in sorted(windows.items())]


def slope(samples: list[dict[str, Any]], warmup_min: float) -> float | None:
    """RSS growth after warm-up: the least-squares line through (minutes, MB) of the
    samples taken after `warmup_min`; None with fewer than 3 of them."""
    fit = _fit(samples, warmup_min)
    return round(fit[0], 4) if fit else None


def slope_error(samples: list[dict[str, Any]], warmup_min: float) -> float | None:
    """The standard error of `slope` (MB/min), from the samples' scatter about its line: a
    slope within a few of these of the bound says nothing either way."""
    fit = _fit(samples, warmup_min)
    return round(fit[1], 4) if fit else None


def _fit(samples: list[dict[str, Any]], warmup_min: float) -> tuple[float, float] | None:
    pts = [(s["t_s"] / 60, s["rss_mb"]) for s in samples if s["t_s"] / 60 >= warmup_min]
    if len(pts) < 3:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if not sxx:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    scatter = sum((y - my - b * (x - mx)) ** 2 for x, y in pts) / (len(pts) - 2)
    return b, (scatter / sxx) ** 0.5


def verdict(summary: dict[str, Any], max_slope: float) -> list[str]:
    """Each bound the run passed, in words (empty: the run is good)."""
    out = []
    which = summary["verdict_slope"]
    s = summary[which]
    what = "RSS's floor" if which == "rss_floor_slope_mb_per_min" else "RSS"
    if s is None:
        out.append(f"too few RSS samples after minute {summary['warmup_min']} for a slope (run longer)")
    elif s > max_slope:
        out.append(f"{what} grows {s:.3f} MB/min after minute {summary['warmup_min']} (bound {max_slope})")
    if sum(summary["hangs"].values()):
        out.append(f"hangs: {summary['hangs']}")
    if summary["untyped_errors"]:
        out.append(f"{summary['untyped_errors']} untyped errors")
    for what in ("tracebacks", "actor_crashed"):
        if summary["log"][what]:
            out.append(f"the daemon's log holds {summary['log'][what]} {what}")
    if summary["stuck_workers"]:
        out.append(f"workers stuck: {summary['stuck_workers']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--model", help="GGUF (default: a generated tiny llama with a chat template and a LoRA)")
    ap.add_argument("--hang-s", type=float, default=120.0, help="a request not answered within this is a hang")
    ap.add_argument("--flood-connections", type=int, default=8)
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "soak.json"),
                    help="write the summary and samples here (default bench/out/soak.json)")
    ap.add_argument("--warmup-min", type=float, default=5.0, help="the slope is fitted to samples after this minute")
    ap.add_argument("--max-slope", type=float, default=0.3, help="MB/min of RSS growth after warm-up that fails the run")
    ap.add_argument("--only", choices=("socket", "http", "genes", "pages"),
                    help="run this part of the workload alone (and the probe)")
    ap.add_argument("--sample-s", type=float, help="seconds between RSS and fd samples (default 10; 2 with --attacks)")
    ap.add_argument("--floor-s", type=float, default=60.0,
                    help="with --attacks, the slope is fitted to the lowest sample of each such window")
    ap.add_argument("--daemon-arg", action="append", default=[], help="one more `actord serve` argument")
    ap.add_argument("--attacks", action="store_true", help="mix in bench/abuse.py's attacks, one at a time")
    ap.add_argument("--attack-s", type=float, default=5.0, help="each attack's length (and the pause after it)")
    args = ap.parse_args()
    if args.sample_s is None:
        args.sample_s = 2.0 if args.attacks else 10.0
    with tempfile.TemporaryDirectory(prefix="actord-soak-") as tmp:
        soak = Soak(args, Path(tmp))
        soak.start()
        try:
            summary = soak.run()
        finally:
            soak.finish()
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(soak.log_path, Path(args.json).with_suffix(".log"))  # the daemon's log, kept
    brief = {k: v for k, v in summary.items() if k != "samples"}
    print(json.dumps(brief, indent=1))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    fds = summary["fds"]
    print(f"RSS slope after minute {args.warmup_min:g}: {summary['rss_slope_mb_per_min']} "
          f"+- {summary['rss_slope_error_mb_per_min']} MB/min, its floor's ({args.floor_s:g} s windows) "
          f"{summary['rss_floor_slope_mb_per_min']} +- {summary['rss_floor_slope_error_mb_per_min']} MB/min "
          f"(the verdict's: "
          f"{summary['verdict_slope']}, bound {args.max_slope}); "
          f"RSS {summary['rss_mb']['first']} -> {summary['rss_mb']['last']} MB; "
          f"fds {summary['fds_min']}-{fds['max']}; samples in {out}")
    failed = verdict(summary, args.max_slope)
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
