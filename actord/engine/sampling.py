"""The engine's sampling: one libllama sampler chain per sequence, the grammar check,
logprobs. Owned by the engine (engine/engine.py), on the engine thread only.

Kept apart from the step because it is its own policy-free mechanism with its own costs:
grammar is checked on the token the chain picked and the whole vocabulary is masked only
when the grammar refuses it (llama-server's order; masking 262k logits per token first cost
2.7-4.1x a Gemma 3 270M step), and logprobs are computed with numpy only when asked.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import time
from typing import Any

import numpy as np

from actord.engine import backend_sampling as BS
from actord.engine import jobs as J
from actord.engine.context import Context
from actord.engine.llama import lib
from actord.engine.vocab import Vocab
from actord.vocabulary.errors import InvalidParams
from actord.vocabulary.log import get

log = get("actord.engine")

MASK_BUDGET_VOCAB = 65536  # grammar_token_budget_ms is a mask's over this many candidates
CUT_GRAMMARS_KEPT = 256  # digests of grammars cut for their cost, refused up front when sent again


class Watch:
    """One sequence's lazy grammar (waiting for a trigger) and preserved control tokens."""

    __slots__ = ("pending", "triggers", "window", "head_open", "keep", "preserve")

    def __init__(self, pending: Any, triggers: tuple[tuple[bytes, bool], ...], preserve: frozenset[int]) -> None:
        self.pending = pending  # the grammar sampler, not applied until a trigger shows
        self.triggers = triggers
        self.window = bytearray()  # the output so far while its head may open with a trigger, else its tail
        self.head_open = any(at for _, at in triggers)
        self.keep = max((len(t) for t, _ in triggers), default=1) - 1
        self.preserve = preserve


class Samplers:
    """Every sequence's sampler chain and what sampling under it needs (see the module
    docstring): the chains, their grammars, lazy grammars and logprobs, which sequences end
    at which tokens, and the one candidate buffer."""

    def __init__(self, config: Any, context: Context, vocab: Vocab, *, backend_sampling: bool) -> None:
        self.config = config
        self.context = context
        self.vocab = vocab
        self.n_vocab = vocab.n_tokens
        self.chains: dict[int, Any] = {}  # seq -> its sampler chain
        self.backend_sampling = backend_sampling  # attach eligible chains to the backend (engine/backend_sampling.py)
        self.backend_seqs: set[int] = set()  # the sequences whose chain is attached
        self.greedy: set[int] = set()  # seqs whose chain is greedy alone (`greedy_rows`)
        self.post_probs: set[int] = set()  # seqs whose logprobs are read after the chain (post_sampling)
        # Seqs whose request ends at an end-of-generation token (SamplingParams.end_on_eog) or
        # at one of its stop tokens (end_tokens), and those fed such a token by a feed_last
        # entry: their later feed_last entries are skipped (planned blind at depth >= 3), so
        # the KV ends there as at depth 2.
        self.ends_on_eog: set[int] = set()
        self.end_tokens: dict[int, frozenset[int]] = {}
        self.fed_end: set[int] = set()
        self.logprobs: dict[int, int] = {}  # seq -> top_logprobs asked (absent: none)
        self.grammars: dict[int, Any] = {}  # seq -> its grammar sampler, beside its chain
        self.watches: dict[int, Watch] = {}  # seq -> its lazy grammar / preserved tokens
        self.grammar_first = False  # bench seam: apply the grammar to every candidate, every token
        self.grammar_samples = 0  # constrained samples, and those that masked the whole vocabulary
        self.grammar_masked = 0
        self.grammar_cut = 0  # grammars cut for their cost per token (`_cut_grammar`)
        self.seq_grammar: dict[int, bytes] = {}  # seq -> its grammar's digest
        self.cut_grammars: dict[bytes, None] = {}  # digests of grammars cut, oldest first
        self._cand: Any = None
        self._ids: Any = None

    def close(self) -> None:
        for seq in list(self.chains):
            self.free_sampler(seq)

    def set_sampler(self, seq: int, p: J.SamplingParams) -> None:
        """Build sequence `seq`'s sampler chain (see J.SamplingParams for the order).

        Built whole before the old chain is freed: a grammar that does not parse or a bias
        on a token the vocab lacks is an InvalidParams and leaves the sequence as it was."""
        self.context.check_seq(seq)
        n_vocab = self.n_vocab
        for tok, _ in p.logit_bias:
            if not 0 <= tok < n_vocab:
                raise InvalidParams(f"logit_bias names token {tok}, outside the vocab [0, {n_vocab})",
                                    param="logit_bias", token=tok)
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        grammar: Any = None
        add = lib.llama_sampler_chain_add
        try:
            if p.grammar:
                digest = hashlib.blake2b(p.grammar.encode(), digest_size=16).digest()
                if digest in self.cut_grammars:
                    raise InvalidParams("grammar: this grammar was cut for its sampling cost before "
                                        "(grammar_token_budget_ms)", param="grammar")
                # Kept beside the chain, not in it: see `sample_constrained`.
                grammar = lib.llama_sampler_init_grammar(self.vocab.vocab, p.grammar.encode(), b"root")
                if not grammar:
                    raise InvalidParams("the grammar does not parse (GBNF with a 'root' rule expected)",
                                        param="grammar")
            if p.logit_bias:
                arr = (lib.llama_logit_bias * len(p.logit_bias))()
                for i, (tok, bias) in enumerate(p.logit_bias):
                    arr[i].token, arr[i].bias = tok, bias
                add(chain, lib.llama_sampler_init_logit_bias(n_vocab, len(p.logit_bias), arr))
            if p.penalty_last_n and (p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
                # Fed by the chain's accept: only the tokens this request samples count.
                add(chain, lib.llama_sampler_init_penalties(
                    n_vocab, p.penalty_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty))
            if p.temperature <= 0:
                add(chain, lib.llama_sampler_init_greedy())
            else:
                if p.top_k > 0:
                    add(chain, lib.llama_sampler_init_top_k(p.top_k))
                if p.top_p < 1.0:
                    add(chain, lib.llama_sampler_init_top_p(p.top_p, 1))
                if p.min_p > 0.0:
                    add(chain, lib.llama_sampler_init_min_p(p.min_p, 1))
                add(chain, lib.llama_sampler_init_temp(p.temperature))
                add(chain, lib.llama_sampler_init_dist(p.seed & 0xFFFFFFFF))
            # Greedy alone (no biases, no penalties): the step takes the row's argmax (`greedy_rows`).
            greedy = p.temperature <= 0 and lib.llama_sampler_chain_n(chain) == 1
            post = p.post_sampling and p.top_logprobs >= 0
        except BaseException:
            lib.llama_sampler_free(chain)
            if grammar:
                lib.llama_sampler_free(grammar)
            raise
        self.free_sampler(seq)
        self.chains[seq] = chain
        if p.end_on_eog:
            self.ends_on_eog.add(seq)
        if p.end_tokens:
            self.end_tokens[seq] = frozenset(p.end_tokens)
        if self.backend_sampling and BS.eligible(p) and BS.attach(self.context.ctx, seq, chain):
            self.backend_seqs.add(seq)
        elif greedy and not post:
            self.greedy.add(seq)
        preserve = frozenset(self._special_token(t) for t in p.preserve) - {-1}
        if grammar and p.grammar_triggers:
            self.watches[seq] = Watch(grammar, tuple((t.encode(), at) for t, at in p.grammar_triggers), preserve)
        elif grammar:
            self.grammars[seq] = grammar
            self.seq_grammar[seq] = digest
        if post:
            self.post_probs.add(seq)
            # None: no grammar, but sampled through the candidate array, on the path a
            # grammar takes (so the other sequences' path is unchanged).
            self.grammars.setdefault(seq, None)
        if preserve and seq not in self.watches:
            self.watches[seq] = Watch(None, (), preserve)
        if p.top_logprobs >= 0:
            self.logprobs[seq] = min(p.top_logprobs, n_vocab)
        else:
            self.logprobs.pop(seq, None)

    def free_sampler(self, seq: int) -> None:
        self.greedy.discard(seq)
        self.post_probs.discard(seq)
        self.ends_on_eog.discard(seq)
        self.end_tokens.pop(seq, None)
        self.fed_end.discard(seq)
        if seq in self.backend_seqs:
            self.backend_seqs.discard(seq)
            BS.detach(self.context.ctx, seq)
        self.seq_grammar.pop(seq, None)
        for table in (self.chains, self.grammars):
            smpl = table.pop(seq, None)
            if smpl:
                lib.llama_sampler_free(smpl)
        w = self.watches.pop(seq, None)
        if w is not None and w.pending is not None:
            lib.llama_sampler_free(w.pending)
        self.logprobs.pop(seq, None)

    def _special_token(self, text: str) -> int:
        """The control token whose text is `text`, or -1 (none, or its text shows anyway)."""
        toks = self.vocab.tokenize(text, False, True)
        if len(toks) != 1 or self.vocab.piece(toks[0], False) == self.vocab.piece(toks[0], True):
            return -1
        return toks[0]

    def watch(self, seq: int, w: Watch, tok: int, piece: bytes) -> bytes:
        """After sequence `seq` sampled `tok` (unconstrained or under its grammar): its piece
        as the output shows it, and its lazy grammar started when a trigger just showed.

        The grammar is fed the output from the trigger's first byte, tokenized, each token
        checked before it is accepted (libllama aborts the process on a token its grammar
        refuses): output the grammar cannot take leaves the sequence unconstrained (the
        parser then keeps that text as text). Cost while waiting: one append and a find in
        a window of the longest trigger's length, per token."""
        if tok in w.preserve:
            piece = self.vocab.piece(tok, True)
        if w.pending is None:
            return piece
        win = w.window
        win += piece
        hit = -1
        if w.head_open:
            head = bytes(win).lstrip(b" \t\r\n")
            still = False
            for trig, at in w.triggers:
                if not at:
                    continue
                if head.startswith(trig):
                    hit = len(win) - len(head)
                elif trig.startswith(head):
                    still = True
            w.head_open = still and hit < 0
        for trig, at in w.triggers:
            if not at:
                i = win.find(trig)
                if i >= 0 and (hit < 0 or i < hit):
                    hit = i
        if hit < 0:
            if not w.head_open and len(win) > w.keep:
                del win[:len(win) - w.keep]
            return piece
        grammar, w.pending = w.pending, None
        fed = self.vocab.tokenize(bytes(win[hit:]).decode("utf-8", "ignore"), False, True)
        for t in fed:
            if not self._allows(grammar, t):
                lib.llama_sampler_free(grammar)
                break
            lib.llama_sampler_accept(grammar, t)
        else:
            self.grammars[seq] = grammar
        if not w.preserve:
            del self.watches[seq]
        return piece

    def greedy_rows(self, n_out: int) -> list[int] | None:
        """The argmax of each of the last decode's `n_out` logit rows (llama.h: the rows of
        the tokens with logits on, in batch order), what a greedy-only chain samples: its
        llama_sampler_greedy picks the first largest logit, as argmax does, and its accept
        keeps no state. One vectorized pass instead of a llama_sampler_sample call (and its
        n_vocab candidates) per row."""
        addr = ctypes.cast(self.context.get_logits(self.context.ctx), ctypes.c_void_p).value
        n_vocab = self.n_vocab
        end = ctypes.cast(self.context.get_logits_ith(self.context.ctx, -1), ctypes.c_void_p).value  # the last row
        if not addr or end != addr + (n_out - 1) * n_vocab * 4:
            return None  # not the rows counted: each entry samples through its chain
        rows = np.frombuffer((ctypes.c_float * (n_out * n_vocab)).from_address(addr), dtype=np.float32)
        return rows.reshape(n_out, n_vocab).argmax(axis=1).tolist()

    def row(self, idx: int) -> Any:
        """Batch row `idx`'s logits as a numpy view (no copy)."""
        return np.ctypeslib.as_array(lib.llama_get_logits_ith(self.context.ctx, idx), shape=(self.n_vocab,))

    def _candidates(self) -> tuple[Any, Any, Any, Any, Any, Any]:
        """The engine's one candidate buffer (n_vocab llama_token_data, with a numpy view) and
        a one-token array for grammar checks; made on the first constrained sample."""
        if self._cand is None:
            n_vocab = self.n_vocab
            data = (lib.llama_token_data * n_vocab)()
            assert ctypes.sizeof(lib.llama_token_data) == 12
            view = np.frombuffer(data, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
            ptr = ctypes.cast(data, ctypes.POINTER(lib.llama_token_data))
            cur = lib.llama_token_data_array(data=ptr, size=n_vocab, selected=-1, sorted=False)
            one_data = (lib.llama_token_data * 1)()
            one = lib.llama_token_data_array(data=ctypes.cast(one_data, ctypes.POINTER(lib.llama_token_data)),
                                             size=1, selected=-1, sorted=False)
            self._cand = (data, view, cur, one_data, one, ptr)
            self._ids = np.arange(n_vocab, dtype=np.int32)
        return self._cand

    def _allows(self, grammar: Any, tok: int) -> bool:
        _, _, _, one_data, one, _ = self._candidates()
        one_data[0].id, one_data[0].logit, one_data[0].p = tok, 1.0, 0.0
        one.size, one.selected, one.sorted = 1, -1, False
        lib.llama_sampler_apply(grammar, ctypes.byref(one))
        return bool(one_data[0].logit != -math.inf)

    def sample_constrained(self, seq: int, idx: int, row: Any) -> tuple[int, str]:
        """Sample under sequence `seq`'s grammar, as llama-server's common_sampler does.

        Applying a grammar to the whole vocabulary costs far more than a decode on a large
        vocab (262,144 tokens for Gemma 3: bench/sampling_cost.py), so the chain samples
        first and the grammar checks only that one token; only when it refuses is the
        grammar applied to every candidate and the chain run again on what it allows.
        Under greedy decoding this picks exactly what grammar-first would; under
        temperature it is rejection sampling, which draws from the grammar-masked
        distribution too (top_k/top_p truncate before the mask on the fast path).

        A token the grammar refuses is never accepted into it (libllama aborts the process
        on that): when nothing the grammar allows survives the chain (a logit_bias banning
        every token the grammar allows), the request ends with an error instead."""
        chain, grammar = self.chains[seq], self.grammars.get(seq)
        _, view, cur, _, _, ptr = self._candidates()

        def run(first: Any = None) -> int:
            view["id"] = self._ids
            view["logit"] = row
            view["p"] = 0.0
            # A sampler may have pointed `data` at its own buffer: ours again, whole.
            cur.data, cur.size, cur.selected, cur.sorted = ptr, len(self._ids), -1, False
            if first is not None:
                lib.llama_sampler_apply(first, ctypes.byref(cur))
            lib.llama_sampler_apply(chain, ctypes.byref(cur))
            return int(cur.data[cur.selected].id) if 0 <= cur.selected < cur.size else -1

        if grammar is None:  # post_sampling or a kept row, without a grammar: the chain on our array
            tok = run()
            if tok < 0:
                return 0, "the samplers left no token (logit_bias banned every one)"
            lib.llama_sampler_accept(chain, tok)
            return tok, ""
        # The engine thread's CPU time, not the wall clock: a grammar's cost is CPU, and a
        # busy machine's preemption (other processes, a test suite beside it) is not the
        # grammar's to pay. Seen in CI: a plain JSON schema's token at 303 ms wall.
        t0 = time.thread_time()
        budget = self.config.grammar_token_budget_ms
        tok = -1 if self.grammar_first else run()
        self.grammar_samples += 1
        if tok < 0 or not self._allows(grammar, tok):
            self.grammar_masked += 1
            # A mask tests every candidate against every parse stack: its budget scales
            # with the vocabulary (a 262k-token one masks in ~140 ms under a plain grammar).
            budget *= max(1.0, self.n_vocab / MASK_BUDGET_VOCAB)
            tok = run(grammar)
            if tok < 0 or not self._allows(grammar, tok):
                return max(tok, 0), "the grammar allows no token that the other samplers (logit_bias) leave"
        lib.llama_sampler_accept(grammar, tok)
        lib.llama_sampler_accept(chain, tok)
        ms = (time.thread_time() - t0) * 1e3
        if ms > budget:
            return tok, self._cut_grammar(seq, grammar, ms, budget)
        return tok, ""

    def _cut_grammar(self, seq: int, grammar: Any, ms: float, budget: float) -> str:
        """Sequence `seq`'s grammar cost `ms` for one token, over the per-token budget: it is
        freed (what the sequence samples until its request ends is unconstrained) and the
        request ends with the reason. An ambiguous grammar (one whose parse stacks double
        at every `[`) doubles its cost each token, so the one cut costs at most about twice
        the budget and all before it about as much again: a bound per request, where
        letting it run held both slots for minutes (issue 33)."""
        lib.llama_sampler_free(grammar)
        self.grammars[seq] = None  # on the candidate-array path, unconstrained, till the request ends
        self.grammar_cut += 1
        digest = self.seq_grammar.pop(seq, None)
        if digest is not None:  # the same grammar again is refused before it runs (`set_sampler`)
            self.cut_grammars[digest] = None
            while len(self.cut_grammars) > CUT_GRAMMARS_KEPT:
                del self.cut_grammars[next(iter(self.cut_grammars))]
        log.warning("engine.grammar_cut", seq=seq, ms=round(ms, 1), budget_ms=round(budget, 1))
        return (f"grammar: sampling one token under it took {ms:.0f} ms, over its budget of {budget:.0f} ms "
                "(grammar_token_budget_ms); an ambiguous grammar's cost doubles with each token")

    def post_probs_of(self, tok: int, k: int) -> tuple[float, list[tuple[int, float, bytes]]]:
        """After `sample_constrained`: the log of `tok`'s probability among the candidates
        the chain left, and the `k` likeliest of them (none with probability 0), as
        llama-server's post_sampling_probs reads its sampler's candidates. A chain that picks
        without computing probabilities (greedy) gives its pick probability 1."""
        cur = self._cand[2]
        n = int(cur.size)
        addr = ctypes.cast(cur.data, ctypes.c_void_p).value
        view = np.frombuffer((lib.llama_token_data * n).from_address(addr),
                             dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
        p = view["p"]
        if not p.any():
            return 0.0, [(tok, 0.0, self.vocab.piece(tok))][:k]
        hit = np.flatnonzero(view["id"] == tok)
        lp = math.log(float(p[hit[0]])) if hit.size and p[hit[0]] > 0 else -math.inf
        k = min(k, n)
        best = np.argpartition(-p, k - 1)[:k] if 0 < k < n else np.arange(n if k else 0)
        best = best[np.argsort(-p[best], kind="stable")]
        return lp, [(int(view["id"][i]), math.log(float(p[i])), self.vocab.piece(int(view["id"][i])))
                    for i in best if p[i] > 0]

    def logprobs_of(self, idx: int, tok: int, k: int) -> tuple[float, list[tuple[int, float, bytes]]]:
        """Log-softmax of batch row `idx`'s raw logits: `tok`'s value and the top `k`'s.

        numpy over the row in place (no copy): one max, one exp-sum, one argpartition."""
        return self.logprobs_of_row(self.row(idx), tok, k)

    def logprobs_of_row(self, row: Any, tok: int, k: int) -> tuple[float, list[tuple[int, float, bytes]]]:
        """`logprobs_of` over a row of logits given (a kept one: engine/step.py `memo`)."""
        n_vocab = self.n_vocab
        m = float(row.max())
        lse = m + float(np.log(np.exp(row - m, dtype=np.float32).sum(dtype=np.float64)))
        top: list[tuple[int, float, bytes]] = []
        if k > 0:
            best = np.argpartition(row, n_vocab - k)[n_vocab - k:] if k < n_vocab else np.arange(n_vocab)
            best = best[np.argsort(-row[best], kind="stable")]
            top = [(int(t), float(row[t]) - lse, self.vocab.piece(int(t))) for t in best]
        return float(row[tok]) - lse, top
