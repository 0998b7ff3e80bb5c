"""Tiny attention-only GGUFs: a llama (plain KV cache) and a gemma3 (interleaved
sliding-window KV cache), random f32 weights, the shared SPM vocab (gguf_common.py).

The plain llama is the workhorse of the test suite (cheap, any text round-trips); the SWA
model is the one whose cache cannot be cut back freely unless --swa-full.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence

from actord.testing.chat_templates import TINY_CHAT_TEMPLATE
from actord.testing.gguf_common import (TINY_VOCAB_SIZE, _add_attention_sizes, _add_ffn, _begin, _end_header, _finish,
                                        _matrix, _output_matrix)


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 4096,
    chat_template: str | None = None,
    control_tokens: Sequence[str] = (),
    pooling: int | None = None,
    output_gain: float = 4.0,
) -> Path:
    """Write a random f32 llama-architecture GGUF with a 512-token SPM vocab; return its path.

    `chat_template` (e.g. TINY_CHAT_TEMPLATE) is stored as tokenizer.chat_template;
    `control_tokens` (e.g. "<tool_call>") become control tokens at the vocab's end, whose
    output rows are zero like the other specials' (never picked greedily unless biased);
    `pooling` names a pooling type, as embedding models do. `output_gain` 0 zeroes the output
    projection: every token, EOS included, is equally likely under sampling, so a reply at
    temperature 1 ends by itself after ~512 tokens (what an agent CLI's turn needs to end)."""
    import gguf
    import numpy as np

    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    f32 = np.float32
    head_dim = n_embd // n_head
    n_vocab = TINY_VOCAB_SIZE
    w, path, rng = _begin(path, "llama", f"tiny-llama-s{seed}", seed=seed, n_ctx_train=n_ctx_train, n_embd=n_embd,
                          n_blocks=n_layer)
    mat = functools.partial(_matrix, rng)
    _add_attention_sizes(w, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    _end_header(w, control_tokens)
    if pooling is not None:  # 1 mean, 2 cls, 3 last: an embedding model (libllama pools its output)
        w.add_pooling_type(gguf.PoolingType(pooling))
    if chat_template is not None:
        w.add_chat_template(chat_template)

    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd)).astype(f32))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=f32))
        # Larger q/k gain: peakier, position-dependent attention, so output depends on context.
        w.add_tensor(p + "attn_q.weight", mat(n_embd, n_embd, 2.0))
        w.add_tensor(p + "attn_k.weight", mat(n_head_kv * head_dim, n_embd, 2.0))
        w.add_tensor(p + "attn_v.weight", mat(n_head_kv * head_dim, n_embd))
        w.add_tensor(p + "attn_output.weight", mat(n_embd, n_embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=f32))
        _add_ffn(w, p, mat, n_embd, n_ff)
    out = _output_matrix(rng, n_vocab, n_embd, gain=output_gain)
    if control_tokens:
        out[n_vocab - len(control_tokens):] = 0.0
    return _finish(w, path, out)


def write_tiny_chat(path: str | os.PathLike[str]) -> Path:
    """The tiny chat model of the chat, HTTP and cluster tests: write_tiny_llama's seed 1 with
    TINY_CHAT_TEMPLATE, so a chat's messages render as that template says."""
    return write_tiny_llama(path, seed=1, chat_template=TINY_CHAT_TEMPLATE)


def write_tiny_swa(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    window: int = 32,
    n_embd: int = 64,
    n_layer: int = 6,
    n_head: int = 4,
    n_head_kv: int = 1,
    head_dim: int = 16,
    n_ff: int = 128,
    n_ctx_train: int = 4096,
    chat_template: str | None = None,
    output_gain: float = 4.0,
) -> Path:
    """Write a random f32 "gemma3" GGUF with sliding-window attention; return its path.

    llama.cpp gives gemma3 the layer pattern "5 sliding, 1 global" (layer i is global when
    i % 6 == 5), so the default 6 layers give one full-attention layer and five SWA layers:
    with swa_full=False the SWA part of the KV cache keeps only about the last `window`
    positions of each sequence (plus what the current ubatch needs) and forgets the rest.
    Other n_layer values load too (1 or 2 layers: all SWA; 12: two global layers).

    What llama.cpp 0.3.36 does with it (n_seq_max=2, kv_unified=True, swa_full=False):
    the SWA cache is min(n_ctx, pad256(window * n_seq_max + n_ubatch)) cells, so at least
    256, and cells are only reused once it wraps. A 200-token prompt therefore still has
    llama_memory_seq_pos_min == 0; a 300-token prompt decoded with n_ubatch=64 has
    pos_min == 44. The per-sequence state with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY holds only
    the SWA layers' last ~window positions (10768 bytes here, constant) against 26008 (200
    tokens) / 33608 (300 tokens) for the full state. After the window has slid,
    llama_memory_seq_rm(mem, seq, p, -1) still returns True, but decoding on from p gives
    wrong logits unless a partial state saved at p is restored with
    llama_state_seq_set_data_ext(..., PARTIAL_ONLY).
    """
    import numpy as np

    if n_head % n_head_kv:
        raise ValueError("n_head must divide by n_head_kv")
    if window < 1:
        raise ValueError("window must be >= 1")
    f32 = np.float32
    n_vocab = TINY_VOCAB_SIZE
    w, path, rng = _begin(path, "gemma3", f"tiny-gemma3-swa{window}-s{seed}", seed=seed, n_ctx_train=n_ctx_train,
                          n_embd=n_embd, n_blocks=n_layer)
    mat = functools.partial(_matrix, rng)
    _add_attention_sizes(w, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    _end_header(w)
    if chat_template is not None:  # as write_tiny_llama's (and output_gain too)
        w.add_chat_template(chat_template)

    # gemma scales the input embedding by sqrt(n_embd); keep the residual stream ~unit RMS.
    w.add_tensor("token_embd.weight", (rng.standard_normal((n_vocab, n_embd)) / np.sqrt(n_embd)).astype(f32))
    ones = lambda n: np.ones(n, dtype=f32)  # noqa: E731  (gemma GGUF norms already hold 1 + w)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(n_embd))
        w.add_tensor(p + "attn_q.weight", mat(n_head * head_dim, n_embd))
        w.add_tensor(p + "attn_k.weight", mat(n_head_kv * head_dim, n_embd))
        w.add_tensor(p + "attn_v.weight", mat(n_head_kv * head_dim, n_embd))
        w.add_tensor(p + "attn_q_norm.weight", ones(head_dim) * f32(2.0))
        w.add_tensor(p + "attn_k_norm.weight", ones(head_dim) * f32(2.0))
        w.add_tensor(p + "attn_output.weight", mat(n_embd, n_head * head_dim))
        w.add_tensor(p + "post_attention_norm.weight", ones(n_embd))
        w.add_tensor(p + "ffn_norm.weight", ones(n_embd))
        _add_ffn(w, p, mat, n_embd, n_ff)
        w.add_tensor(p + "post_ffw_norm.weight", ones(n_embd))
    return _finish(w, path, _output_matrix(rng, n_vocab, n_embd, gain=output_gain))
