"""The model's own MTP (nextn) head as the drafter of speculative decoding: a second llama
context of type LLAMA_CONTEXT_TYPE_MTP on the target's model, on the engine thread, one
sequence per slot. Same interface as engine/draft.py's Drafter (`draft`, `keep`, `undo`,
`seq_rm`, the state jobs; what both share is engine/side.py's) plus the two hooks the
engine calls around the target's decode (`decoded`, `settle`), since an MTP head feeds on
the target's hidden states.

How libllama 0.3.36 drives it (vendor/llama.cpp common/speculative.cpp
`common_speculative_impl_draft_mtp`, src/llama-context.cpp, src/models/qwen35.cpp):
- The model is loaded with `load_mtp` (else the nextn block's tensors are skipped). The
  target context outputs, with `llama_set_embeddings_nextn(ctx, true, masked=false)`, the
  hidden state before the output norm for every token of a batch (h_p for position p);
  the MTP context (its memory a plain KV cache of the nextn layer only, so cut anywhere)
  outputs logits and its own hidden row for the rows marked as outputs (masked).
- MTP position p takes the token x_p with h_{p-1} as its "embedding" (a batch_ext entry with
  a token and `llama_batch_ext_set_embd_token`, run by `llama_process`) and predicts x_{p+1}.
  So the head follows the target one position behind: after each target decode it decodes
  the same tokens paired with the hidden rows shifted by one (`settle`, llama-server's
  `process`), and keeps the last row (`h`, llama-server's `pending_h`) for the next token.
- Drafting after the sampled token t at p: (t, p, h_{p-1}) gives d1 and a hidden row h'_p,
  then (d1, p+1, h'_p) gives d2, ... one llama_process per draft position, batched across
  the drafting sequences. After the verify the head's position p is right (it had the real
  h_{p-1}); the accepted d1..da are decoded again with the target's real rows h_p..h_{p+a-1}
  and the rest cut (llama-server re-decodes the whole verify batch; the same state).

What the carried state is: the MTP context's sequence (its KV) and one hidden row per
sequence with the position it belongs to (`h_pos`: -1 when unknown). A page and a page file
carry both (`state_get`/`state_set`: a small header, the row, libllama's sequence state).
A sequence whose row is unknown (cut back, cold after a file without one, a failed MTP
decode) pairs its next token with a zero row, as llama-server does at a prompt's first
token, and positions the head never saw stay absent from its KV: drafts degrade, output does
not (the target verifies every draft). A multi-token entry (a prompt piece) cannot draft:
the head needs the target's rows of that very piece first; it drafts from the next step.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, Sequence

import numpy as np

from actord.engine import jobs as J
from actord.engine.context import context_params, model_desc
from actord.engine.llama import ext, lib
from actord.engine.side import SideContext
from actord.vocabulary.errors import EngineError, SpecUnsupported

_MAGIC = b"MTPh"
_HEADER = struct.Struct("<4sii")  # magic, h_pos, n_embd


class MtpDrafter(SideContext):
    """The MTP head's context; `every_step`: it follows every target decode."""

    every_step = True

    def __init__(self, model: Any, target_ctx: Any, params: Any, *, n_max: int, p_min: float = 0.0, desc: str = "",
                 digest: str = "") -> None:
        """`params`: the context's (engine/context.py `context_params`), one sequence per slot;
        made an MTP context here."""
        if ext is None:
            raise SpecUnsupported("--spec mtp: this llama-cpp-python has no llama_cpp_ext (the nextn embeddings)")
        self.ctx: Any = None
        self.bx: Any = None
        self.target_ctx = target_ctx
        params.ctx_type = lib.LLAMA_CONTEXT_TYPE_MTP
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            raise EngineError("could not create the MTP head's context")
        try:
            self.mem = lib.llama_get_memory(self.ctx)
            self.vocab = lib.llama_model_get_vocab(model)
            self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
            self.n_embd = int(lib.llama_model_n_embd_out(model))
            self.n_batch = int(lib.llama_n_batch(self.ctx))
            self.bx = lib.llama_batch_ext_init(self.ctx)
            if not self.bx:
                raise EngineError("could not create the MTP head's batch")
            ext.llama_set_embeddings_nextn(target_ctx, True, False)  # every row of every target batch
            ext.llama_set_embeddings_nextn(self.ctx, True, True)  # the head's output rows only
        except BaseException:
            self.close()
            raise
        self.n_seq = int(params.n_seq_max)
        self.n_max = n_max
        self.p_min = p_min
        self.desc = desc
        self.digest = digest
        self.h = np.zeros((self.n_seq, self.n_embd), dtype=np.float32)  # the carried row per sequence
        self.h_pos = [-1] * self.n_seq  # the position h[seq] is the target's hidden state of
        self._zero = np.zeros(self.n_embd, dtype=np.float32)
        self._bind()
        self._h_ith = ext.raw("llama_get_embeddings_nextn_ith")
        self._h_all = ext.raw("llama_get_embeddings_nextn")
        self._process = lib.raw("llama_process")
        self._pos = (lib.llama_pos * 1)()
        self._step: list[tuple[J.StepEntry, int, list[int], Any]] = []  # (entry, n own rows, tokens, rows)
        self._drafted: dict[int, tuple[int, list[int]]] = {}  # seq -> (pos0, draft)
        self._kept: dict[int, int] = {}  # seq -> what the target kept after the verify

    def close(self) -> None:
        if self.bx is not None:  # made on the context: freed before it
            lib.llama_batch_ext_free(self.bx)
            self.bx = None
        super().close()

    # -- one llama_process ----------------------------------------------------------------

    def _run(self, items: Sequence[tuple[int, int, int, Any, bool]]) -> bool:
        """Decode (seq, token, pos, h row, output) items in one llama_process."""
        bx = self.bx
        lib.llama_batch_ext_clear(bx)
        rows = np.ascontiguousarray(np.stack([it[3] for it in items]), dtype=np.float32)
        base = rows.ctypes.data
        stride = self.n_embd * 4
        f32p = ctypes.POINTER(ctypes.c_float)
        for j, (seq, tok, pos, _, out) in enumerate(items):
            idx = lib.llama_batch_ext_add_token(bx, seq, tok)
            if idx != j:
                raise EngineError("the MTP head's batch refused a token", rc=idx, n=j)
            self._pos[0] = pos
            lib.llama_batch_ext_set_pos(bx, idx, self._pos)
            emb = lib.llama_embd(ctypes.cast(base + j * stride, f32p), 1, self.n_embd)
            if not lib.llama_batch_ext_set_embd_token(bx, idx, emb):
                raise EngineError("the MTP head's batch refused a hidden row", n=j)
            if out:
                lib.llama_batch_ext_set_output_logits(bx, idx, True)
        rc = int(self._process(self.ctx, lib.LLAMA_PROCESS_TYPE_DECODE, bx))
        del rows
        return rc == 0

    def _row_for(self, seq: int, pos: int) -> Any:
        """The hidden row MTP position `pos` pairs its token with: the carried one when it is
        the target's at pos - 1, else zeros."""
        return self.h[seq] if self.h_pos[seq] == pos - 1 and pos > 0 else self._zero

    # -- the step -------------------------------------------------------------------------

    def draft(self, entries: Sequence[J.StepEntry]) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Before the target's decode: draft for entries that feed one sampled token at the
        head's end. Returns the proposals and, for every entry, how far the head's sequence
        will reach once `settle` has followed the target's decode."""
        lib.check_owner()
        self._step = []
        self._drafted = {}
        self._kept = {}
        extent = {i: e.pos0 + len(e.tokens) + e.feed_last for i, e in enumerate(entries)}
        want: dict[int, int] = {}
        items = []
        order: list[int] = []
        for i, e in enumerate(entries):
            if not (e.draft > 0 and len(e.tokens) == 1 and not e.feed_last):
                continue
            if self.extent(e.seq) > e.pos0:
                self._seq_rm(self.mem, e.seq, e.pos0, -1)
            want[i] = min(e.draft, self.n_max)
            items.append((e.seq, e.tokens[0], e.pos0, self._row_for(e.seq, e.pos0), True))
            order.append(i)
        proposed: dict[int, list[int]] = {}
        step = 0
        while items:
            if not self._run(items):
                for i in order:  # the head keeps what it had before this round
                    self._seq_rm(self.mem, entries[i].seq, entries[i].pos0 + step, -1)
                break
            nxt, nxt_order = [], []
            for j, i in enumerate(order):
                t = self._pick(j, items[j][0], items[j][2] + 1)
                if t < 0:
                    continue
                proposed.setdefault(i, []).append(t)
                if len(proposed[i]) < want[i]:
                    h = np.ctypeslib.as_array(self._h_ith(self.ctx, j), shape=(self.n_embd,)).copy()
                    e = entries[i]
                    nxt.append((e.seq, t, e.pos0 + len(proposed[i]), h, True))
                    nxt_order.append(i)
            items, order = nxt, nxt_order
            step += 1
        for i, d in proposed.items():
            e = entries[i]
            self._drafted[e.seq] = (e.pos0, d)
            extent[i] = e.pos0 + len(d)  # until `keep`
        return proposed, extent

    def decoded(self, entries: Sequence[J.StepEntry], spans: Sequence[tuple[int, int]], token: Any) -> None:
        """Right after the target's decode: copy its hidden rows and tokens of every entry."""
        n = spans[-1][0] + spans[-1][1] if spans else 0
        ptr = self._h_all(self.target_ctx)
        if not ptr or n == 0:
            self._step = []
            return
        rows = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd))
        self._step = [(e, len(e.tokens) + e.feed_last, [int(token[s + j]) for j in range(c)], rows[s:s + c].copy())
                      for e, (s, c) in zip(entries, spans)]

    def keep(self, seq: int, n: int, extent: int) -> int:
        """After the verify: the target keeps positions < n; the head follows in `settle`."""
        self._kept[seq] = n
        return n

    def settle(self) -> None:
        """After the step's sampling: the head decodes what the target kept this step, each
        token with the target's hidden row of the position before it, in one llama_process;
        the carried row becomes the target's at the last kept position."""
        items = []
        firsts: dict[int, int] = {}
        for e, n_own, toks, rows in self._step:
            seq, pos0 = e.seq, e.pos0
            if seq in self._drafted and seq in self._kept:
                # The head holds pos0 right (its row was the real one) and the draft after it.
                a = self._kept[seq] - pos0 - n_own
                self._seq_rm(self.mem, seq, pos0 + 1, -1)
                for j in range(1, n_own + a):
                    items.append((seq, toks[j], pos0 + j, rows[j - 1], False))
                firsts[seq] = pos0 + 1
                last = n_own + a - 1
            else:
                if self.extent(seq) > pos0:
                    self._seq_rm(self.mem, seq, pos0, -1)
                first = self._row_for(seq, pos0).copy()  # h[seq] is overwritten below, before the decode
                for j in range(n_own):
                    items.append((seq, toks[j], pos0 + j, first if j == 0 else rows[j - 1], False))
                firsts[seq] = pos0
                last = n_own - 1
            self.h[seq] = rows[last]
            self.h_pos[seq] = pos0 + last
        self._step, self._drafted, self._kept = [], {}, {}
        if items and not self._run(items):
            for seq, p in firsts.items():
                self._seq_rm(self.mem, seq, p, -1)
                self.h_pos[seq] = -1

    def undo(self, entries: Sequence[J.StepEntry], extent: dict[int, int]) -> None:
        """The target's decode failed: the drafts leave the head's memory."""
        for seq, (pos0, _) in self._drafted.items():
            self._seq_rm(self.mem, seq, pos0, -1)
        self._step, self._drafted, self._kept = [], {}, {}

    # -- sequence edits and state (the slot's jobs) ---------------------------------------

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """The cut, then the carried row is forgotten unless it is still the last position's."""
        super().seq_rm(seq, p0, p1)
        end = self.extent(seq)
        if self.h_pos[seq] != end - 1 or end == 0:
            self.h_pos[seq] = -1

    def header(self, seq: int) -> bytes:
        """What a page carries beside the head's KV: the carried row and its position."""
        return _HEADER.pack(_MAGIC, self.h_pos[seq], self.n_embd) + self.h[seq].tobytes()

    def header_size(self) -> int:
        return _HEADER.size + 4 * self.n_embd

    def adopt_header(self, seq: int, data: memoryview) -> bool:
        """Take a page's carried row; False (nothing changed) when it is not one of ours."""
        if len(data) < self.header_size():
            return False
        magic, h_pos, n_embd = _HEADER.unpack_from(data, 0)
        if magic != _MAGIC or n_embd != self.n_embd:
            return False
        self.h[seq] = np.frombuffer(data, dtype=np.float32, count=n_embd, offset=_HEADER.size)
        self.h_pos[seq] = h_pos
        return True


def open_mtp(config: Any, model: Any, target_ctx: Any, *, threads: int, digest: str) -> MtpDrafter:
    n_mtp = int(lib.llama_model_n_layer_nextn(model))
    if n_mtp <= 0:
        raise SpecUnsupported(f"--spec mtp: the model {config.model} has no MTP (nextn) layer", model=config.model)
    return MtpDrafter(model, target_ctx, context_params(config, threads=threads, swa_full=True),
                      n_max=config.spec_n_max, p_min=config.spec_p_min,
                      desc=f"MTP head ({n_mtp} nextn layer(s)) of {model_desc(model)}",
                      digest=f"{digest}+mtp")
