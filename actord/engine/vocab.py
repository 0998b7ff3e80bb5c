"""Tokens and text: tokenize, a token's piece, a token's vocab text.

Owned by the engine (engine/engine.py), on the engine thread only. `piece` is on the step's
hot path: it writes into one reused buffer and allocates only for a piece over 256 bytes,
and the step reads each sampled token's piece and eog flag from `known`, filled once per
token (a vocabulary's pieces never change).
"""

from __future__ import annotations

import ctypes
from typing import Any

from actord.engine.llama import lib
from actord.vocabulary.errors import EngineError


class Vocab:
    """Text in and out of one model's vocabulary (see the module docstring)."""

    def __init__(self, vocab: Any) -> None:
        self.vocab = vocab  # libllama's llama_vocab of the loaded model
        self.n_tokens = int(lib.llama_vocab_n_tokens(vocab))
        self.known: dict[int, tuple[bytes, bool]] = {}  # token -> (piece, is eog), as `learn` made it
        self._piece_buf = ctypes.create_string_buffer(256)

    def learn(self, token: int) -> tuple[bytes, bool]:
        """A token's piece and whether it ends generation, kept in `known` (the step's cache)."""
        k = self.known[token] = (self.piece(token), bool(lib.llama_vocab_is_eog(self.vocab, token)))
        return k

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        raw = text.encode()
        cap = len(raw) + 8
        buf = (lib.llama_token * cap)()
        n = lib.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lib.llama_token * cap)()
            n = lib.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise EngineError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        n = lib.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
            return buf.raw[:n]
        return self._piece_buf.raw[:n]

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        raw = lib.llama_vocab_get_text(self.vocab, token)
        return raw.decode(errors="replace") if raw else ""
