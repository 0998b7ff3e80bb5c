"""The only door to libllama: a guarded view of the `llama_cpp` module.

Rule of the house: exactly one OS thread (the engine thread) ever calls into libllama. The
rule is enforced here rather than by convention: `lib.llama_decode(...)` checks that the
calling thread owns the library and raises `WrongThread` otherwise. Types, constants and
ctypes structures pass through unguarded (they do not call into C). An optional observer
sees every call's name and thread, which is how a test proves no call happens elsewhere.

Nothing outside actord/engine/ imports llama_cpp; a test checks that too.
"""

from __future__ import annotations

import ctypes
import inspect
import threading
from typing import Any, Callable

import llama_cpp as _llama_cpp

from actord.vocabulary.errors import WrongThread

_owner: int | None = None
_observer: Callable[[str, int], None] | None = None


def claim_current_thread() -> None:
    global _owner
    if _owner is not None and _owner != threading.get_ident():
        raise WrongThread("libllama is already owned by another engine thread")
    _owner = threading.get_ident()


def release_current_thread() -> None:
    global _owner
    if _owner == threading.get_ident():
        _owner = None


def set_observer(fn: Callable[[str, int], None] | None) -> None:
    """Install a hook called with (function name, thread ident) before every libllama call."""
    global _observer
    _observer = fn


def _is_c_call(attr: Any) -> bool:
    return inspect.isfunction(attr) or isinstance(attr, ctypes._CFuncPtr)  # type: ignore[attr-defined]


class _GuardedLib:
    def __init__(self, module: Any = None) -> None:
        self._module = module if module is not None else _llama_cpp

    def check_owner(self) -> None:
        """Raise WrongThread unless the calling thread owns libllama (a hot loop checks once,
        then calls functions got from `raw`)."""
        ident = threading.get_ident()
        if ident != _owner:
            raise WrongThread("libllama used off the engine thread")
        if _observer is not None:
            _observer("check_owner", ident)

    def raw(self, name: str) -> Any:
        """The unguarded function, for a hot loop that called `check_owner` first."""
        return getattr(self._module, name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_module":
            raise AttributeError(name)
        attr = getattr(self._module, name)
        if not (_is_c_call(attr) and (name.startswith("llama_") or name.startswith("ggml_"))):
            setattr(self, name, attr)
            return attr

        def guarded(*args: Any, _fn: Any = attr, _name: str = name) -> Any:
            ident = threading.get_ident()
            if ident != _owner:
                raise WrongThread(f"{_name} called off the engine thread", function=_name)
            if _observer is not None:
                _observer(_name, ident)
            return _fn(*args)

        guarded.__name__ = name
        setattr(self, name, guarded)
        return guarded


lib: Any = _GuardedLib()

# llama-cpp-python's bindings of libllama's staging API (src/llama-ext.h: the nextn/MTP
# embeddings), guarded alike. `None` where the installed wheel lacks them.
try:
    from llama_cpp import llama_cpp_ext as _ext_module
except (ImportError, AttributeError):  # pragma: no cover - an older wheel
    _ext_module = None
ext: Any = _GuardedLib(_ext_module) if _ext_module is not None else None


# llama-cpp-python's pure-Python GBNF helpers (JSON-schema-to-GBNF converter, JSON_GBNF):
# no libllama call, safe on any thread. actord.engine.grammar is their one user.
from llama_cpp import llama_grammar as grammar_lib  # noqa: E402


def ggml_library() -> Any:
    """The libggml that llama_cpp loaded, as a raw ctypes library: llama_cpp binds none of
    ggml's backend-device registry. Unguarded: its one user (engine/devices.py) checks the
    owner before every call."""
    from llama_cpp._ggml import libggml

    return libggml
