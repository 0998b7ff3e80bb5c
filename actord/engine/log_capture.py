"""libllama's log: dropped in C, kept only while a context is created.

Why a module of its own: libllama logs through one process-wide callback, so whoever sets it
sets it for every context (the target's, the draft's, the embeddings'). Dropped, it never
reaches Python: a Python callback costs a GIL round trip per line, and an adapter build
alone logs ~160 lines (measured: a gene page_in 2.9 ms with a Python no-op callback, 1.9 ms
without). Kept, it is the only place some facts are said: how "auto" flash attention
resolved at context creation (engine/context.py `_flash_attn_resolved`).
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Iterator

from actord.engine.llama import lib

_log_cb: Any = None
_quiet_cb: Any = None
_log_capture: list[str] | None = None  # while capturing, libllama's lines land here


def _on_llama_log(level: int, text: bytes | None, data: Any) -> None:
    if _log_capture is not None and text:
        _log_capture.append(text.decode(errors="replace"))


def silence() -> None:
    """Drop libllama's logs in C: libc's abs() serves as the no-op callback (it reads its
    first, integer argument only, and the caller ignores its result: harmless under every
    C calling convention libllama is built for); a Python no-op where libc has none."""
    _make_callbacks()
    lib.llama_log_set(_quiet_cb, ctypes.c_void_p())


def _make_callbacks() -> None:
    global _log_cb, _quiet_cb
    if _log_cb is None:
        _log_cb = lib.llama_log_callback(_on_llama_log)
        try:
            _quiet_cb = ctypes.cast(ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p), lib.llama_log_callback)
        except (AttributeError, OSError):
            _quiet_cb = _log_cb


@contextlib.contextmanager
def capture() -> Iterator[list[str]]:
    """Keep libllama's log lines in the yielded list for the block's length, then drop them
    again in C."""
    global _log_capture
    _make_callbacks()
    lines: list[str] = []
    _log_capture = lines
    lib.llama_log_set(_log_cb, ctypes.c_void_p())
    try:
        yield lines
    finally:
        _log_capture = None
        silence()
