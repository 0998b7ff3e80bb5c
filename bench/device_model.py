"""A model's exact GGUF layout, carried small, rebuilt with stand-in weights where it runs.

Why: the device check runs on a machine with no network, and the working tree that travels
there holds at most 64 MiB; Gemma 3 270M is 253 MB (its Q8_0 token embedding alone is 178
MB). What a benchmark's speed depends on is the layout, not the weights' values: every
tensor's shape and quantization type, the hyperparameters and the tokenizer. So:

* `skeleton SRC.gguf OUT` (here, with the `gguf` package): keeps SRC's header byte for byte
  (metadata, tokenizer, tensor table: 6.5 MB for Gemma 3 270M) and the small float tensors
  (norms), and records where every other tensor lies; xz-compressed (~2 MB).
* `build SKELETON OUT.gguf` (there, numpy and the standard library only): writes the same
  file with every quantized tensor filled with random blocks of its own type, each block's
  scale(s) set to a small finite value, so the weights are finite and small and the
  activations stay finite through the norms. Same bytes per tensor, same kernels, same
  tokenizer: the same speed, not the same text.
"""

from __future__ import annotations

import argparse
import json
import lzma
import struct
import sys
import time
from pathlib import Path

MAGIC = b"ACTSKEL1"

# ggml type id -> (block bytes, byte offsets of its f16 scale fields, the value they get).
# Layouts from ggml-common.h (block_q8_0: d, qs[32]; block_q6_K: ql, qh, scales, d; ...).
QUANT = {
    2: (18, (0,), 3e-4),  # Q4_0
    3: (20, (0, 2), 3e-4),  # Q4_1 (d, m)
    6: (22, (0,), 3e-4),  # Q5_0
    7: (24, (0, 2), 3e-4),  # Q5_1
    8: (34, (0,), 3e-4),  # Q8_0
    10: (84, (80, 82), 2e-5),  # Q2_K (scales, qs, d, dmin)
    11: (110, (108,), 1e-4),  # Q3_K (hmask, qs, scales, d)
    12: (144, (0, 2), 2e-5),  # Q4_K (d, dmin, scales, qs)
    13: (176, (0, 2), 2e-5),  # Q5_K (d, dmin, scales, qh, qs)
    14: (210, (208,), 1e-4),  # Q6_K (ql, qh, scales, d)
}
FLOATS = {0: "float32", 1: "float16"}  # generated as small normals when not carried
CARRY_MAX = 1 << 20  # float tensors up to this size travel as they are (norms, biases)


def skeleton(src: Path, out: Path, preset: int = 9) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(str(src))
    tensors = sorted(r.tensors, key=lambda t: int(t.data_offset))
    header_len = int(tensors[0].data_offset)
    raw = src.read_bytes() if src.stat().st_size < (2 << 30) else None
    assert raw is not None
    manifest = {"source": src.name, "file_size": len(raw), "header_len": header_len, "tensors": []}
    carried = bytearray()
    for t in tensors:
        typ, off, n = int(t.tensor_type), int(t.data_offset), int(t.n_bytes)
        carry = typ in FLOATS and n <= CARRY_MAX
        if not carry and typ not in QUANT and typ not in FLOATS:
            raise SystemExit(f"{t.name}: ggml type {typ} has no stand-in generator")
        manifest["tensors"].append({"name": t.name, "type": typ, "offset": off, "n_bytes": n, "carried": carry})
        if carry:
            carried += raw[off: off + n]
    meta = json.dumps(manifest).encode()
    body = MAGIC + struct.pack("<Q", len(meta)) + meta + raw[:header_len] + bytes(carried)
    out.write_bytes(lzma.compress(body, preset=preset))
    return manifest


def build(skel: Path, out: Path, seed: int = 0) -> Path:
    import numpy as np

    body = lzma.decompress(skel.read_bytes())
    if body[:8] != MAGIC:
        raise SystemExit(f"{skel} is not a model skeleton")
    (n_meta,) = struct.unpack("<Q", body[8:16])
    manifest = json.loads(body[16:16 + n_meta])
    pos = 16 + n_meta
    header_len = manifest["header_len"]
    rng = np.random.default_rng(seed)
    tmp = out.with_suffix(out.suffix + ".part")
    with open(tmp, "wb") as f:
        f.truncate(manifest["file_size"])
        f.write(body[pos: pos + header_len])
        pos += header_len
        for t in manifest["tensors"]:
            n, typ = t["n_bytes"], t["type"]
            if t["carried"]:
                data = body[pos: pos + n]
                pos += n
            elif typ in QUANT:
                bs, scales, d = QUANT[typ]
                arr = np.frombuffer(rng.bytes(n), dtype=np.uint8).copy().reshape(-1, bs)
                dv = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
                for off in scales:
                    arr[:, off:off + 2] = dv if off == scales[0] else 0  # d small, dmin / m zero
                data = arr.tobytes()
            else:
                data = (rng.standard_normal(n // np.dtype(FLOATS[typ]).itemsize) * 0.02).astype(FLOATS[typ]).tobytes()
            f.seek(t["offset"])
            f.write(data)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("skeleton", help="SRC.gguf -> its skeleton (header, small tensors, table), xz")
    s.add_argument("src", type=Path)
    s.add_argument("out", type=Path)
    b = sub.add_parser("build", help="skeleton -> a GGUF of the same layout with stand-in weights")
    b.add_argument("skeleton", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.cmd == "skeleton":
        m = skeleton(a.src, a.out)
        n_gen = sum(1 for t in m["tensors"] if not t["carried"])
        print(f"{a.out}: {a.out.stat().st_size / 1e6:.1f} MB for {m['file_size'] / 1e6:.1f} MB "
              f"({len(m['tensors'])} tensors, {n_gen} to generate) in {time.perf_counter() - t0:.1f} s")
    else:
        build(a.skeleton, a.out, a.seed)
        print(f"{a.out}: {a.out.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
