"""Tiny GGUFs with recurrent memory: a qwen35 hybrid (Gated DeltaNet layers, one attention
layer, an optional nextn/MTP layer) and a pure mamba2, random f32 weights, the shared SPM
vocab (gguf_common.py).

Kept apart from the attention models because their memory is what the checkpoint,
rollback and speculation tests are about: state that cannot be cut back to a position.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from actord.testing.gguf_common import (TINY_VOCAB_SIZE, _add_attention_sizes, _add_ffn, _begin, _end_header, _finish,
                                        _matrix, _output_matrix)


def write_tiny_qwen35(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    mtp: bool = True,
    n_embd: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 16,
    n_ff: int = 128,
    d_state: int = 16,
    n_k_heads: int = 2,
    n_v_heads: int = 4,
    d_conv: int = 4,
    n_ctx_train: int = 4096,
    mtp_attn_gain: float = 1.0,
) -> Path:
    """Write a random f32 "qwen35" (Qwen3.5) hybrid GGUF; return its path.

    Layer i is full attention when (i + 1) % 4 == 0 (the GGUF's full_attention_interval),
    else Gated DeltaNet (recurrent): the default 4 layers are 3 DeltaNet + 1 attention. With
    `mtp`, one more block (blk.{n_layer}) is the nextn/MTP head (`nextn_predict_layers` 1),
    a full-attention block with nextn.eh_proj/enorm/hnorm; libllama skips it unless a model
    is loaded with load_mtp, and the main context's memory never holds it.

    What libllama 0.3.36 does with it (measured through actord's Engine): it loads with and
    without the MTP block; llama_model_is_hybrid is true; the memory is llama_memory_hybrid
    (a KV cache of n_ctx cells for the attention layer, one recurrent state per sequence for
    the DeltaNet layers); llama_memory_seq_rm of a tail refuses (returns False) with
    n_rs_seq == 0, and erasing a whole sequence succeeds.

    Weights are scaled for long memory: DeltaNet decays exp(softplus(dt_bias) * ssm_a) lie in
    about 0.94..0.998 per token, so a token changed 64+ positions back still changes greedy
    output (tests/engine/test_tiny_models.py pins it), and output rows as write_tiny_llama's.

    `mtp_attn_gain` scales the MTP block's attention output: above 1 its drafts depend on
    what its KV holds (the positions before), not only on the token and hidden row it is
    given, so a test can tell a head whose KV is right from one whose is not.
    """
    import numpy as np

    if n_embd % n_head or n_head % n_head_kv or n_v_heads % n_k_heads:
        raise ValueError("n_embd must divide by n_head, n_head by n_head_kv, n_v_heads by n_k_heads")
    f32 = np.float32
    n_vocab = TINY_VOCAB_SIZE
    interval = 4
    n_rot = head_dim // 2  # partial rotary, as Qwen3.5 (sections sum to n_rot / 2)
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    ones = lambda n: np.ones(n, dtype=f32)  # noqa: E731
    w, path, rng = _begin(path, "qwen35", f"tiny-qwen35{'-mtp' if mtp else ''}-s{seed}", seed=seed,
                          n_ctx_train=n_ctx_train, n_embd=n_embd, n_blocks=n_layer + (1 if mtp else 0))
    mat = functools.partial(_matrix, rng)
    if mtp:
        w.add_nextn_predict_layers(1)
    _add_attention_sizes(w, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim)
    w.add_rope_dimension_count(n_rot)
    w.add_rope_dimension_sections([n_rot // 4, n_rot // 8, n_rot // 2 - n_rot // 4 - n_rot // 8, 0])
    w.add_rope_freq_base(10000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(value_dim)
    w.add_ssm_state_size(d_state)
    w.add_ssm_group_count(n_k_heads)
    w.add_ssm_time_step_rank(n_v_heads)
    w.add_full_attention_interval(interval)
    _end_header(w)

    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd)).astype(f32))

    def attention(p: str, mat: Any = mat) -> None:
        # Q carries the output gate too (2 x n_head x head_dim rows); larger q/k gain for
        # peakier, position-dependent attention.
        w.add_tensor(p + "attn_q.weight", mat(2 * n_head * head_dim, n_embd, 2.0))
        w.add_tensor(p + "attn_k.weight", mat(n_head_kv * head_dim, n_embd, 2.0))
        w.add_tensor(p + "attn_v.weight", mat(n_head_kv * head_dim, n_embd))
        w.add_tensor(p + "attn_output.weight", mat(n_embd, n_head * head_dim))
        w.add_tensor(p + "attn_q_norm.weight", ones(head_dim))
        w.add_tensor(p + "attn_k_norm.weight", ones(head_dim))

    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(n_embd))
        w.add_tensor(p + "post_attention_norm.weight", ones(n_embd))
        if (i + 1) % interval == 0:
            attention(p)
        else:
            w.add_tensor(p + "attn_qkv.weight", mat(conv_dim, n_embd))
            w.add_tensor(p + "attn_gate.weight", mat(value_dim, n_embd))
            w.add_tensor(p + "ssm_conv1d.weight", (rng.standard_normal((conv_dim, d_conv)) * 0.5).astype(f32))
            # decay per token = exp(softplus(alpha + dt_bias) * ssm_a), alpha ~ 0 (small ssm_alpha)
            w.add_tensor(p + "ssm_dt.bias", np.full(n_v_heads, -2.0, dtype=f32))
            w.add_tensor(p + "ssm_a", (-np.geomspace(0.005, 0.3, n_v_heads)).astype(f32))
            w.add_tensor(p + "ssm_beta.weight", mat(n_v_heads, n_embd))
            w.add_tensor(p + "ssm_alpha.weight", mat(n_v_heads, n_embd, 0.1))
            w.add_tensor(p + "ssm_norm.weight", ones(d_state))
            w.add_tensor(p + "ssm_out.weight", mat(n_embd, value_dim))
        _add_ffn(w, p, mat, n_embd, n_ff)
    out = _output_matrix(rng, n_vocab, n_embd, gain=4.0)
    if mtp:
        # Its own generator: with or without the MTP block, the trunk and the output head are
        # the same numbers, so the two variants of one seed give the same greedy output.
        mmat = functools.partial(_matrix, np.random.default_rng([seed, 35]))

        p = f"blk.{n_layer}."
        w.add_tensor(p + "attn_norm.weight", ones(n_embd))
        w.add_tensor(p + "post_attention_norm.weight", ones(n_embd))
        def amat(n_out: int, n_in: int, gain: float = 1.0) -> Any:  # the attention output louder
            return mmat(n_out, n_in, gain * (mtp_attn_gain if n_out == n_embd else 1.0))

        attention(p, amat)
        _add_ffn(w, p, mmat, n_embd, n_ff)
        w.add_tensor(p + "nextn.eh_proj.weight", mmat(n_embd, 2 * n_embd))
        w.add_tensor(p + "nextn.enorm.weight", ones(n_embd))
        w.add_tensor(p + "nextn.hnorm.weight", ones(n_embd))
        w.add_tensor(p + "nextn.shared_head_norm.weight", ones(n_embd))
    return _finish(w, path, out)


def write_tiny_mamba2(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    d_inner: int = 128,
    d_state: int = 16,
    n_heads: int = 8,
    n_group: int = 1,
    d_conv: int = 4,
    n_ctx_train: int = 1 << 20,
) -> Path:
    """Write a random f32 "mamba2" GGUF (pure recurrent: no attention, no KV cells).

    What libllama 0.3.36 does with it (measured through actord's Engine): the memory is
    llama_memory_recurrent with one state per sequence (n_seq_max cells, whatever n_ctx);
    the per-sequence state is fixed (per layer (d_conv - 1) x (d_inner + 2 n_group d_state)
    conv floats plus d_state x d_inner SSM floats), positions are not bounded by n_ctx (a
    sequence runs on past it), seq_rm of a tail refuses (n_rs_seq is clamped to 0 on
    mamba2), and erasing a whole sequence succeeds.

    Decays exp(softplus(dt + dt_bias) * A) lie in about 0.93..0.998 per token, so a token
    changed 64+ positions back still changes greedy output.
    """
    import numpy as np

    if d_inner % n_heads or d_inner % n_group:
        raise ValueError("d_inner must divide by n_heads and n_group")
    f32 = np.float32
    n_vocab = TINY_VOCAB_SIZE
    conv_dim = d_inner + 2 * n_group * d_state
    w, path, rng = _begin(path, "mamba2", f"tiny-mamba2-s{seed}", seed=seed, n_ctx_train=n_ctx_train, n_embd=n_embd,
                          n_blocks=n_layer)
    mat = functools.partial(_matrix, rng)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(n_heads)
    w.add_ssm_group_count(n_group)
    w.add_layer_norm_rms_eps(1e-5)
    _end_header(w)

    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd)).astype(f32))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=f32))
        # in_proj rows: z (d_inner), xBC (conv_dim), dt (n_heads, kept small)
        w.add_tensor(p + "ssm_in.weight", np.concatenate([
            mat(d_inner, n_embd), mat(conv_dim, n_embd), mat(n_heads, n_embd, 1.0)]))
        w.add_tensor(p + "ssm_conv1d.weight", (rng.standard_normal((conv_dim, d_conv)) * 0.5).astype(f32))
        w.add_tensor(p + "ssm_conv1d.bias", np.zeros(conv_dim, dtype=f32))
        w.add_tensor(p + "ssm_dt.bias", np.full(n_heads, -2.0, dtype=f32))
        w.add_tensor(p + "ssm_a", (-np.geomspace(0.005, 0.3, n_heads)).astype(f32).reshape(n_heads, 1))
        w.add_tensor(p + "ssm_d", np.ones((n_heads, 1), dtype=f32))
        w.add_tensor(p + "ssm_norm.weight", np.ones((n_group, d_inner // n_group), dtype=f32))
        w.add_tensor(p + "ssm_out.weight", mat(n_embd, d_inner))
    return _finish(w, path, _output_matrix(rng, n_vocab, n_embd, gain=4.0))
