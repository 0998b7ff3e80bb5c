"""Trace recording: every delivery, engine result, worker completion and external input.

A trace is JSON lines (msgspec), streamable and versioned: a header, then events in the
order the system saw them, then a footer with the final state. Messages are not stored in
full (a page is megabytes): each carries a canonical digest, built by walking the Struct
and feeding a BLAKE2b hash, skipping timing fields (`t_*`, `*_ms`) that no two runs
share. External inputs are stored whole, since replay re-executes them. A running hash
over all events identifies the whole trace.

Recording is a dispatcher hook: with none installed it costs nothing, and a hook that
fails is removed and logged instead of crashing the run. The recorder is the service's own
instrument (it records what enters the façade and every delivery), so it lives here; the
replay package (actord/replay/) reads traces and runs them again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, IO

import msgspec

# 3: `Loop` events (the in-handler loop's input); a version 2 trace ran without that loop.
VERSION = 3

# Folders whose paths are not behaviour (the model's folder, the page folder): a path under
# one is written relative to it, so two runs in two temp folders, or on two machines, hash
# the same. Set by the recorder from its config.
_ROOTS: list[tuple[str, str]] = []


def set_roots(roots: dict[str, str]) -> None:
    _ROOTS[:] = sorted(((str(Path(k)).rstrip("/") + "/", v + "/") for k, v in roots.items() if k),
                       key=lambda kv: -len(kv[0]))


def rebase(obj: Any, prefixes: list[tuple[str, str]]) -> Any:
    """`obj` (builtins) with every string starting with an old prefix moved to the new one."""
    if isinstance(obj, str):
        for old, new in prefixes:
            if obj.startswith(old):
                return new + obj[len(old):]
        return obj
    if isinstance(obj, list):
        return [rebase(x, prefixes) for x in obj]
    if isinstance(obj, dict):
        return {k: rebase(v, prefixes) for k, v in obj.items()}
    return obj


def canonical(obj: Any) -> Any:
    """`obj` with paths under a known folder written relative to it (`<model-dir>/x.gguf`)."""
    return rebase(obj, _ROOTS)


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, msgspec.Struct):
        h.update(type(obj).__name__.encode())
        for name in obj.__struct_fields__:
            if name.startswith("t_") or name.endswith("_ms"):
                continue
            h.update(name.encode())
            _feed(h, getattr(obj, name))
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        mv = memoryview(obj).cast("B")
        h.update(b"b%d:" % mv.nbytes)
        h.update(mv)
    elif isinstance(obj, (list, tuple)):
        h.update(b"l%d[" % len(obj))
        for x in obj:
            _feed(h, x)
        h.update(b"]")
    elif isinstance(obj, dict):
        h.update(b"d%d{" % len(obj))
        for k in sorted(obj, key=repr):
            _feed(h, k)
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, BaseException):
        # The type and the names of its fields: values may hold absolute paths or timings.
        h.update(b"E" + type(obj).__name__.encode())
        data = getattr(obj, "data", None)
        if isinstance(data, dict):
            _feed(h, sorted(data))
    elif isinstance(obj, str) and _ROOTS:
        h.update(repr(canonical(obj)).encode())
    else:
        h.update(repr(obj).encode())


def digest(obj: Any) -> str:
    h = hashlib.blake2b(digest_size=12)
    _feed(h, obj)
    return h.hexdigest()


class Event(msgspec.Struct, tag=True, frozen=True):
    pass


class Header(Event):
    version: int
    config: dict[str, Any]
    seed: int | None = None


class Input(Event):
    method: str
    params: Any
    # The tenant the front vouched for (service/tenancy.py), where one did: a page verb acts
    # in that tenant's scope, so a replay must ask as the same tenant.
    tenant: str | None = None


class Deliver(Event):
    actor: str
    msg: str
    digest: str


class EngineDone(Event):
    job: str
    digest: str
    result: str
    # Its place in the engine thread's execution order (-1: not known). The order results
    # reach their waiters is not the order jobs ran (a step's result waits while the next
    # runs; a between-steps job overtakes queued ones), and what runs first decides where a
    # sequence's cells land: a replay runs jobs in this order (scheduler.EngineOrder).
    n: int = -1


class WorkerDone(Event):
    op: str
    result: str


class Loop(Event):
    """Inside its handler, `actor` asked whether mail waited for it (Dispatcher.go_on):
    `mail` is the answer the run's timing gave, the one a replay gives back."""

    actor: str
    mail: bool


class Footer(Event):
    state: str
    events: int
    hash: str


AnyEvent = Header | Input | Deliver | EngineDone | WorkerDone | Loop | Footer
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(AnyEvent)


def to_event(kind: str, f: dict[str, Any]) -> Event:
    if kind == "engine":
        return EngineDone(job=type(f["job"]).__name__, digest=digest(f["job"]),
                          result=digest(f["error"] if f["error"] is not None else f["value"]), n=f.get("n", -1))
    if kind == "worker":
        return WorkerDone(op=f["op"], result=digest(f["error"] if f["error"] is not None else f["value"]))
    if kind == "input":
        return Input(method=f["method"], params=canonical(msgspec.to_builtins(f["params"])), tenant=f.get("tenant"))
    if kind == "loop":
        return Loop(actor=f["actor"], mail=f["mail"])
    raise ValueError(kind)


def deliver_event(actor: Any, env: Any) -> Deliver:
    return Deliver(actor=actor.name, msg=type(env.msg).__name__, digest=digest(env.msg))


class TraceRecorder:
    """Writes events as they happen (to a path or any binary file) and hashes them."""

    def __init__(self, sink: str | Path | IO[bytes] | list, config: Any, seed: int | None = None) -> None:
        self._own = isinstance(sink, (str, Path))
        # Unbuffered: a daemon that dies mid-run leaves a trace whole up to its last event.
        self.out: Any = open(sink, "wb", buffering=0) if self._own else sink
        self.hash = hashlib.blake2b(digest_size=16)
        self.n = 0
        self.events: list[Event] | None = sink if isinstance(sink, list) else None
        cfg = msgspec.to_builtins(config)
        model = Path(cfg.get("model", ""))
        # Where files live is not behaviour: two runs in two temp folders are the same run.
        set_roots({str(model.parent) if model.name else "": "<model-dir>", cfg.get("page_dir", ""): "<page-dir>"})
        for k in ("page_dir", "socket", "trace", "metrics_http"):
            cfg.pop(k, None)
        cfg["model"] = model.name
        cfg["model_digest"] = _file_digest(model)  # what the model is, not where it lives
        cfg = canonical(cfg)
        self._write(Header(version=VERSION, config=cfg, seed=seed))

    def _write(self, ev: Event) -> None:
        line = _enc.encode(ev)
        self.hash.update(line)
        self.n += 1
        if self.events is not None:
            self.events.append(ev)
        else:
            self.out.write(line + b"\n")

    def attach(self, dispatcher: Any) -> None:
        dispatcher.hooks.append(lambda actor, env: self._write(deliver_event(actor, env)))
        dispatcher.event_hooks.append(lambda kind, f: self._write(to_event(kind, f)))

    def close(self, final_state: Any) -> str:
        footer = Footer(state=digest(final_state), events=self.n, hash=self.hash.hexdigest())
        self._write(footer)
        if self._own:
            self.out.close()
        elif self.events is None:
            self.out.flush()
        return footer.hash


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=12)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return ""
    return h.hexdigest()


def read_trace(path: str | Path) -> list[Event]:
    with open(path, "rb") as f:
        return [_dec.decode(line) for line in f if line.strip()]


def attach_recorder(trace: Any, config: Any, dispatcher: Any) -> TraceRecorder | None:
    """A recorder for `trace` (a path, or a list to append events to) attached to
    `dispatcher`; None when no trace is asked for (then recording costs nothing)."""
    if trace is None or trace == "":
        return None
    recorder = TraceRecorder(trace, config)
    recorder.attach(dispatcher)
    return recorder
