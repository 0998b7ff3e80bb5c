"""Draft models for speculative decoding, written with the `gguf` package (no network).

* `write_pruned_draft(src, dst, n_layers, keep_last=0)`: a layer-pruned copy of a GGUF
  model: its token embeddings, its first `n_layers` blocks (and optionally its last
  `keep_last`, renumbered), its output norm and head, with the block count in the metadata
  fixed; every other key (the vocabulary, the chat template, the rope and
  window settings) and every kept tensor's bytes (quantized or not) copied as they are. The
  registry's Gemma 3 270M has no MTP head; its first few blocks read out through its own
  final norm and tied head are a real, if weak, draft with exactly its vocabulary.
* `write_vocab_variant(src, dst)`: the same model with one token's text changed: a draft
  the engine must refuse (`DraftVocabMismatch`).

Why a reader of our own: `gguf.GGUFReader` decodes every field into numpy views, about
12 s for Gemma 3's 262k-token vocabulary on this CPU; the walk below decodes the key/value
section in well under a second and hands the tensors' bytes over as memory-mapped views,
and `gguf.GGUFWriter` writes the result.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any, Callable, NamedTuple

__all__ = ["write_pruned_draft", "write_vocab_variant", "rewrite_gguf", "read_gguf_header", "has_recurrent_layers",
           "has_mtp_layers"]

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# Architectures whose sliding-window layers follow a built-in period in libllama (every
# period-th layer global): their pruned copies spell the pattern out per layer.
_SWA_PERIOD = {"gemma3": 6}


class KV(NamedTuple):
    key: str
    vtype: int  # gguf.GGUFValueType
    value: Any
    sub_type: int | None  # the element type of an array


class Tensor(NamedTuple):
    name: str
    ne: list[int]  # ggml order: ne[0] is the innermost (row) dimension
    ggml_type: int
    offset: int  # from the start of the data section
    n_bytes: int


class Header(NamedTuple):
    kv: list[KV]
    tensors: list[Tensor]
    data_start: int
    alignment: int


def read_gguf_header(buf: Any) -> Header:
    """The key/value pairs (decoded) and the tensor table of a GGUF v2/v3 file in `buf`."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    off = 24

    def u32(o: int) -> int:
        return struct.unpack_from("<I", buf, o)[0]

    def u64(o: int) -> int:
        return struct.unpack_from("<Q", buf, o)[0]

    def string(o: int) -> tuple[str, int]:
        n = u64(o)
        return bytes(buf[o + 8 : o + 8 + n]).decode("utf-8"), o + 8 + n

    def value(t: int, o: int) -> tuple[Any, int, int | None]:
        if t in _SCALAR:
            fmt = "<" + _SCALAR[t]
            return struct.unpack_from(fmt, buf, o)[0], o + struct.calcsize(fmt), None
        if t == _STRING:
            s, o = string(o)
            return s, o, None
        if t == _ARRAY:
            et, n = u32(o), u64(o + 4)
            o += 12
            if et in _NUMPY:
                arr = np.frombuffer(buf, dtype=_NUMPY[et], count=n, offset=o)
                return arr.tolist(), o + arr.nbytes, et
            items = []
            for _ in range(n):
                v, o, _sub = value(et, o)
                items.append(v)
            return items, o, et
        raise ValueError(f"unknown GGUF value type {t}")

    kv: list[KV] = []
    alignment = 32
    for _ in range(n_kv):
        key, off = string(off)
        t = u32(off)
        v, off, sub = value(t, off + 4)
        kv.append(KV(key, t, v, sub))
        if key == "general.alignment":
            alignment = int(v)
    tensors: list[Tensor] = []
    for _ in range(n_tensors):
        name, off = string(off)
        n_dims = u32(off)
        ne = list(struct.unpack_from(f"<{n_dims}Q", buf, off + 4))
        off += 4 + 8 * n_dims
        gt, t_off = struct.unpack_from("<IQ", buf, off)
        off += 12
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(gt)]
        n_elems = 1
        for d in ne:
            n_elems *= d
        tensors.append(Tensor(name, ne, gt, t_off, n_elems // block * size))
    data_start = (off + alignment - 1) // alignment * alignment
    return Header(kv, tensors, data_start, alignment)


def rewrite_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                 rename: Callable[[str], str | None] = lambda name: name,
                 edit: Callable[[str, Any], Any] = lambda key, value: value,
                 extra: dict[str, tuple[Any, int, int | None]] | None = None) -> Path:
    """Copy a GGUF file: each tensor under the name `rename` gives it (None: left out), its
    bytes as they are; each key's value as `edit(key, value)` returns it; `extra` adds keys
    ({key: (value, GGUFValueType, array element type or None)})."""
    import gguf
    import numpy as np

    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        h = read_gguf_header(buf)
        arch = next((kv.value for kv in h.kv if kv.key == "general.architecture"), None)
        if not isinstance(arch, str):
            raise ValueError(f"{src}: no general.architecture")
        tmp = dst.with_name(dst.name + ".tmp")
        w = gguf.GGUFWriter(str(tmp), arch)
        for kv in h.kv:
            if kv.key in ("general.architecture", "general.alignment"):
                continue
            if extra and kv.key in extra:
                continue
            w.add_key_value(kv.key, edit(kv.key, kv.value), gguf.GGUFValueType(kv.vtype),
                            sub_type=None if kv.sub_type is None else gguf.GGUFValueType(kv.sub_type))
        for key, (value, vtype, sub) in (extra or {}).items():
            w.add_key_value(key, value, gguf.GGUFValueType(vtype), sub_type=None if sub is None else gguf.GGUFValueType(sub))
        data: Any = None
        for t in h.tensors:
            name = rename(t.name)
            if name is None:
                continue
            data = np.frombuffer(buf, dtype=np.uint8, count=t.n_bytes, offset=h.data_start + t.offset)
            qt = gguf.GGMLQuantizationType(t.ggml_type)
            block, size = gguf.GGML_QUANT_SIZES[qt]
            byte_shape = [*reversed(t.ne[1:]), t.ne[0] // block * size]  # numpy order, rows in bytes
            w.add_tensor(name, data, raw_shape=byte_shape, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        del w, data  # views into the mapping: gone before it closes
    os.replace(tmp, dst)
    return dst


def write_pruned_draft(src: str | os.PathLike[str], dst: str | os.PathLike[str], n_layers: int,
                       keep_last: int = 0) -> Path:
    """A draft model: `src`'s embeddings, first `n_layers` blocks (then its last `keep_last`
    blocks, renumbered after them), output norm and head.

    Renumbering moves a block to another index. Where a model's layer kinds follow their
    index (Gemma 3: every 6th block attends globally, the others in a sliding window), the
    copy names each kept block's kind in `{arch}.attention.sliding_window_pattern` (one
    entry per layer, which libllama reads before its built-in period), so any blocks can go."""
    if n_layers < 1 or keep_last < 0:
        raise ValueError("n_layers must be >= 1 and keep_last >= 0")
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        h = read_gguf_header(buf)
    arch = next(kv.value for kv in h.kv if kv.key == "general.architecture")
    count_key = f"{arch}.block_count"
    n_src = next((kv.value for kv in h.kv if kv.key == count_key), None)
    if n_src is None:
        raise ValueError(f"{src}: no {count_key}")
    if n_layers + keep_last > n_src:
        raise ValueError(f"{src} has {n_src} blocks, fewer than {n_layers} + {keep_last}")
    kept = [*range(n_layers), *range(n_src - keep_last, n_src)]
    new_index = {old: new for new, old in enumerate(kept)}
    values = {kv.key: kv.value for kv in h.kv}
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    extra: dict[str, tuple[Any, int, int | None]] = {}
    if values.get(f"{arch}.attention.sliding_window") and arch in _SWA_PERIOD:
        old = values.get(pattern_key)
        if isinstance(old, list):
            swa = [int(bool(old[i])) for i in kept]
        else:
            period = int(old) if isinstance(old, int) else _SWA_PERIOD[arch]
            swa = [int(i % period < period - 1) for i in kept]
        extra[pattern_key] = (swa, _ARRAY, _UINT32)

    def rename(name: str) -> str | None:
        parts = name.split(".")
        if parts[0] != "blk":
            return name
        new = new_index.get(int(parts[1]))
        return None if new is None else ".".join([parts[0], str(new), *parts[2:]])

    def edit(key: str, value: Any) -> Any:
        if key == count_key:
            return len(kept)
        if key == "general.name":
            tail = f" + last {keep_last}" if keep_last else ""
            return f"{value} (first {n_layers}{tail} of {n_src} blocks)"
        if isinstance(value, list) and len(value) == n_src and key.startswith(arch + "."):
            return [value[i] for i in kept]  # a per-layer array (head counts, window pattern, ...)
        return value

    return rewrite_gguf(src, dst, rename=rename, edit=edit, extra=extra)


def has_recurrent_layers(path: str | os.PathLike[str]) -> bool:
    """Whether a GGUF's metadata describes recurrent layers (an `{arch}.ssm.*` key: Mamba,
    Gated DeltaNet): a pruned copy of the first blocks would hold recurrent layers only."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        keys = [kv.key for kv in read_gguf_header(buf).kv]
    return any(".ssm." in k for k in keys)


def has_mtp_layers(path: str | os.PathLike[str]) -> bool:
    """Whether a GGUF declares MTP (nextn) layers (`{arch}.nextn_predict_layers` > 0)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return any(kv.key.endswith(".nextn_predict_layers") and int(kv.value) > 0
                   for kv in read_gguf_header(buf).kv)


def write_vocab_variant(src: str | os.PathLike[str], dst: str | os.PathLike[str], token: int = 300) -> Path:
    """`src` with token `token`'s text changed: same shapes, another vocabulary."""

    def edit(key: str, value: Any) -> Any:
        if key == "tokenizer.ggml.tokens":
            value = list(value)
            value[token] = value[token] + "\u2021"
        return value

    return rewrite_gguf(src, dst, edit=edit)
