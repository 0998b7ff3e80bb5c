"""The engine: mechanism only, and only ever on the engine thread.

It owns the model, one context with `n_seq_max = slots` and a unified KV cache, one sampler
chain per sequence, the reusable llama_batch and (see genes.py) the LoRA adapters. Every
method here runs on the engine thread; `handle` maps a typed job to a typed result. It
never decides anything: which tokens go into a step, which state to copy and when is the
actors' business.
"""

from __future__ import annotations

import collections
import ctypes
import math
import os
import time
from typing import Any

import numpy as np

from actord.config import Config, engine_threads
from actord.engine import jobs as J
from actord.engine.genes import GeneCatalog
from actord.engine.llama import lib
from actord.errors import ActordError, EngineError, InvalidParams, KvCacheFull, PageDoesNotFit, StepSkipped
from actord.policy.swa import choose_swa_full

_log_cb: Any = None


def _silence_llama_logs() -> None:
    global _log_cb
    if _log_cb is None:
        _log_cb = lib.llama_log_callback(lambda level, text, data: None)
        lib.llama_log_set(_log_cb, ctypes.c_void_p())


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


class Engine:
    def __init__(self, config: Config) -> None:
        if not os.path.exists(config.model):
            raise InvalidParams(f"model file not found: {config.model}", path=config.model)
        _silence_llama_logs()
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(config.model.encode(), mparams)
        if not self.model:
            raise EngineError(f"could not load model {config.model}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.kv_bytes_per_token = self._kv_bytes_per_token()
        n_swa = int(lib.llama_model_n_swa(self.model)) if hasattr(lib, "llama_model_n_swa") else 0
        self.swa = choose_swa_full(
            config.swa_full, n_swa=n_swa, bytes_per_token=self.kv_bytes_per_token, n_ctx=config.ctx,
            device_bytes=config.device_bytes, host_bytes=_host_bytes(), share=config.swa_full_share,
        )
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = config.ctx
        cparams.n_batch = config.batch
        cparams.n_ubatch = config.batch
        cparams.n_seq_max = config.slots
        threads = engine_threads(config.threads)
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True
        cparams.swa_full = self.swa.full
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise EngineError("could not create a llama context (ctx too large?)")
        self.mem = lib.llama_get_memory(self.ctx)
        self.swa_full = self.swa.full
        self.n_ctx = lib.llama_n_ctx(self.ctx)
        self.n_batch = lib.llama_n_batch(self.ctx)
        self.n_seq_max = config.slots
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.samplers: dict[int, Any] = {}
        self.logprobs: dict[int, int] = {}  # seq -> top_logprobs asked (absent: none)
        self.grammars: dict[int, Any] = {}  # seq -> its grammar sampler, beside its chain
        self.grammar_first = False  # bench seam: apply the grammar to every candidate, every token
        self.grammar_samples = 0  # constrained samples, and those that masked the whole vocabulary
        self.grammar_masked = 0
        self._cand: Any = None
        self._ids: Any = None
        self.genes = GeneCatalog(self.model, self.ctx)
        self.step_no = 0
        self.epoch = 0  # bumped by a failed step: steps planned before it are skipped
        self.last_sampled: dict[int, int] = {}  # seq -> its token sampled in the last step
        self.records: collections.deque[J.StepRecord] = collections.deque(maxlen=4096)
        self._piece_buf = ctypes.create_string_buffer(256)
        self.props = self._props()

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        for seq in list(self.samplers):
            self._free_sampler(seq)
        self.genes.close()
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)
        self.ctx = self.model = None

    def _props(self) -> J.ModelProps:
        n_swa = int(lib.llama_model_n_swa(self.model)) if hasattr(lib, "llama_model_n_swa") else 0
        recurrent = bool(lib.llama_model_is_recurrent(self.model))
        hybrid = bool(lib.llama_model_is_hybrid(self.model)) if hasattr(lib, "llama_model_is_hybrid") else False
        desc = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self.model, desc, 256)
        return J.ModelProps(
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_seq_max=self.n_seq_max,
            n_vocab=lib.llama_vocab_n_tokens(self.vocab),
            n_ctx_train=lib.llama_model_n_ctx_train(self.model),
            n_swa=n_swa,
            recurrent=recurrent,
            hybrid=hybrid,
            # Memory that cannot be cut back to an arbitrary position needs checkpoints.
            needs_checkpoints=recurrent or hybrid or (n_swa > 0 and not self.swa_full),
            bos=lib.llama_vocab_bos(self.vocab),
            eos=lib.llama_vocab_eos(self.vocab),
            desc=desc.value.decode(errors="replace"),
            swa_full=self.swa_full and n_swa > 0,
            swa_full_reason=self.swa.reason,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )

    def _meta_str(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(64)
        if lib.llama_model_meta_val_str(self.model, key.encode(), buf, 64) < 0:
            return None
        return buf.value.decode(errors="replace")

    def _meta_int(self, key: str) -> int | None:
        try:
            return int(self._meta_str(key) or "")
        except ValueError:
            return None

    def _kv_bytes_per_token(self) -> int:
        """A full KV cache's bytes per token: every layer's K and V at f16 (the default type)."""
        arch = self._meta_str("general.architecture") or ""
        n_layer = int(lib.llama_model_n_layer(self.model))
        n_head_kv = int(lib.llama_model_n_head_kv(self.model))
        head = int(lib.llama_model_n_embd(self.model)) // max(1, int(lib.llama_model_n_head(self.model)))
        k = self._meta_int(f"{arch}.attention.key_length") or head
        v = self._meta_int(f"{arch}.attention.value_length") or head
        return n_layer * n_head_kv * (k + v) * 2

    # -- dispatch ----------------------------------------------------------------------

    def handle(self, job: J.Job) -> Any:
        match job:
            case J.Step():
                return self.step(job)
            case J.Tokenize(text=text, add_special=add, parse_special=parse):
                return self.tokenize(text, add, parse)
            case J.Detokenize(tokens=tokens):
                return b"".join(self.piece(t) for t in tokens).decode(errors="replace")
            case J.SeqRm(seq=seq, p0=p0, p1=p1):
                self._check_seq(seq)
                return bool(lib.llama_memory_seq_rm(self.mem, seq, p0, p1))
            case J.SetSampler(seq=seq, params=params):
                return self.set_sampler(seq, params)
            case J.FreeSampler(seq=seq):
                self._free_sampler(seq)
                return None
            case J.StateSize(seq=seq, partial=partial):
                self._check_seq(seq)
                return int(lib.llama_state_seq_get_size_ext(self.ctx, seq, self._flags(partial)))
            case J.StateGet(seq=seq, partial=partial):
                return self.state_get(seq, partial)
            case J.StateSet(seq=seq, data=data, partial=partial):
                return self.state_set(seq, data, partial)
            case J.MemoryRange(seq=seq):
                self._check_seq(seq)
                return J.SeqRange(
                    pos_min=int(lib.llama_memory_seq_pos_min(self.mem, seq)),
                    pos_max=int(lib.llama_memory_seq_pos_max(self.mem, seq)),
                )
            case J.StepRecords():
                return list(self.records)
            case J.ModelInfo():
                return self.props
            case J.ChatInfo():
                return self.chat_info()
            case J.GeneLoad() | J.GeneUnload() | J.GenePageOut() | J.GenePageIn() | J.GeneList():
                return self.genes.handle(job)
            case J.Fail(reason=reason):
                raise EngineError(f"injected engine failure: {reason}")
            case _:
                raise InvalidParams(f"unknown engine job {type(job).__name__}")

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise InvalidParams(f"sequence {seq} out of range", seq=seq)

    @staticmethod
    def _flags(partial: bool) -> int:
        return lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0

    # -- text --------------------------------------------------------------------------

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

    def piece(self, token: int) -> bytes:
        n = lib.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            return buf.raw[:n]
        return self._piece_buf.raw[:n]

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        raw = lib.llama_vocab_get_text(self.vocab, token)
        return raw.decode(errors="replace") if raw else ""

    def chat_info(self) -> J.ChatTemplateInfo:
        """The GGUF's tokenizer.chat_template (None if absent) and the BOS/EOS texts."""
        raw = lib.llama_model_chat_template(self.model, None)
        bos = int(lib.llama_vocab_bos(self.vocab))
        return J.ChatTemplateInfo(
            template=raw.decode(errors="replace") if raw else None,
            bos_text=self.token_text(bos),
            eos_text=self.token_text(int(lib.llama_vocab_eos(self.vocab))),
            add_bos=bool(lib.llama_vocab_get_add_bos(self.vocab)),
            bos=bos,
        )

    # -- sampling ----------------------------------------------------------------------

    def set_sampler(self, seq: int, p: J.SamplingParams) -> None:
        """Build sequence `seq`'s sampler chain (see J.SamplingParams for the order).

        Built whole before the old chain is freed: a grammar that does not parse or a bias
        on a token the vocab lacks is an InvalidParams and leaves the sequence as it was."""
        self._check_seq(seq)
        n_vocab = self.props.n_vocab
        for tok, _ in p.logit_bias:
            if not 0 <= tok < n_vocab:
                raise InvalidParams(f"logit_bias names token {tok}, outside the vocab [0, {n_vocab})",
                                    param="logit_bias", token=tok)
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        grammar: Any = None
        add = lib.llama_sampler_chain_add
        try:
            if p.grammar:
                # Kept beside the chain, not in it: see `_sample_constrained`.
                grammar = lib.llama_sampler_init_grammar(self.vocab, p.grammar.encode(), b"root")
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
        except BaseException:
            lib.llama_sampler_free(chain)
            if grammar:
                lib.llama_sampler_free(grammar)
            raise
        self._free_sampler(seq)
        self.samplers[seq] = chain
        if grammar:
            self.grammars[seq] = grammar
        if p.top_logprobs >= 0:
            self.logprobs[seq] = min(p.top_logprobs, n_vocab)
        else:
            self.logprobs.pop(seq, None)

    def _free_sampler(self, seq: int) -> None:
        for table in (self.samplers, self.grammars):
            smpl = table.pop(seq, None)
            if smpl is not None:
                lib.llama_sampler_free(smpl)
        self.logprobs.pop(seq, None)

    def _row(self, idx: int) -> Any:
        """Batch row `idx`'s logits as a numpy view (no copy)."""
        return np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, idx), shape=(self.props.n_vocab,))

    def _candidates(self) -> tuple[Any, Any, Any, Any, Any, Any]:
        """The engine's one candidate buffer (n_vocab llama_token_data, with a numpy view) and
        a one-token array for grammar checks; made on the first constrained sample."""
        if self._cand is None:
            n_vocab = self.props.n_vocab
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

    def _sample_constrained(self, seq: int, idx: int, row: Any) -> tuple[int, str]:
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
        chain, grammar = self.samplers[seq], self.grammars[seq]
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

        tok = -1 if self.grammar_first else run()
        self.grammar_samples += 1
        if tok < 0 or not self._allows(grammar, tok):
            self.grammar_masked += 1
            tok = run(grammar)
            if tok < 0 or not self._allows(grammar, tok):
                return max(tok, 0), "the grammar allows no token that the other samplers (logit_bias) leave"
        lib.llama_sampler_accept(grammar, tok)
        lib.llama_sampler_accept(chain, tok)
        return tok, ""

    def _logprobs(self, idx: int, tok: int, k: int) -> tuple[float, list[tuple[int, float, bytes]]]:
        """Log-softmax of batch row `idx`'s raw logits: `tok`'s value and the top `k`'s.

        numpy over the row in place (no copy): one max, one exp-sum, one argpartition."""
        n_vocab = self.props.n_vocab
        row = self._row(idx)
        m = float(row.max())
        lse = m + float(np.log(np.exp(row - m, dtype=np.float32).sum(dtype=np.float64)))
        top: list[tuple[int, float, bytes]] = []
        if k > 0:
            best = np.argpartition(row, n_vocab - k)[n_vocab - k:] if k < n_vocab else np.arange(n_vocab)
            best = best[np.argsort(-row[best], kind="stable")]
            top = [(int(t), float(row[t]) - lse, self.piece(int(t))) for t in best]
        return float(row[tok]) - lse, top

    # -- the step ----------------------------------------------------------------------

    def step(self, job: J.Step) -> J.StepOut:
        if job.epoch != self.epoch:
            raise StepSkipped("planned before a failed step; nothing ran", epoch=self.epoch)
        try:
            return self._step(job)
        except BaseException as e:
            # Whatever failed, the steps queued behind this one were planned assuming it
            # ran (they may feed its samples): they are skipped, not run on a guess.
            self.epoch += 1
            if isinstance(e, ActordError):
                e.data.setdefault("epoch", self.epoch)
            raise

    def _step(self, job: J.Step) -> J.StepOut:
        n = sum(len(e.tokens) + e.feed_last for e in job.entries)
        if n == 0:
            raise InvalidParams("empty step")
        if n > self.n_batch:
            raise InvalidParams(f"step of {n} tokens exceeds n_batch {self.n_batch}")
        last = self.last_sampled
        for e in job.entries:
            self._check_seq(e.seq)
            if e.sample and e.seq not in self.samplers:
                raise InvalidParams(f"sequence {e.seq} has no sampler", seq=e.seq)
            if e.feed_last and e.seq not in last:
                raise InvalidParams(f"sequence {e.seq} sampled nothing in the last step", seq=e.seq)
        self.genes.apply(job.genes)
        b = self.batch
        k = 0
        last_index: list[int] = []
        for e in job.entries:
            pos = e.pos0
            for t in ((last[e.seq],) if e.feed_last else e.tokens):
                b.token[k] = t
                b.pos[k] = pos
                b.n_seq_id[k] = 1
                b.seq_id[k][0] = e.seq
                b.logits[k] = 0
                pos += 1
                k += 1
            if e.sample:
                b.logits[k - 1] = 1
            last_index.append(k - 1)
        b.n_tokens = k
        t0 = time.perf_counter()
        rc = lib.llama_decode(self.ctx, b)
        t1 = time.perf_counter()
        if rc == 1:  # no cells for this batch; libllama left the memory as it was
            raise KvCacheFull("llama_decode found no free KV cells for the step", rc=rc, n_tokens=k)
        if rc != 0:
            raise EngineError("llama_decode failed", rc=rc, n_tokens=k)
        out: list[J.EntryOut] = []
        last.clear()
        for e, idx in zip(job.entries, last_index):
            ckpt = self.state_get(e.seq, True).data if e.checkpoint else None
            ckpt_pos = e.pos0 + len(e.tokens) + e.feed_last if e.checkpoint else 0
            if e.sample:
                refused = ""
                if e.seq in self.grammars:
                    tok, refused = self._sample_constrained(e.seq, idx, self._row(idx))
                else:
                    tok = int(lib.llama_sampler_sample(self.samplers[e.seq], self.ctx, idx))
                last[e.seq] = tok
                n_top = self.logprobs.get(e.seq)
                lp, top = self._logprobs(idx, tok, n_top) if n_top is not None else (None, [])
                out.append(J.EntryOut(
                    seq=e.seq, token=tok, piece=self.piece(tok),
                    eog=bool(lib.llama_vocab_is_eog(self.vocab, tok)),
                    checkpoint=ckpt, checkpoint_pos=ckpt_pos, logprob=lp, top=top, refused=refused,
                ))
            else:
                out.append(J.EntryOut(seq=e.seq, checkpoint=ckpt, checkpoint_pos=ckpt_pos))
        t2 = time.perf_counter()
        self.step_no += 1
        self.records.append(J.StepRecord(
            step=self.step_no, seqs=[e.seq for e in job.entries], n_tokens=k, genes=job.genes
        ))
        return J.StepOut(
            step=self.step_no, entries=out, n_tokens=k,
            t_decode_ms=(t1 - t0) * 1e3, t_sample_ms=(t2 - t1) * 1e3, epoch=self.epoch,
        )

    # -- state copies ------------------------------------------------------------------

    def state_get(self, seq: int, partial: bool) -> J.StateData:
        """Copy a sequence's state into one fresh host buffer: libllama writes it in place."""
        self._check_seq(seq)
        t0 = time.perf_counter()
        flags = self._flags(partial)
        size = int(lib.llama_state_seq_get_size_ext(self.ctx, seq, flags))
        # np.empty, not bytearray: a bytearray is zero-filled first, a second pass over
        # every page of a multi-MB buffer (measured: 7.2 ms vs 4.0 ms for 20.5 MB, where a
        # copy into a warm buffer took 4.1 ms).
        arr = np.empty(max(size, 1), dtype=np.uint8)
        ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = int(lib.llama_state_seq_get_data_ext(self.ctx, ptr, size, seq, flags))
        if n != size:
            raise EngineError(f"state copy wrote {n} of {size} bytes", seq=seq)
        return J.StateData(data=memoryview(arr)[:size], n_bytes=size, t_ms=(time.perf_counter() - t0) * 1e3)

    def state_set(self, seq: int, data: Any, partial: bool) -> J.StateData:
        self._check_seq(seq)
        t0 = time.perf_counter()
        view = memoryview(data).cast("B")
        size = view.nbytes
        if view.readonly:
            src = ctypes.cast(ctypes.c_char_p(bytes(view)), ctypes.POINTER(ctypes.c_uint8))
        else:
            src = (ctypes.c_uint8 * size).from_buffer(view)
        n = int(lib.llama_state_seq_set_data_ext(self.ctx, src, size, seq, self._flags(partial)))
        del src
        if n == 0:
            # libllama clears the destination sequence when a restore fails part-way.
            lib.llama_memory_seq_rm(self.mem, seq, -1, -1)
            raise PageDoesNotFit(
                "the state does not fit this context (or was taken from another model)",
                seq=seq, n_bytes=size,
            )
        return J.StateData(data=bytearray(), n_bytes=n, t_ms=(time.perf_counter() - t0) * 1e3)


def run_job(engine: Engine, job: J.Job) -> Any:
    """Run one job; typed errors pass through, anything else becomes an EngineError."""
    try:
        return engine.handle(job)
    except ActordError:
        raise
    except Exception as e:  # a bug or a libllama surprise must not kill the engine thread
        raise EngineError(f"{type(e).__name__}: {e}", job=type(job).__name__) from e
