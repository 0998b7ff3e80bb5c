"""The ggml backend devices libllama computes on: names, kinds and memory.

llama-cpp-python 0.3.36 binds `llama_supports_gpu_offload` but none of ggml's device
registry (`ggml_backend_dev_count/get/name/description/type/memory`), so they are bound
here with ctypes on the very libggml that llama_cpp loaded (engine/llama.py hands it out;
the functions of libggml-base resolve through it). Engine thread only, like all of libllama:
every entry point checks the owner first.
"""

from __future__ import annotations

import ctypes
from typing import Any

from actord.engine import jobs as J
from actord.engine.llama import ggml_library, lib

# enum ggml_backend_dev_type (ggml-backend.h)
DEV_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}

_ggml: Any = None


def _bind() -> Any:
    global _ggml
    if _ggml is None:
        g = ggml_library()
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        g.ggml_backend_dev_count.restype = sz
        g.ggml_backend_dev_count.argtypes = []
        g.ggml_backend_dev_get.restype = vp
        g.ggml_backend_dev_get.argtypes = [sz]
        for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(g, name).restype = ctypes.c_char_p
            getattr(g, name).argtypes = [vp]
        g.ggml_backend_dev_type.restype = ctypes.c_int
        g.ggml_backend_dev_type.argtypes = [vp]
        g.ggml_backend_dev_memory.restype = None
        g.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
        g.ggml_backend_dev_backend_reg.restype = vp
        g.ggml_backend_dev_backend_reg.argtypes = [vp]
        g.ggml_backend_reg_name.restype = ctypes.c_char_p
        g.ggml_backend_reg_name.argtypes = [vp]
        _ggml = g
    return _ggml


def _text(raw: bytes | None) -> str:
    return raw.decode(errors="replace") if raw else ""


def probe() -> list[J.DeviceInfo]:
    """Every device ggml registered (after llama_backend_init), with its memory now."""
    lib.check_owner()
    g = _bind()
    out = []
    for i in range(int(g.ggml_backend_dev_count())):
        dev = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = g.ggml_backend_dev_backend_reg(dev)
        out.append(J.DeviceInfo(
            name=_text(g.ggml_backend_dev_name(dev)), description=_text(g.ggml_backend_dev_description(dev)),
            type=DEV_TYPES.get(int(g.ggml_backend_dev_type(dev)), "unknown"),
            backend=_text(g.ggml_backend_reg_name(reg)) if reg else "",
            free_bytes=int(free.value), total_bytes=int(total.value),
        ))
    return out


def gpu_offload() -> bool:
    """libllama can offload layers: a GPU (or integrated GPU, or RPC) backend is present."""
    return bool(lib.llama_supports_gpu_offload())
