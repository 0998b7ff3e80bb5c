"""What the two drafters of speculative decoding share: each is a second llama context beside
the target's, on the engine thread, one sequence per slot, that proposes tokens greedily.
engine/draft.py's is a draft model's context, engine/mtp.py's the target model's own MTP
head; how each catches up and drafts stays there. Kept in one place so that both measure,
cut and pick from their sequences alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actord.engine.llama import lib


class SideContext:
    """A drafter's context: what it measures, cuts and picks; `_bind` once its context is made."""

    ctx: Any
    mem: Any
    n_vocab: int
    p_min: float

    def _bind(self) -> None:
        """Look libllama's per-step calls up once (lib.raw: the step checked the owner)."""
        self._logits = lib.raw("llama_get_logits_ith")
        self._pos_max = lib.raw("llama_memory_seq_pos_max")
        self._seq_rm = lib.raw("llama_memory_seq_rm")

    def close(self) -> None:
        """Free the context, once (a drafter frees its batch before and its model after)."""
        if self.ctx:
            lib.llama_free(self.ctx)
            self.ctx = None

    def extent(self, seq: int) -> int:
        return int(self._pos_max(self.mem, seq)) + 1

    def _pick(self, row: int, seq: int, pos: int) -> int:
        """The greedy token at output row `row` (for sequence `seq`'s position `pos`), or -1
        under p_min."""
        v = np.ctypeslib.as_array(self._logits(self.ctx, row), shape=(self.n_vocab,))
        t = int(v.argmax())
        if self.p_min > 0:
            z = np.exp(v - v[t])
            if 1.0 / float(z.sum()) < self.p_min:
                return -1
        return t

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """The slot's cut (a job's, owner-checked); where the memory refuses it (recurrent
        state inside the range), the whole sequence goes: a cold draft is slower, never wrong."""
        if not lib.llama_memory_seq_rm(self.mem, seq, p0, p1):
            lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
