"""What a request body costs, bounded before the work it would cost: the JSON's nesting
depth before it is decoded, the decode off the event loop with a time budget, and the
fields whose size is counted in entries rather than bytes (tools, logit_bias) right after.

Why a module of its own (issue 33): each of these was an attack on the front as it stood.
msgspec, like every recursive decoder, recurses once per nesting level, so a body of 100k
`[` ran it past Python's recursion limit: a RecursionError, a 500 and a logged traceback on
11 routes, in OpenAI's shape even on Anthropic's routes. A 13 MB body decoded on the event
loop held /health for seconds. 1.3M `logit_bias` pairs passed the bound because repeated
ids were merged before they were counted, and a 10.9 MB `tools` list was refused only after
4.2 s of conversion and rendering. So:

- depth: `json_too_deep` reads the bytes in vectorized passes, a MiB at a time: escapes
  removed (`\\\\`, then `\\"`), a quote's parity marks what is inside a string, and the
  running depth is a numpy cumulative sum over the brackets outside (16 MB of brackets in
  about 0.1 s, where peeling a level per `bytes.replace` took 4 s and a regex stripping a
  million short strings held the GIL, so the loop, for 1 s), so a body deeper than
  `http_max_json_depth` is a 400 before any decoder sees it; the same pass counts the
  values (commas outside strings) against `http_max_json_values`, a 413 before a decoder
  makes a Python object per value (a million-string /tokenize list, 1.3M logit_bias
  pairs). No decoder's own limit is relied on: msgspec's is the interpreter's recursion
  limit, which a deep schema then hits again in the converter.
- the decode (and the depth scan) of a body over OFFLOAD_BYTES runs on a worker thread,
  at most PARSE_LANES at once, within `http_parse_budget_s`; past it the request is a 413
  naming the body, and the loop has kept serving meanwhile (msgspec holds the GIL, but a
  thread yields it every switch interval, 5 ms).
- bodies in flight: `BodyBytes` counts the bytes of bodies being read, in all and per client
  address; past `http_max_body_bytes_in_flight` (or half of it from one address) a
  body is refused 503 as it arrives, so 128 slow uploads of 16 MB cannot hold 2 GB.
- entries: `check_entries` counts what a decoded request's cost grows with, every entry
  (repeats included) of `logit_bias` and of `tools`, and the tools' encoded bytes, against
  the request limits, before any entry is converted.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import anyio
import msgspec
import numpy as np

from actord.frontends.http.responses import HttpError

OFFLOAD_BYTES = 64 << 10  # smaller bodies decode on the loop: a thread hop costs more than they do
PARSE_LANES = 2  # worker threads decoding at once (a flood of large bodies waits its turn)
MAX_TOOLS = 128  # tools one request may declare

T = TypeVar("T")

_CHUNK = 1 << 20


def json_too_deep(buf: bytes, limit: int, max_values: int = 1 << 62) -> str | None:
    """Why `buf` (JSON text) must not be decoded, or None: it nests deeper than `limit`
    arrays and objects ("depth"), holds more than `max_values` values in its arrays and
    objects ("values": each a Python object the decoder makes, so 1.3M logit_bias pairs
    cost seconds before any field was checked), or its brackets do not balance (it is no
    JSON then, and an unclosed run of them is as deep as it is long). A body too short to
    hold that many values or brackets costs two counts; a larger one a few vectorized
    passes (see the module docstring)."""
    if buf.count(b"[") + buf.count(b"{") <= limit and len(buf) <= 2 * max_values:
        return None  # the common case
    if b"\\" in buf:  # escapes, paired left to right as a lexer reads them: \\ first, then \"
        buf = buf.replace(b"\\\\", b"").replace(b'\\"', b"")
    level = quotes = values = 0
    for i in range(0, len(buf), _CHUNK):  # a chunk at a time: bounded memory, the GIL let go between
        a = np.frombuffer(buf, np.uint8, count=min(_CHUNK, len(buf) - i), offset=i)
        q = np.cumsum(a == 34, dtype=np.int32)
        outside = ((q + quotes) & 1) == 0  # an odd count of quotes before: inside a string
        quotes += int(q[-1])
        values += int(np.count_nonzero((a == 44) & outside))
        if values >= max_values:
            return "values"
        step = ((a == 91) | (a == 123)).astype(np.int8) - ((a == 93) | (a == 125))
        step[~outside] = 0
        run = np.cumsum(step, dtype=np.int32)
        run += level
        if int(run.max()) > limit:
            return "depth"
        if int(run.min()) < 0:
            return "unbalanced"
        level = int(run[-1])
    return "unbalanced" if level else None


def check_depth(buf: bytes, limit: int, max_values: int = 1 << 62) -> None:
    why = json_too_deep(buf, limit, max_values)
    if why == "depth":
        raise HttpError(400, f"malformed JSON: the body nests deeper than {limit} arrays and objects",
                        "invalid_json")
    if why == "values":
        raise HttpError(413, f"the body holds more than {max_values} JSON values (http_max_json_values)",
                        "body_too_large", param="body")
    if why == "unbalanced":
        raise HttpError(400, "malformed JSON: its brackets do not balance", "invalid_json")


async def offload(fn: Callable[..., T], *args: Any, size: int, budget_s: float, field: str,
                  lane: anyio.CapacityLimiter | None = None) -> T:
    """`fn(*args)` for work that grows with `size` bytes of a client's input: small work on
    the loop; larger on a worker thread (holding `lane`, the front's PARSE_LANES) within
    `budget_s`, else a 413 naming `field` (the thread is abandoned: its input is bounded by
    the body limit)."""
    if size <= OFFLOAD_BYTES:
        return fn(*args)
    try:
        with anyio.fail_after(budget_s):
            return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=lane)
    except TimeoutError:
        raise HttpError(413, f"{field} took more than {budget_s:g} s to parse (http_parse_budget_s)",
                        "parse_budget", param=field) from None


def decode(buf: bytes, depth: int, typ: Any = None, max_values: int = 1 << 62) -> Any:
    """`buf` checked for depth and values, then decoded (as `typ`, when given): a 4xx names
    what is wrong."""
    check_depth(buf, depth, max_values)
    try:
        return msgspec.json.decode(buf) if typ is None else msgspec.json.decode(buf, type=typ)
    except msgspec.ValidationError as e:
        raise HttpError(400, f"invalid request: {e}", "invalid_params") from None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"malformed JSON: {e}", "invalid_json") from None
    except RecursionError:  # a type's own nesting past the interpreter's (the depth bound comes first)
        raise HttpError(400, "malformed JSON: it nests too deeply", "invalid_json") from None


class BodyBytes:
    """Bytes of request bodies being read, in all and by client address (see the module
    docstring): `add` raises a 503 past either bound; `release` gives a body's bytes back."""

    def __init__(self, total: int) -> None:
        self.total, self.per_peer = total, max(1, total // 2)
        self.held = 0
        self.by_peer: dict[str, int] = {}

    def add(self, peer: str, n: int) -> None:
        mine = self.by_peer.get(peer, 0)
        if self.held + n > self.total or mine + n > self.per_peer:
            raise HttpError(503, f"request bodies being read hold the front's bound ({self.total} bytes in all, "
                            f"{self.per_peer} per client address: http_max_body_bytes_in_flight); retry later",
                            "Overloaded", param="body")
        self.held += n
        self.by_peer[peer] = mine + n

    def release(self, peer: str, n: int) -> None:
        self.held -= n
        left = self.by_peer.get(peer, 0) - n
        if left > 0:
            self.by_peer[peer] = left
        else:
            self.by_peer.pop(peer, None)


def check_entries(req: Any, max_logit_bias: int, max_tools_bytes: int) -> None:
    """A decoded request's entry counts (the module docstring), by field name, whatever the
    API: `logit_bias` (every entry, repeats included) and `tools` (count and bytes)."""
    bias = _field(req, "logit_bias")
    if isinstance(bias, (list, dict)) and len(bias) > max_logit_bias:
        raise HttpError(400, f"logit_bias has {len(bias)} entries, at most {max_logit_bias}", "invalid_params",
                        param="logit_bias")
    tools = _field(req, "tools")
    if isinstance(tools, list) and tools:
        if len(tools) > MAX_TOOLS:
            raise HttpError(400, f"{len(tools)} tools, at most {MAX_TOOLS}", "invalid_params", param="tools")
        n = len(msgspec.json.encode(tools))
        if n > max_tools_bytes:
            raise HttpError(400, f"tools are {n} bytes of JSON, at most {max_tools_bytes} (they would not fit "
                            "the prompt)", "invalid_params", param="tools")


def _field(req: Any, name: str) -> Any:
    if isinstance(req, dict):
        return req.get(name)
    return getattr(req, name, None)
