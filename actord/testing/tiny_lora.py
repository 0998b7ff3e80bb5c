"""A random LoRA adapter GGUF for any base model (a tiny one or a real one), shaped from the
base's own tensor table: the genes of the gene tests and benches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from actord.testing.gguf_common import _write


def _read_gguf_tensor_table(path: Path) -> tuple[str, list[tuple[str, list[int]]]]:
    """(general.architecture, [(tensor name, ggml shape ne)]) from a GGUF file's header,
    through the engine's header walk (actord/engine/weights.py): `gguf.GGUFReader` decodes
    every field, ~20 s on a model with a 262k-token vocabulary (Gemma 3)."""
    import mmap

    from actord.engine.weights import read_layout

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        layout = read_layout(buf, str(path))
    if not layout.arch:
        raise ValueError(f"{path}: no general.architecture")
    return layout.arch, [(name, list(dims)) for name, dims, _, _ in layout.tensors]


_DEFAULT_LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_tiny_lora(
    path: str | os.PathLike[str],
    base_path: str | os.PathLike[str],
    *,
    seed: int = 0,
    rank: int = 4,
    alpha: float = 8.0,
    targets: Sequence[str] = _DEFAULT_LORA_TARGETS,
    strength: float = 0.5,
) -> Path:
    """Write a random LoRA adapter GGUF for the model at `base_path`; return its path.

    For every 2-D base tensor `blk.N.<target>.weight` with ggml shape ne = [n_in, n_out] it
    writes `...weight.lora_a` (ne [n_in, rank]) and `...weight.lora_b` (ne [rank, n_out]),
    f32. llama.cpp adds scale * alpha / rank * B @ A @ x to that projection (scale is the
    per-context adapter scale given to llama_set_adapters_lora). A and B are scaled so the
    update's RMS is about `strength` times the input's RMS, per projection, whatever rank
    and alpha are. Only the base's names and shapes are read, never its weights.

    Measured with llama.cpp (0.3.36): at the default strength 0.5, greedy output of the tiny
    llama and tiny SWA models changed for 40/40 (seed, prompt) pairs each, with finite logits;
    on the real Gemma 3 270M (rank=16) 0.5 turns output to gibberish while 0.05-0.1 changes
    it but keeps it fluent ("...of France. It is" -> "...of the same name.").
    """
    import gguf
    import numpy as np

    if rank < 1:
        raise ValueError("rank must be >= 1")
    if alpha <= 0:
        raise ValueError("alpha must be > 0")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arch, tensors = _read_gguf_tensor_table(Path(base_path))
    want = set(targets)
    selected: list[tuple[str, int, int]] = []
    for name, shape in tensors:
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in want:
            continue
        if len(shape) != 2:
            continue
        selected.append((name, shape[0], shape[1]))  # ggml order: [n_in, n_out]
    if not selected:
        raise ValueError(f"{base_path}: no tensors match targets {sorted(want)}")
    selected.sort(key=lambda s: (int(s[0].split(".")[1]), s[0]))

    rng = np.random.default_rng(seed)
    f32 = np.float32
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_name(f"tiny-lora-r{rank}-s{seed}")
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    scale = alpha / rank
    for name, n_in, n_out in selected:
        # x (unit RMS per element) -> A x has per-element RMS 1; B then maps rank -> n_out
        # with std strength / (scale * sqrt(rank)) so scale * B A x has RMS ~strength.
        a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(f32)
        b = (rng.standard_normal((n_out, rank)) * (strength / (scale * np.sqrt(rank)))).astype(f32)
        w.add_tensor(name + ".lora_a", a)
        w.add_tensor(name + ".lora_b", b)
    return _write(w, path)
