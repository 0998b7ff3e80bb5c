"""What rolling rejected drafts back costs on recurrent and hybrid memory, per verify.

A verify decodes the entry's token t and k drafts in one batch; when the target rejects
them all, its memory must go back to the state after t. actord does it two ways
(engine/step.py `_verify`, props.spec_rollback):
- "rs": libllama's n_rs_seq rollback snapshots (qwen35 has them): a seq_rm inside the batch
  just decoded. Its price is memory, (1 + n_rs_seq) recurrent states per sequence, and the
  snapshot writes in every decode.
- "replay": copy the recurrent state (PARTIAL_ONLY) before the verify, restore it, cut the
  attention part, decode t again. Its price is a state copy per verify and, on rejection, a
  second (one-token) decode.
Printed per model: a plain one-token step, a k-token verify with full rejection each way,
and the bytes a sequence's recurrent state takes with and without the snapshots. Raw
llama_cpp calls (as bench/hot_path.py), one thread, f32 generated models; no assertion.

Run: .venv/bin/python bench/spec_rollback.py [--k 4] [--n 60]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llama_cpp as L  # noqa: E402

from actord.testing.models import write_tiny_mamba2, write_tiny_qwen35  # noqa: E402

PARTIAL = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
_quiet = None


def measure(path: str, k: int, n: int, threads: int) -> None:
    m = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(m))

    def ctx(n_rs: int):
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified = 2048, 64, 64, 1, True
        cp.n_threads = cp.n_threads_batch = threads
        cp.n_rs_seq = n_rs
        return L.llama_init_from_model(m, cp)

    b = L.llama_batch_init(64, 0, 1)

    def dec(c, toks, pos0, out=True):
        for i, t in enumerate(toks):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, int(out)
            b.seq_id[i][0] = 0
        b.n_tokens = len(toks)
        assert L.llama_decode(c, b) == 0

    rng = np.random.default_rng(0)
    prompt = [1] + list(rng.integers(3, nv - 8, 63))
    rows = []
    for name, n_rs in (("plain step", 0), ("rs", k), ("replay", 0)):
        c = ctx(n_rs)
        if n_rs and L.llama_n_rs_seq(c) < k:
            rows.append(f"    {name:<28} (no rollback snapshots for this architecture)")
            L.llama_free(c)
            continue
        mem = L.llama_get_memory(c)
        dec(c, prompt, 0)
        pos = len(prompt)
        state = L.llama_state_seq_get_size_ext(c, 0, PARTIAL)
        buf = (ctypes.c_uint8 * state)()
        t0 = time.perf_counter()
        for i in range(n):
            t = int(3 + (i * 37) % (nv - 8))
            if name == "plain step":
                dec(c, [t], pos)
            elif name == "rs":
                dec(c, [t] + [5] * k, pos)
                assert L.llama_memory_seq_rm(mem, 0, pos + 1, -1)
            else:
                L.llama_state_seq_get_data_ext(c, buf, state, 0, PARTIAL)
                dec(c, [t] + [5] * k, pos)
                assert L.llama_state_seq_set_data_ext(c, buf, state, 0, PARTIAL)
                assert L.llama_memory_seq_rm(mem, 0, pos, -1)
                dec(c, [t], pos, out=False)
            pos += 1
        ms = (time.perf_counter() - t0) * 1e3 / n
        what = "" if name == "plain step" else f" (k={k}, all rejected)"
        rows.append(f"    {name + what:<28} {ms:7.2f} ms  recurrent state {state:>8} B/seq"
                    + (f" x (1 + n_rs_seq {n_rs}) in memory" if n_rs else ""))
        L.llama_free(c)
    L.llama_batch_free(b)
    L.llama_model_free(m)
    print("\n".join(rows), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    L.llama_backend_init()
    global _quiet
    _quiet = L.llama_log_callback(lambda *_: None)  # kept alive: libllama calls it later
    L.llama_log_set(_quiet, ctypes.c_void_p(0))
    tmp = Path(tempfile.mkdtemp(prefix="actord-rollback-"))
    hybrid = write_tiny_qwen35(tmp / "qwen35.gguf", seed=1, mtp=False, n_embd=256, n_layer=8, n_head=8, n_head_kv=4,
                               head_dim=32, n_ff=768, d_state=32, n_k_heads=4, n_v_heads=8)
    mamba = write_tiny_mamba2(tmp / "mamba2.gguf", seed=1, n_embd=256, n_layer=4, d_inner=512, n_heads=16)
    for title, path in (("qwen35 hybrid f32 (256 x 6 DeltaNet + 2 attention)", hybrid),
                        ("mamba2 f32 (256 x 4)", mamba)):
        print(f"{title}:", flush=True)
        measure(str(path), a.k, a.n, a.threads)


if __name__ == "__main__":
    main()
