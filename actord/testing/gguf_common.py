"""What every tiny GGUF writer shares (actord/testing/tiny_*.py): the 512-token
SentencePiece vocab with byte fallbacks, the header's opening and closing keys, the random
projections and the blocks' feed-forward, the output projection that keeps greedy decoding
off the special tokens, and the write itself.

Kept in one place so every tiny model tokenizes alike: the same text gives the same ids on
the llama, the SWA, the hybrid and the recurrent model (a tiny llama can draft for any of
them: same vocabulary).

Shapes, in every writer: numpy arrays are (rows, cols) = (n_out, n_in); gguf reverses them
into ggml's ne = [n_in, n_out], which is the order `GGUFReader` reports.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Sequence

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


def _begin(path: str | os.PathLike[str], arch: str, name: str, *, seed: int, n_ctx_train: int, n_embd: int,
           n_blocks: int) -> tuple[Any, Path, Any]:
    """(writer, path, generator) of a new tiny model: its folder made, the keys every model
    opens its header with written (name, context, width, blocks), and the seeded generator
    all its weights are drawn from, in the writer's order."""
    import gguf
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_blocks)
    return w, path, rng


def _matrix(rng: Any, n_out: int, n_in: int, gain: float = 1.0) -> Any:
    """A random f32 projection n_in -> n_out whose output has about `gain` times the RMS of
    its input (rows of std gain/sqrt(n_in))."""
    import numpy as np

    return (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(np.float32)


def _add_attention_sizes(w: Any, *, n_ff: int, n_head: int, n_head_kv: int, head_dim: int | None = None) -> None:
    """The sizes of an attention model's blocks; `head_dim` where the architecture reads it
    (gemma3, qwen35) rather than deriving it from n_embd / n_head (llama)."""
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def _end_header(w: Any, control: Sequence[str] = ()) -> None:
    """The keys every tiny model's header ends with: the shared vocab, all tensors f32."""
    import gguf

    w.add_vocab_size(TINY_VOCAB_SIZE)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_spm_tokenizer(w, control)


def _add_ffn(w: Any, p: str, mat: Any, n_embd: int, n_ff: int) -> None:
    """A block's gated feed-forward (SwiGLU) projections, drawn with `mat` in this order."""
    w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
    w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
    w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff))


def _finish(w: Any, path: Path, output: Any) -> Path:
    """The output norm (ones) and projection (`_output_matrix`), then the write."""
    import numpy as np

    w.add_tensor("output_norm.weight", np.ones(output.shape[1], dtype=np.float32))
    w.add_tensor("output.weight", output)
    return _write(w, path)


def _write(w: Any, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

