"""The step: one llama_decode over every slot's entry, then each sampling entry's token.

Owned by the engine (engine/engine.py), on the engine thread only, and the hot path: what it
costs per step is what actord adds to each decode (bench/hot_path.py). So the batch's
arrays are bound once and only what changed is written (`_batch_seq`, `_batch_one`), a
token's piece and eog flag are cached per token, greedy chains take one argmax over all
rows (sampling.py `greedy_rows`), and the rare paths (grammar, logprobs, a watch, drafts)
are tested once per entry. It decides nothing: which tokens go in is the step's plan
(serving/steps/core.py); what every engine promises about a step is engine/step_contract.py.

Speculation (engine/draft.py, engine/mtp.py) adds the draft's proposals to the batch and
`_verify` accepts them by the request's own chain (policy/speculation.py `accept`).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import msgspec

from actord.engine import jobs as J
from actord.engine.context import Context
from actord.engine.draft import Drafter
from actord.engine.genes import GeneCatalog
from actord.engine.llama import lib
from actord.engine.mtp import MtpDrafter
from actord.engine.sampling import Samplers
from actord.engine.state_copy import StateCopier
from actord.engine.step_contract import check_step, run_in_epoch
from actord.engine.vocab import Vocab
from actord.policy import speculation as S
from actord.vocabulary.errors import EngineError, KvCacheFull

_NO_REPLAY: list = []  # never appended to: a step without rollback "replay" shares it


def _one_ubatch(last_index: list[int], drafts: dict[int, list[int]], n_tokens: int, n_ubatch: int) -> bool:
    """Whether libllama decodes the batch as one ubatch: every decoded entry (its tokens and
    its drafts) as long as the others, all within n_ubatch (split_equal over unified KV).

    Why it matters to a verify on recurrent memory with rollback snapshots (rollback "rs"):
    the snapshots stay in the rows of the cell the sequence held when its ubatch ran, and a
    later ubatch of the same decode may move that sequence to another cell (the recurrent
    memory's find_slot gathers the ubatch's sequences into adjacent cells and swaps the
    others aside) without moving its snapshots; the rollback then reads another cell's rows
    (seed 4003 of the deeper hunt: a drafting sequence, then two others in a second ubatch).
    With more than one ubatch the step rolls back by "replay" instead (`_replay_accepted`)."""
    prev, size = 0, -1
    for i, idx in enumerate(last_index):
        if idx < 0:  # skipped, or sampled from a kept row: no rows in the batch
            continue
        end = idx + 1 + len(drafts.get(i, ()))
        if size < 0:
            size = end - prev
        elif end - prev != size:
            return False
        prev = end
    return n_tokens <= n_ubatch


class Stepper:
    """`step` (see the module docstring), and what steps leave behind: the step count and
    epoch, each sequence's last sampled token, the batch as last written, the records."""

    def __init__(self, context: Context, vocab: Vocab, samplers: Samplers, copier: StateCopier,
                 drafter: Drafter | MtpDrafter | None, genes: GeneCatalog, *, epoch: int = 0, step_no: int = 0,
                 records: collections.deque[J.StepRecord] | None = None, before_decode: Any = None,
                 keep_memo: bool = True) -> None:
        """`epoch`, `step_no`, `records`, `before_decode`: what a wake carries over (engine/sleep.py).
        `keep_memo`: keep prompts' last logits (Config.prompt_logits_memo)."""
        self.context, self.vocab, self.samplers, self.copier = context, vocab, samplers, copier
        self.drafter, self.genes = drafter, genes
        self.epoch = epoch  # bumped by a failed step: steps planned before it are skipped
        self.step_no = step_no
        self.before_decode = before_decode  # set by the engine thread: called right before llama_decode
        self.records = records if records is not None else collections.deque(maxlen=4096)
        self.last_sampled: dict[int, int] = {}  # seq -> its token sampled in the last step
        # seq -> (position, token, logits) of the last prompt token it decoded under a
        # MEMO_KEEP entry, while its cells up to that position are the ones that gave those
        # logits (`forget`, `copy_memo`: every job that cuts or replaces cells says so). A
        # MEMO_REUSE entry samples from them instead of decoding the token alone again: on
        # quantized CPU kernels a one-token batch rounds differently from the prompt's
        # batch, so a repeated prompt would otherwise answer differently from the first time.
        self.memo: dict[int, tuple[int, int, Any]] = {}
        self.keeps_memo = keep_memo and drafter is None  # a drafter follows every decoded row
        self._batch_seq = [-1] * context.n_batch  # seq_id[k][0] as `_step` last wrote it (-1: unknown)
        self._batch_one = 0  # n_seq_id[k] == 1 for every k below this
        self._replay: list[tuple[int, Any, list[int], int]] = _NO_REPLAY

    def step(self, job: J.Step) -> J.StepOut:
        return run_in_epoch(self, job, self._step)

    # -- the kept prompt logits (`memo`) ---------------------------------------------------

    def forget(self, seq: int, p0: int = -1) -> None:
        """Sequence `seq`'s cells from `p0` on (all: -1) are cut or replaced."""
        m = self.memo.get(seq)
        if m is not None and (p0 < 0 or p0 <= m[0]):
            del self.memo[seq]

    def copy_memo(self, src: int, dst: int, n: int = -1) -> None:
        """`dst`'s cells are now `src`'s first `n` (all: -1): it takes src's kept row with them."""
        self.memo.pop(dst, None)
        m = self.memo.get(src)
        if m is not None and (n < 0 or m[0] < n):
            self.memo[dst] = m

    def holds_memo(self, seq: int, pos: int, token: int) -> bool:
        """A MEMO_REUSE of `token` at `pos` would sample from a kept row (not on the backend:
        a backend-attached chain samples inside a decode)."""
        m = self.memo.get(seq)
        return (self.keeps_memo and m is not None and m[0] == pos and m[1] == token
                and seq not in self.samplers.backend_seqs)

    def _memo_row(self, e: J.StepEntry) -> Any:
        """The kept row a MEMO_REUSE entry samples from, or None: then its kept cell is cut and
        the token decoded again (its sampling runs on the backend; or the row is gone, which
        the slot's MemoHeld before it enrolled rules out: nothing else moves an enrolled
        sequence's cells)."""
        m = self.memo.get(e.seq)
        if (m is not None and self.keeps_memo and e.sample and m[0] == e.pos0 and len(e.tokens) == 1
                and m[1] == e.tokens[0] and not e.draft and not e.draft_tokens
                and e.seq not in self.samplers.backend_seqs):
            return m[2]
        self.memo.pop(e.seq, None)
        if not self.copier.seq_rm(e.seq, e.pos0, -1):
            raise EngineError("the memory refused to cut the kept prompt cell", seq=e.seq, pos=e.pos0)
        return None

    def _step(self, job: J.Step) -> J.StepOut:
        last = self.last_sampled
        c, smp, vocab = self.context, self.samplers, self.vocab
        fed_end, ends, end_tokens, text = smp.fed_end, smp.ends_on_eog, smp.end_tokens, vocab.known
        check_step(job, c.n_batch, c.n_seq_max, smp.chains, last, fed_end)
        self.genes.apply(job.genes)
        lib.check_owner()  # once per step: the hot loop below calls libllama unguarded
        # Speculation (engine/draft.py): the draft context catches up and proposes first.
        drafts: dict[int, list[int]] = {}
        extent: dict[int, int] = {}
        d = self.drafter
        if d is not None and (d.every_step or any(e.draft_tokens or e.draft for e in job.entries)):
            if self.before_decode is not None:  # the draft's decodes are this step's first
                self.before_decode()
            drafts, extent = d.draft(job.entries)
        token, position, n_seq_id, seq_id, logits = c.batch_views
        # What the batch already holds is not written again: every n_seq_id below the mark is
        # 1, and seq_id[k][0] is `held[k]` (libllama reads the batch, never writes it; a
        # steady decode puts each sequence at the same index step after step).
        held = self._batch_seq
        k = 0
        last_index: list[int] = []
        follow = d is not None and d.every_step  # the MTP head reads this decode's hidden rows
        spans: list[tuple[int, int]] = []  # each entry's first batch row and row count (MTP)
        skipped: set[int] | None = None  # entries not decoded (their request ended at a token fed)
        kept: dict[int, Any] | None = None  # entries sampled from a kept prompt row, not decoded (`memo`)
        memo = self.memo
        for i, e in enumerate(job.entries):
            pos = e.pos0
            seq = e.seq
            start = k
            if e.feed_last:  # one token, the one this sequence sampled last step
                if seq in fed_end:
                    if skipped is None:
                        skipped = set()
                    skipped.add(i)
                    last_index.append(-1)
                    continue
                tok = token[k] = last[seq]
                if d is None:  # (a drafter's context follows every fed token: nothing skipped)
                    if seq in ends:
                        known = text.get(tok)
                        if known is not None and known[1]:  # ends its request: later feeds are skipped
                            fed_end.add(seq)
                    if end_tokens and tok in end_tokens.get(seq, ()):
                        fed_end.add(seq)
                position[k] = pos
                if held[k] != seq:
                    seq_id[k][0] = held[k] = seq
                logits[k] = e.sample
                last_index.append(k)
                k += 1
                pos += 1
            else:
                if fed_end and seq in fed_end:  # new tokens for the sequence: a new request's
                    fed_end.discard(seq)
                if e.memo == J.MEMO_REUSE:
                    r = self._memo_row(e)
                    if r is not None:
                        if kept is None:
                            kept = {}
                        kept[i] = r
                        last_index.append(-2)
                        continue
                elif memo and seq in memo and memo[seq][0] >= pos:  # its kept row's cells are rewritten
                    del memo[seq]
                for t in e.tokens:
                    token[k] = t
                    position[k] = pos
                    if held[k] != seq:
                        seq_id[k][0] = held[k] = seq
                    logits[k] = 0
                    pos += 1
                    k += 1
                if e.sample:
                    logits[k - 1] = 1
                last_index.append(k - 1)
            if drafts and i in drafts:  # verified in this same decode: logits on each
                for t in drafts[i]:
                    token[k], position[k], logits[k] = t, pos, 1
                    if held[k] != seq:
                        seq_id[k][0] = held[k] = seq
                    pos += 1
                    k += 1
            if follow:
                spans.append((start, k - start))
        if k > self._batch_one:
            for j in range(self._batch_one, k):
                n_seq_id[j] = 1
            self._batch_one = k
        c.batch.n_tokens = k
        # Rollback "replay": the recurrent state of each drafting sequence before the verify.
        saved = {i: self.copier.state_get(job.entries[i].seq, True).data for i in drafts} if (
            drafts and (c.rollback == "replay" or c.rollback == "rs" and not _one_ubatch(last_index, drafts, k, c.n_ubatch))
        ) else {}
        if self.before_decode is not None:
            self.before_decode()
        t0 = time.perf_counter()
        rc = c.decode(c.ctx, c.batch) if k else 0  # (every entry skipped: nothing to decode)
        t1 = time.perf_counter()
        if rc != 0 and extent:
            self.drafter.undo(job.entries, extent)  # type: ignore[union-attr]
        if rc == 1:  # no cells for this batch; libllama left the memory as it was
            raise KvCacheFull("llama_decode found no free KV cells for the step", rc=rc, n_tokens=k)
        if rc != 0:
            raise EngineError("llama_decode failed", rc=rc, n_tokens=k)
        if follow:
            d.decoded(job.entries, spans, token)  # type: ignore[union-attr]
        self._replay = [] if saved else _NO_REPLAY
        out: list[J.EntryOut] = []
        last.clear()
        sample, ctx, chains = c.sample, c.ctx, smp.chains
        grammars, logprobs, watches, greedy = smp.grammars, smp.logprobs, smp.watches, smp.greedy
        EntryOut = J.EntryOut
        # Without drafts the logit rows are the sampling entries' in order: greedy-only chains
        # take their tokens from one argmax over those rows.
        argmax: list[int] | None = None
        row = 0
        if greedy and not drafts:
            n_out, use = 0, False
            for i, e in enumerate(job.entries):
                if e.sample and not (skipped and i in skipped) and not (kept and i in kept):
                    if not (e.feed_last or e.tokens):  # (its logits flag lands on another's token)
                        use = False
                        break
                    n_out += 1
                    use = use or e.seq in greedy
            if use:
                argmax = smp.greedy_rows(n_out)
        for i, (e, idx) in enumerate(zip(job.entries, last_index)):
            if idx < 0:
                if idx == -2:
                    out.append(self._sample_kept(e, kept[i]))  # type: ignore[index]
                    continue
                out.append(EntryOut(seq=e.seq, skipped=True))
                continue
            if drafts and i in drafts:
                out.append(self._verify(e, idx, drafts[i], extent[i], saved.get(i)))
                continue
            if e.checkpoint:
                ckpt, ckpt_pos = self.copier.state_get(e.seq, True).data, e.pos0 + len(e.tokens) + e.feed_last
            else:
                ckpt, ckpt_pos = None, 0
            if e.sample:
                seq = e.seq
                if e.memo and self.keeps_memo and seq not in smp.backend_seqs:  # a prompt's last row, kept
                    memo[seq] = (e.pos0 + len(e.tokens) - 1, e.tokens[-1], smp.row(idx).copy())
                grammar, n_top = seq in grammars, logprobs.get(seq)
                refused = ""
                if grammar:
                    tok, refused = smp.sample_constrained(seq, idx, smp.row(idx))
                elif argmax is not None and seq in greedy:
                    tok = argmax[row]
                else:
                    tok = sample(chains[seq], ctx, idx)
                row += 1
                last[seq] = tok
                known = text.get(tok)
                if known is None:
                    known = vocab.learn(tok)
                piece = known[0]
                if watches and seq in watches:  # a lazy grammar or preserved tokens (tool calls)
                    piece = smp.watch(seq, watches[seq], tok, piece)
                if n_top is None and not refused:  # the common case: no extras to build
                    out.append(EntryOut(seq, tok, piece, known[1], ckpt, ckpt_pos))
                else:
                    if n_top is None:
                        lp, top = None, []
                    elif seq in smp.post_probs:  # post_sampling: the chain's candidates
                        lp, top = smp.post_probs_of(tok, n_top)
                    else:
                        lp, top = smp.logprobs_of(idx, tok, n_top)
                    out.append(EntryOut(seq=seq, token=tok, piece=piece, eog=known[1], checkpoint=ckpt,
                                        checkpoint_pos=ckpt_pos, logprob=lp, top=top, refused=refused))
            else:
                out.append(EntryOut(seq=e.seq, checkpoint=ckpt, checkpoint_pos=ckpt_pos))
        if self._replay:
            self._replay_accepted()
        if d is not None:
            d.settle()
        for i, n in extent.items():  # entries that touched the draft but did not draft
            if i not in drafts:
                out[i] = msgspec.structs.replace(out[i], draft_n=n)
        t2 = time.perf_counter()
        self.step_no += 1
        self.records.append(J.StepRecord(
            step=self.step_no, seqs=[e.seq for e in job.entries], n_tokens=k, genes=job.genes,
            drafts=[drafts.get(i, []) for i in range(len(job.entries))] if drafts else [],
            draft_in=sum(len(e.draft_tokens) for e in job.entries) if extent else 0,
        ))
        return J.StepOut(
            step=self.step_no, entries=out, n_tokens=k,
            t_decode_ms=(t1 - t0) * 1e3, t_sample_ms=(t2 - t1) * 1e3, epoch=self.epoch,
        )

    def _sample_kept(self, e: J.StepEntry, row: Any) -> J.EntryOut:
        """A MEMO_REUSE entry's sample from its kept row, by the request's own chain (its
        grammar, its logprobs), as `_step` samples a decoded row; a checkpoint asked after
        the token is the sequence's state as it stands (the kept cell is that token's)."""
        seq, smp, vocab = e.seq, self.samplers, self.vocab
        ckpt, ckpt_pos = (self.copier.state_get(seq, True).data, e.pos0 + 1) if e.checkpoint else (None, 0)
        tok, refused = smp.sample_constrained(seq, -1, row)
        self.last_sampled[seq] = tok
        known = vocab.known.get(tok)
        if known is None:
            known = vocab.learn(tok)
        piece = known[0]
        if seq in smp.watches:
            piece = smp.watch(seq, smp.watches[seq], tok, piece)
        n_top = smp.logprobs.get(seq)
        if n_top is None:
            lp, top = None, []
        elif seq in smp.post_probs:
            lp, top = smp.post_probs_of(tok, n_top)
        else:
            lp, top = smp.logprobs_of_row(row, tok, n_top)
        return J.EntryOut(seq=seq, token=tok, piece=piece, eog=known[1], checkpoint=ckpt, checkpoint_pos=ckpt_pos,
                          logprob=lp, top=top, refused=refused)

    def _verify(self, e: J.StepEntry, idx: int, draft: list[int], extent: int, saved: Any = None) -> J.EntryOut:
        """A drafted entry after the decode: the request's own sampling (its chain, its
        grammar, its logprobs: as the plain path in `_step`) runs at each position in order
        while it picks the draft (policy/speculation.py `accept`); the rejected positions leave the
        target's and the draft's memory in this same job.

        How the target takes them back (`Context.rollback`): attention memory cuts them
        (seq_rm). Recurrent or hybrid memory with n_rs_seq >= k (qwen35) cuts them too: the
        state rolled back to is the one after the entry's own token or an accepted draft,
        all of them in the batch just decoded, whose last k + 1 tokens libllama keeps in one
        ubatch with a snapshot after each (llama_memory_recurrent::seq_rm, split_equal's
        n_keep_tail): the one place that rollback is right (tests/serving/test_recurrent_rollback.py).
        Recurrent memory without snapshots (mamba2: llm_arch_supports_rs_rollback is false)
        restores the recurrent state copied before the verify and decodes the entry's tokens
        and the accepted drafts again, after every entry of the step has sampled
        (`_replay_accepted`)."""
        seq, text, smp, c = e.seq, self.vocab.known, self.samplers, self.context
        chain, constrained, n_top = smp.chains[seq], seq in smp.grammars, smp.logprobs.get(seq)
        refused: dict[int, str] = {}

        def known(tok: int) -> tuple[bytes, bool]:
            k = text.get(tok)
            return k if k is not None else self.vocab.learn(tok)

        def sample(j: int) -> int:
            if not constrained:
                return int(c.sample(chain, c.ctx, idx + j))
            tok, why = smp.sample_constrained(seq, idx + j, smp.row(idx + j))
            if why:
                refused[j] = why
            return tok

        toks = S.accept(draft, sample, lambda t: known(t)[1] or bool(refused))
        keep = e.pos0 + len(e.tokens) + len(toks) - 1  # the entry's tokens and the accepted drafts
        if len(toks) - 1 < len(draft):
            if saved is not None:
                self._replay.append((seq, saved, list(e.tokens) + draft[:len(toks) - 1], e.pos0))
            elif not lib.llama_memory_seq_rm(c.mem, seq, keep, -1):
                raise EngineError("the target refused to cut back a rejected draft", seq=seq, pos=keep)
        n = self.drafter.keep(seq, keep, extent)  # type: ignore[union-attr]
        self.last_sampled[seq] = toks[-1]
        rows = []
        for j, t in enumerate(toks):
            piece, eog = known(t)
            lp, top = smp.logprobs_of(idx + j, t, n_top) if n_top is not None else (None, [])
            rows.append(J.Sampled(token=t, piece=piece, eog=eog, logprob=lp, top=top, refused=refused.get(j, "")))
        f = rows[0]
        return J.EntryOut(seq=seq, token=f.token, piece=f.piece, eog=f.eog, logprob=f.logprob, top=f.top,
                          refused=f.refused, draft_n=n, drafted=len(draft), more=rows[1:])

    def _replay_accepted(self) -> None:
        """Rollback "replay": each sequence that rejected drafts gets back the recurrent
        state it had before the verify, is cut there (its attention part, on hybrid memory),
        and decodes the entry's tokens and its accepted drafts again, all in one decode
        without outputs. Runs after every entry sampled: the decode replaces the logits."""
        c = self.context
        token, position, n_seq_id, seq_id, logits = c.batch_views
        k = 0
        for seq, state, toks, pos0 in self._replay:
            self.copier.state_set(seq, state, True)
            if not lib.llama_memory_seq_rm(c.mem, seq, pos0, -1):
                raise EngineError("the target refused to cut back to its state before a verify", seq=seq, pos=pos0)
            for j, t in enumerate(toks):
                token[k], position[k], n_seq_id[k], logits[k] = t, pos0 + j, 1, 0
                seq_id[k][0] = self._batch_seq[k] = seq  # `_step` trusts what it last wrote
                k += 1
        self._replay = []
        c.batch.n_tokens = k
        rc = c.decode(c.ctx, c.batch)
        if rc != 0:
            raise EngineError("decoding the accepted drafts again failed", rc=rc, n_tokens=k)
