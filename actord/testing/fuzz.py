"""A JSON-RPC fuzzer for the daemon: inputs from the method table, a checker, a pipelined driver.

Shared by the suite's hypothesis test (a few seconds) and `bench/fuzz.py` (a million
inputs). Inputs are built from what the daemon itself declares: every method of
`actord.frontends.rpc.methods.METHODS`, its params Struct read with `msgspec.inspect`, each field
given either a value of its type (edge values weighted up: 0, -1, 2^31, 2^63, 2^64, huge,
empty, NUL, `..`, `/dev/zero`, deep `d/d/d`, lone surrogates, 1e999) or any JSON at all.
Around them: envelopes with wrong ids and versions, batches, notifications, byte-level
mutations of valid lines, deep nesting, random bytes, lines over the limit.

The checker holds every answer to the specification: one JSON value per line; a response
has `jsonrpc: "2.0"`, an id, and exactly one of result and error; an error has an integer
code, a message and a `data.type` naming its type, never InternalError ("untyped"). The
driver sends rounds of lines on several connections, each round closed by a `health`
sentinel; a tracked request (one with a unique id) not answered within the timeout is a
hang.
"""

from __future__ import annotations

import collections
import random
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actord.frontends.rpc.methods import METHODS

# Verbs whose success is the daemon stopping (the `stop` verb, issue 34): a fuzzer that sends
# them finds nothing but its own end.
STOPS = frozenset({"stop"})

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()

EDGE_INTS = [0, 1, -1, 2, 3, 7, 2**31 - 1, 2**31, -2**31, 2**32, 2**63 - 1, -2**63, 2**64, 10**30, -10**30]
EDGE_FLOATS: list[Any] = [0.0, 0.5, 1.0, -1.0, 1e-300, 1e308, msgspec.Raw(b"1e999"), msgspec.Raw(b"-1e999"),
                          msgspec.Raw(b"1E400"), 2.5]
EDGE_STRS: list[Any] = [
    "", "a", "m", "ada", "x.page", "d/x.page", "../x", "../../etc/passwd", "/etc/passwd", "/etc/shadow",
    "/dev/zero", "/dev/urandom", "/dev/null", "/proc/self/environ", "/tmp", ".", "..", "./a", "~root",
    ".actord.lock", ".actord-stage-x", "a\x00b", "\x00", "a b", "é", "日本", "\u202e", "d/" * 40 + "x",
    "x" * 300, "-x", "+@_.",
    msgspec.Raw(b'"\\ud800"'), msgspec.Raw(b'"a\\udfffb"'), msgspec.Raw(b'"\\u0000"'),
]


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


class Fuzzer:
    """Seeded input generator (deterministic for a seed)."""

    def __init__(self, seed: int = 0, *, max_line: int = 1 << 16, allow_slow: bool = True) -> None:
        self.rng = random.Random(seed)
        self.max_line = max_line
        self.allow_slow = allow_slow  # valid completions that really run
        self.methods = [m for m in METHODS if m not in STOPS]
        self.info = {m: msgspec.inspect.type_info(METHODS[m].params) for m in self.methods}
        self.next_id = 1

    # -- values ----------------------------------------------------------------------

    def any_json(self, depth: int = 0) -> Any:
        r = self.rng
        k = r.randrange(9 if depth < 3 else 6)
        if k == 0:
            return None
        if k == 1:
            return r.random() < 0.5
        if k == 2:
            return r.choice(EDGE_INTS)
        if k == 3:
            return r.choice(EDGE_FLOATS)
        if k in (4, 5):
            return r.choice(EDGE_STRS)
        if k in (6, 7):
            return [self.any_json(depth + 1) for _ in range(r.randrange(4))]
        return {r.choice(["a", "id", "slot", "prompt", "", "x" * 5]): self.any_json(depth + 1) for _ in range(r.randrange(3))}

    def value(self, t: Any, depth: int = 0) -> Any:
        r = self.rng
        if r.random() < 0.08:
            return self.any_json(depth)
        I = msgspec.inspect
        if isinstance(t, I.IntType):
            return r.choice(EDGE_INTS) if r.random() < 0.3 else r.randrange(0, 5)
        if isinstance(t, I.FloatType):
            return r.choice(EDGE_FLOATS) if r.random() < 0.4 else r.random()
        if isinstance(t, I.StrType):
            if r.random() < 0.5:
                return r.choice(EDGE_STRS)
            return "".join(r.choice("abcxyz/._-0") for _ in range(r.randrange(1, 12)))
        if isinstance(t, I.BoolType):
            return r.random() < 0.5
        if isinstance(t, I.NoneType):
            return None
        if isinstance(t, I.UnionType):
            return self.value(r.choice(t.types), depth)
        if isinstance(t, I.ListType):
            n = r.choice([0, 1, 2, 3, 5, 8, 40]) if depth < 3 else r.randrange(3)
            return [self.value(t.item_type, depth + 1) for _ in range(n)]
        if isinstance(t, I.StructType):
            return self.params(t, depth + 1)
        return self.any_json(depth)

    def params(self, ti: Any, depth: int = 0) -> dict[str, Any]:
        r = self.rng
        out: dict[str, Any] = {}
        for f in ti.fields:
            if r.random() < (0.93 if f.required else 0.4):
                out[f.name] = self.value(f.type, depth)
        if r.random() < 0.04:
            out[r.choice(["extra", "promt", "id"])] = self.any_json(depth + 1)
        return out

    def completion(self) -> dict[str, Any]:
        """A completion likely to be valid, so the engine path is fuzzed too (short)."""
        r = self.rng
        p: dict[str, Any] = {"prompt": r.choice(["hi", "a b c", [1, 2, 3], [5] * r.randrange(1, 20)]),
                             "n_predict": r.randrange(0, 6), "ignore_eos": r.random() < 0.5}
        if r.random() < 0.3:
            p["stream"] = True
        if r.random() < 0.3:
            p["stop"] = [r.choice(["a", "\n", "é", "zz"]) for _ in range(r.randrange(1, 4))]
        if r.random() < 0.3:
            p["slot"] = r.randrange(0, 3)
        elif r.random() < 0.3:
            p["mind"] = r.choice(["ada", "bob", "cy", "d.e"])
        if r.random() < 0.2:
            p["temperature"], p["seed"] = r.random(), r.randrange(100)
        return p

    # -- envelopes ---------------------------------------------------------------------

    def request(self) -> tuple[dict[str, Any], int | None]:
        """A request object, and its id when that id is unique (so its answer is tracked)."""
        r = self.rng
        method = r.choice(self.methods)
        if method == "completion" and self.allow_slow and r.random() < 0.5:
            params: Any = self.completion()
        else:
            params = self.params(self.info[method])
        obj: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
        tracked: int | None = None
        k = r.random()
        if k < 0.75:
            tracked = self.next_id
            self.next_id += 1
            obj["id"] = tracked if r.random() < 0.8 else f"s{tracked}"
        elif k < 0.85:
            pass  # a notification
        else:
            obj["id"] = r.choice([None, True, False, 1.5, {}, [], "x", -1, 2**64, msgspec.Raw(b"1e999")])
        if r.random() < 0.03:
            del obj["params"]
        return obj, tracked

    def envelope_mutation(self) -> dict[str, Any]:
        r = self.rng
        obj, _ = self.request()
        obj.pop("id", None)
        obj["id"] = None
        m = r.randrange(6)
        if m == 0:
            obj["jsonrpc"] = r.choice(["1.0", "2", 2.0, None, ""])
        elif m == 1:
            del obj["jsonrpc"]
        elif m == 2:
            obj["method"] = r.choice([1, None, [], "", "rpc.x", "no.such", "completion ", "COMPLETION"])
        elif m == 3:
            del obj["method"]
        elif m == 4:
            obj["params"] = r.choice([1, "x", None, True, [], [1], [{}]])
        else:
            obj = r.choice([[], {}, 1, "x", None, [[]]])  # type: ignore[assignment]
        return obj

    def line(self) -> tuple[bytes, list[Any]]:
        """One input line (no trailing newline) and the ids whose answers are tracked."""
        r = self.rng
        k = r.random()
        if k < 0.55:
            obj, t = self.request()
            line = _enc.encode(obj)
            if _SURROGATE.search(line):  # msgspec reads a lone surrogate as malformed JSON: answered with id null
                t = None
            return line, [t] if t is not None else []
        if k < 0.65:
            return _enc.encode(self.envelope_mutation()), []
        if k < 0.75:
            items, tracked = [], []
            for _ in range(r.randrange(0, 6)):
                if r.random() < 0.8:
                    o, t = self.request()
                    items.append(o)
                    if t is not None:
                        tracked.append(t)
                else:
                    items.append(self.any_json())
            return _enc.encode(items), []  # batch answers come as one array: tracked by the sentinel
        if k < 0.90:
            obj, _ = self.request()
            return self.mutate(_enc.encode(obj)), []
        if k < 0.95:
            depth = r.choice([10, 100, 1000, 5000, 20000, 60000])
            opener, closer = r.choice([(b"[", b"]"), (b'{"a":', b"}"),
                                       (b'{"jsonrpc":"2.0","id":1,"method":"health","params":{"a":', b"}}")])
            body = opener * depth + (closer * depth if r.random() < 0.5 else b"")
            return body[: self.max_line], []
        if k < 0.999:
            return bytes(r.randrange(256) for _ in range(r.randrange(0, 64))).replace(b"\n", b" "), []
        return b'{"jsonrpc":"2.0","id":1,"method":"health","params":{"pad":"' + b"x" * (self.max_line + 10) + b'"}}', []

    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        b = bytearray(data)
        for _ in range(r.randrange(1, 4)):
            op = r.randrange(4)
            if not b:
                break
            i = r.randrange(len(b))
            if op == 0:
                b[i] = r.randrange(256)
            elif op == 1:
                b.insert(i, r.choice(b'{}[]",:0\\\x00\xff'))
            elif op == 2:
                del b[i]
            else:
                del b[i:]
        return bytes(b).replace(b"\n", b" ")


# ---- checking answers ------------------------------------------------------------------


def problems_in(line: bytes, kinds: Any = None) -> tuple[list[str], list[Any]]:
    """What is wrong with one line the daemon sent (empty if nothing), and the ids it answers.

    `kinds` (a Counter), when given, counts each answer: "result", "chunk" or the error type."""
    try:
        msg = _dec.decode(line)
    except msgspec.DecodeError:
        return [f"not JSON: {line[:120]!r}"], []
    items = msg if isinstance(msg, list) else [msg]
    if isinstance(msg, list) and not msg:
        return ["empty batch response"], []
    out: list[str] = []
    ids: list[Any] = []
    for m in items:
        if not isinstance(m, dict) or m.get("jsonrpc") != "2.0":
            out.append(f"not a JSON-RPC 2.0 message: {str(m)[:120]}")
            continue
        if "method" in m:
            if kinds is not None:
                kinds["chunk"] += 1
            if isinstance(msg, list) or "id" in m:
                out.append("a notification inside a batch or with an id")
            continue
        if "id" not in m or (("result" in m) == ("error" in m)):
            out.append(f"malformed response: {str(m)[:160]}")
            continue
        rid = m["id"]
        if kinds is not None:
            err = m.get("error")
            kinds[(err.get("data") or {}).get("type", "?") if isinstance(err, dict) else "result"] += 1
        if not (rid is None or isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool))):
            out.append(f"invalid id echoed: {rid!r}")
        ids.append(rid)
        if "error" in m:
            e = m["error"]
            data = e.get("data") if isinstance(e, dict) else None
            typ = data.get("type") if isinstance(data, dict) else None
            if not isinstance(e, dict) or not isinstance(e.get("code"), int) or not isinstance(e.get("message"), str):
                out.append(f"malformed error: {str(e)[:160]}")
            elif not isinstance(typ, str) or typ == "InternalError":
                out.append(f"untyped error: {str(e)[:200]}")
    return out, ids


# ---- the driver ------------------------------------------------------------------------


@dataclass
class Report:
    inputs: int = 0
    answers: int = 0
    hangs: int = 0
    disconnects: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def rate(self) -> float:
        return self.inputs / self.seconds if self.seconds else 0.0


class Conn:
    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.buf = b""

    def open(self) -> None:
        self.close()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)
        self.buf = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def lines(self) -> Any:
        assert self.sock is not None
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                line, self.buf = self.buf[:nl], self.buf[nl + 1:]
                yield line
                continue
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            self.buf += chunk


def run_round(conn: Conn, fz: Fuzzer, n: int, report: Report, sentinel: str) -> None:
    """Send `n` fuzz lines and a sentinel; read until the sentinel and every tracked id are answered."""
    lines, want = [], set()
    for _ in range(n):
        line, tracked = fz.line()
        lines.append(line)
        want.update(tracked)
    payload = b"\n".join(lines) + b"\n" + _enc.encode({"jsonrpc": "2.0", "id": sentinel, "method": "health"}) + b"\n"
    assert conn.sock is not None
    report.inputs += n
    t0 = time.monotonic()
    try:
        conn.sock.sendall(payload)
        seen_sentinel = False
        it = conn.lines()
        while not seen_sentinel or want:
            if time.monotonic() - t0 > conn.timeout:
                raise TimeoutError
            line = next(it)
            report.answers += 1
            probs, ids = problems_in(line, report.kinds)
            report.problems.extend(probs)
            for rid in ids:
                if rid == sentinel:
                    seen_sentinel = True
                elif isinstance(rid, str) and rid.startswith("s") and rid[1:].isdigit():
                    want.discard(int(rid[1:]))
                else:
                    want.discard(rid)
    except (TimeoutError, socket.timeout):
        report.hangs += 1
        report.problems.append(f"hang: {len(want)} tracked ids unanswered after {conn.timeout} s"
                               + ("" if seen_sentinel else ", sentinel unanswered"))
        conn.open()
    except (ConnectionError, OSError) as e:
        report.disconnects += 1
        report.problems.append(f"disconnected: {e!r}")
        conn.open()
