"""What a model file's weights are, as one digest: so a page knows the model it came from.

A page or page file records `weights_digest`; a restore into a model with another digest is
refused (`ForeignPage`) before anything changes. Two models with the same architecture and
shapes (two fine-tunes, two random seeds) make page states of the same size that restore
"fine" into each other and decode garbage: the description, vocab and shapes cannot tell
them apart, only the weights can.

The digest is BLAKE2b-128 over the GGUF's tensor table (every tensor's name, shape, type
and offset) and a sample of every tensor's bytes: its first, middle and last 4 KiB (the
whole tensor when it is at most 12 KiB). Not over the key/value metadata: a renamed model
or a new chat template leaves the weights, and so the pages, valid.

Why sampled and not the whole data region: the cost. Measured on the registry's Gemma 3
270M (Q4_K_M, 253 MB, 236 tensors; 2 shared cores, file in the page cache): the whole data
region hashes in 250-370 ms (~700-1000 MB/s), which on a 20 GB model is ~20-30 s added to
every start; the sample reads 1.8 MB and the digest takes 30-60 ms, nearly all of it
walking the 262k-token vocabulary in the metadata to find the tensor table, so it grows with
the tensor and vocab counts, not with the bytes (bench/weights_digest.py). Any two trainings, fine-tunes or quantizations
differ in every tensor's first bytes; what the sample cannot see is a file patched in place
between samples, which is not another model. `full=True` hashes everything (benches only).

Pure Python over the file (mmap), no libllama: it runs once, at engine start, and the
engine caches it in its props.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from pathlib import Path

CHUNK = 4096

# Byte widths of the scalar GGUF value types (gguf.GGUFValueType numbering).
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class GGUFLayout:
    """A GGUF file's tensor table: [(name, dims, ggml type, offset)] and where data starts."""

    def __init__(self, tensors: list[tuple[str, tuple[int, ...], int, int]], data_start: int, size: int,
                 table: bytes, arch: str = "") -> None:
        self.tensors = tensors
        self.data_start = data_start
        self.size = size
        self.table = table  # the raw tensor-info bytes (names, shapes, types, offsets)
        self.arch = arch  # general.architecture ("" when absent)


def read_layout(buf: mmap.mmap | bytes, path: str = "") -> GGUFLayout:
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    u32 = struct.Struct("<I").unpack_from
    u64 = struct.Struct("<Q").unpack_from
    off = 24
    alignment = 32
    arch = ""

    def skip(t: int, o: int) -> int:
        if t in _SCALAR:
            return o + _SCALAR[t]
        if t == _STRING:
            return o + 8 + u64(buf, o)[0]
        if t == _ARRAY:
            (et,) = u32(buf, o)
            (n,) = u64(buf, o + 4)
            o += 12
            if et in _SCALAR:
                return o + n * _SCALAR[et]
            for _ in range(n):
                o = skip(et, o)
            return o
        raise ValueError(f"{path}: unknown GGUF value type {t}")

    for _ in range(n_kv):
        (n,) = u64(buf, off)
        key = bytes(buf[off + 8: off + 8 + n])
        off += 8 + n
        (t,) = u32(buf, off)
        off += 4
        if key == b"general.alignment" and t == 4:
            (alignment,) = u32(buf, off)
        elif key == b"general.architecture" and t == _STRING:
            (n,) = u64(buf, off)
            arch = bytes(buf[off + 8: off + 8 + n]).decode("utf-8", "replace")
        off = skip(t, off)
    table_start = off
    tensors: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        (n,) = u64(buf, off)
        name = bytes(buf[off + 8: off + 8 + n]).decode("utf-8", "replace")
        off += 8 + n
        (n_dims,) = u32(buf, off)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
        off += 4 + 8 * n_dims
        gtype, offset = struct.unpack_from("<IQ", buf, off)
        off += 12
        tensors.append((name, tuple(dims), gtype, offset))
    table = bytes(buf[table_start:off])
    data_start = (off + alignment - 1) // alignment * alignment
    return GGUFLayout(tensors, data_start, len(buf), table, arch)


def weights_digest(path: str | Path, *, full: bool = False) -> str:
    """BLAKE2b-128 hex of the tensor table and (a per-tensor sample of) the tensor data."""
    with open(path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            lay = read_layout(buf, str(path))
        h = hashlib.blake2b(digest_size=16)
        h.update(b"actord-weights-full-v1" if full else b"actord-weights-v1")
        h.update(lay.table)
        fd = f.fileno()
        if full:
            pos = lay.data_start
            while pos < lay.size:
                block = os.pread(fd, 1 << 24, pos)
                if not block:
                    break
                h.update(block)
                pos += len(block)
            return h.hexdigest()
        starts = sorted({lay.data_start + o for _, _, _, o in lay.tensors})
        ends = starts[1:] + [lay.size]
        for a, b in zip(starts, ends):
            n = b - a
            if n <= 3 * CHUNK:
                h.update(os.pread(fd, n, a))
                continue
            mid = a + (n // 2) // CHUNK * CHUNK
            for c in (a, mid, b - CHUNK):
                h.update(os.pread(fd, CHUNK, c))
        return h.hexdigest()
