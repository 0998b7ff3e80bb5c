"""The draft context of speculative decoding: a second model and llama context on the
engine thread, one sequence per slot (sequence i drafts for slot i).

Mechanism only, like engine/engine.py: the scheduling core (serving/steps/core.py, policy/speculation.py)
decides what each entry catches up on and how many tokens it drafts; this module decodes
the catch-up, proposes the draft tokens greedily (batched across every drafting sequence:
one llama_decode per draft position, llama-server's draft-simple), and cuts its sequences
back. The target verifies in the step's own llama_decode (engine/step.py `_step`).

What makes it safe to share one engine step:
- The draft's sequence for a slot always holds a prefix of the slot's tokens. The plan says
  where it should start (`draft_pos0`); before decoding, the sequence is cut there if it
  holds more (a step that failed after the draft ran), and an entry whose draft holds LESS
  than the plan assumes (its state was lost) drafts nothing this step. Each entry's result
  says how far the draft reaches (`EntryOut.draft_n`), so the core's count is corrected by
  what the context really holds, every step.
- A draft that cannot decode (no cells, a libllama failure) never fails the target's step:
  its sequences are cut back to the plan's start and nothing is drafted this step.
- Every memory kind speculates. A draft model's attention memory is cut back with seq_rm; a
  draft model with recurrent or hybrid memory (its drafts are one-token decodes, so no
  batch to roll back inside) copies its sequence's recurrent state after the entry's token
  and, when drafts are rejected, restores it and decodes the accepted ones again (`keep`,
  `settle`); a cut it cannot make erases the sequence, which then catches up cold. The
  target's rollback is engine/step.py `_verify`'s (seq_rm, n_rs_seq snapshots, or replay).
  The draft context always keeps a full SWA cache; a target with a sliding-window cache
  that is not full is refused at start (`SpecUnsupported`). A draft model whose vocabulary
  differs (type, BOS/EOS, size, any token's text) is refused with `DraftVocabMismatch`.

`--spec mtp` (the model's own MTP head) is engine/mtp.py; what both drafters share,
engine/side.py.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

from actord.engine import jobs as J
from actord.engine.context import context_params, model_desc
from actord.engine.llama import lib
from actord.engine.side import SideContext
from actord.vocabulary.errors import DraftVocabMismatch, EngineError, InvalidParams, SpecUnsupported


def vocab_mismatch(tgt: Any, dft: Any) -> str:
    """"" when two vocabularies are the same for speculation, else the first difference."""
    if lib.llama_vocab_type(tgt) != lib.llama_vocab_type(dft):
        return "vocab type differs"
    for name in ("bos", "eos"):
        add_t = bool(getattr(lib, f"llama_vocab_get_add_{name}")(tgt))
        add_d = bool(getattr(lib, f"llama_vocab_get_add_{name}")(dft))
        id_t = int(getattr(lib, f"llama_vocab_{name}")(tgt))
        id_d = int(getattr(lib, f"llama_vocab_{name}")(dft))
        if add_t != add_d or id_t != id_d:
            return f"{name.upper()} differs (add {add_t} vs {add_d}, id {id_t} vs {id_d})"
    n_t, n_d = int(lib.llama_vocab_n_tokens(tgt)), int(lib.llama_vocab_n_tokens(dft))
    if n_t != n_d:
        return f"size differs ({n_t} vs {n_d} tokens)"
    lib.check_owner()
    text = lib.raw("llama_vocab_get_text")
    for i in range(n_t):
        if text(tgt, i) != text(dft, i):
            return f"token {i} differs"
    return ""


class Drafter(SideContext):
    """A draft model's context: one sequence per slot (attention, SWA kept full, recurrent or
    hybrid memory)."""

    every_step = False  # it catches up on the plan's draft tokens, before the target decodes

    def __init__(self, path: str, target_model: Any, target_vocab: Any, params: Any, *, n_max: int,
                 p_min: float = 0.0) -> None:
        """`params`: the context's (engine/context.py `context_params`), one sequence per slot."""
        self.model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
        if not self.model:
            raise EngineError(f"could not load draft model {path}", path=path)
        self.ctx: Any = None
        self.batch: Any = None
        try:
            self.vocab = lib.llama_model_get_vocab(self.model)
            why = vocab_mismatch(target_vocab, self.vocab)
            if why:
                raise DraftVocabMismatch(
                    f"the draft model {path} does not share the target's vocabulary ({why}): speculative decoding "
                    "needs the same token ids with the same texts", path=path, reason=why)
            # Recurrent or hybrid memory: rejected drafts are taken back by restoring a copy
            # of the state (`keep`, `settle`); a sliding window is always kept full here.
            self.recurrent = bool(lib.llama_model_is_recurrent(self.model) or lib.llama_model_is_hybrid(self.model))
            self.ctx = lib.llama_init_from_model(self.model, params)
            if not self.ctx:
                raise EngineError("could not create the draft model's context", path=path)
            self.mem = lib.llama_get_memory(self.ctx)
            self.n_batch = int(lib.llama_n_batch(self.ctx))
            self.n_seq = int(params.n_seq_max)
            self.n_max = n_max
            self.p_min = p_min
            self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
            self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
            self.desc = model_desc(self.model)
            self.digest = draft_digest(path)
        except BaseException:
            self.close()
            raise
        b = self.batch
        self._views = (b.token, b.pos, b.n_seq_id, b.seq_id, b.logits)
        self._decode = lib.raw("llama_decode")
        self._bind()
        self._snap: dict[int, tuple[int, bytes, list[int]]] = {}  # seq -> (extent, state, drafts)
        self._replays: list[tuple[int, int, bytes, list[int]]] = []

    def close(self) -> None:
        if self.batch is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        super().close()
        if self.model:
            lib.llama_model_free(self.model)
            self.model = None

    # -- the step -------------------------------------------------------------------------

    def draft(self, entries: Sequence[J.StepEntry]) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Catch up and draft for the step's entries (the caller checked the owner).

        Returns ({entry index: proposed tokens} for entries that drafted, {entry index: the
        draft sequence's extent after}) for every entry that touched the draft context."""
        n_in = sum(len(e.draft_tokens) for e in entries)
        if n_in > self.n_batch:  # refused before anything changes (the plan keeps within it)
            raise InvalidParams(f"{n_in} draft catch-up tokens exceed the draft's n_batch {self.n_batch}")
        token, pos, n_seq_id, seq_id, logits = self._views
        extent: dict[int, int] = {}
        want: dict[int, int] = {}  # entry index -> tokens to draft
        out_at: dict[int, int] = {}  # entry index -> its output row in the batch
        k = 0
        for i, e in enumerate(entries):
            if not e.draft_tokens and not e.draft:
                continue
            have = self.extent(e.seq)
            if have > e.draft_pos0:
                have = self._cut(e.seq, e.draft_pos0)
            if have < e.draft_pos0:  # the plan thinks the draft holds more than it does
                extent[i] = have
                continue
            for j, t in enumerate(e.draft_tokens):
                token[k] = t
                pos[k] = e.draft_pos0 + j
                n_seq_id[k] = 1
                seq_id[k][0] = e.seq
                logits[k] = 0
                k += 1
            extent[i] = e.draft_pos0 + len(e.draft_tokens)
            if e.draft > 0 and e.draft_tokens and extent[i] == e.pos0 + len(e.tokens):
                logits[k - 1] = 1
                out_at[i] = k - 1
                want[i] = min(e.draft, self.n_max)
        proposed: dict[int, list[int]] = {}
        if k == 0:
            return proposed, extent
        self.batch.n_tokens = k
        if self._decode(self.ctx, self.batch) != 0:
            self._fail(entries, extent)
            return proposed, extent
        live = []
        for i, row in out_at.items():
            t = self._pick(row, entries[i].seq, extent[i])
            if t >= 0:
                proposed[i] = [t]
                live.append(i)
                if self.recurrent and want[i] > 1:  # the state after t, for `keep` to go back to
                    self._snap[entries[i].seq] = (extent[i], self._copy(entries[i].seq), proposed[i])
        while True:
            live = [i for i in live if len(proposed[i]) < want[i]]
            if not live:
                break
            for k, i in enumerate(live):
                token[k] = proposed[i][-1]
                pos[k] = extent[i]
                n_seq_id[k] = 1
                seq_id[k][0] = entries[i].seq
                logits[k] = 1
            self.batch.n_tokens = len(live)
            if self._decode(self.ctx, self.batch) != 0:
                for i in live:
                    self._seq_rm(self.mem, entries[i].seq, extent[i], -1)
                break
            nxt = []
            for k, i in enumerate(live):
                extent[i] += 1
                t = self._pick(k, entries[i].seq, extent[i])
                if t >= 0:
                    proposed[i].append(t)
                    nxt.append(i)
            live = nxt
        return proposed, extent

    def _fail(self, entries: Sequence[J.StepEntry], extent: dict[int, int]) -> None:
        """The catch-up did not decode: back to where the plan started, no drafts."""
        for i in extent:
            e = entries[i]
            if self.extent(e.seq) >= e.draft_pos0:
                self._cut(e.seq, e.draft_pos0)
            extent[i] = self.extent(e.seq)

    def _cut(self, seq: int, p0: int) -> int:
        """Cut the sequence at p0; where its memory refuses (recurrent state inside it), erase
        it: a draft that starts cold is slower, never wrong. Returns its extent after."""
        if not self._seq_rm(self.mem, seq, p0, -1):
            self._seq_rm(self.mem, seq, -1, -1)
        return self.extent(seq)

    def _copy(self, seq: int) -> bytes:
        """The sequence's recurrent state (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), copied."""
        flags = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(lib.llama_state_seq_get_size_ext(self.ctx, seq, flags))
        buf = (ctypes.c_uint8 * max(1, size))()
        n = int(lib.llama_state_seq_get_data_ext(self.ctx, buf, size, seq, flags))
        return bytes(buf)[:n] if n == size else b""

    def keep(self, seq: int, n: int, extent: int) -> int:
        """After the verify: the draft keeps positions < n; returns its extent. A draft model
        with recurrent memory goes back to its state after the entry's token (copied in
        `draft`) and decodes the accepted drafts again in `settle`, as the target's rollback
        "replay" does (its own drafts are one-token decodes: no batch to roll back inside)."""
        snap = self._snap.pop(seq, None)
        if extent <= n:
            return extent
        if not self.recurrent:
            self._seq_rm(self.mem, seq, n, -1)
            return n
        if snap is None or not snap[1] or snap[0] > n:
            return self._cut(seq, n)  # nothing to go back to: erased, caught up again later
        at, data, toks = snap
        self._replays.append((seq, at, data, toks[:n - at]))
        return n

    def settle(self) -> None:
        """After the step's verifies: the recurrent draft sequences that rejected drafts get
        their copied state back and decode the accepted drafts again, in one decode."""
        if not self._replays:
            return
        token, pos, n_seq_id, seq_id, logits = self._views
        flags = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        k = 0
        seqs = []
        for seq, at, data, toks in self._replays:
            src = (ctypes.c_uint8 * max(1, len(data))).from_buffer_copy(data or b"\0")
            if not lib.llama_state_seq_set_data_ext(self.ctx, src, len(data), seq, flags) or not self._seq_rm(
                    self.mem, seq, at, -1):
                self._seq_rm(self.mem, seq, -1, -1)  # cold: caught up again from the start
                continue
            seqs.append(seq)
            for j, t in enumerate(toks):
                token[k], pos[k], n_seq_id[k], logits[k] = t, at + j, 1, 0
                seq_id[k][0] = seq
                k += 1
        self._replays = []
        if k == 0:
            return
        self.batch.n_tokens = k
        if self._decode(self.ctx, self.batch) != 0:
            for seq in seqs:
                self._seq_rm(self.mem, seq, -1, -1)

    def undo(self, entries: Sequence[J.StepEntry], extent: dict[int, int]) -> None:
        """The target's decode failed: nothing of this step stays in the draft either."""
        self._snap.clear()
        for i in extent:
            e = entries[i]
            if extent[i] > e.draft_pos0:
                self._cut(e.seq, e.draft_pos0)


def draft_digest(path: str) -> str:
    """What a page's draft state was made with (actord/engine/weights.py's sampled digest of
    the draft model's weights). A wrong match would cost only acceptance (the target
    verifies every draft); a state of another shape is refused by libllama and starts cold."""
    from actord.engine.weights import weights_digest

    try:
        return weights_digest(path)
    except (OSError, ValueError):
        return ""


def open_drafter(config: Any, model: Any, vocab: Any, *, swa_full: bool, threads: int) -> Drafter | None:
    """The draft context `config` asks for, or None; a typed refusal when it cannot run."""
    mode = config.spec_mode
    if not mode:
        return None
    if mode == "mtp":  # engine/mtp.py
        raise InvalidParams("open_drafter opens a draft model; --spec mtp is engine/mtp.py's open_mtp")
    # A recurrent or hybrid target rolls rejected drafts back in the verify itself
    # (engine/step.py `_verify`); a sliding window that is not full cannot be cut at all.
    if int(lib.llama_model_n_swa(model)) > 0 and not swa_full:
        why = "a sliding-window cache that is not full (--swa-full on would allow it)"
        raise SpecUnsupported(
            f"speculative decoding needs a target whose memory can be cut back at any position; {config.model} "
            f"has {why}", model=config.model, reason=why)
    import os

    if not os.path.exists(config.spec_draft_model):
        raise InvalidParams(f"draft model file not found: {config.spec_draft_model}", path=config.spec_draft_model)
    # The draft keeps a full sliding window: its cache is cut back like the target's.
    params = context_params(config, threads=threads, swa_full=True)
    return Drafter(config.spec_draft_model, model, vocab, params, n_max=config.spec_n_max, p_min=config.spec_p_min)
