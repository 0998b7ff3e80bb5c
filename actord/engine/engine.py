"""The engine: mechanism only, and only ever on the engine thread.

It owns the model, one context with `n_seq_max = slots` and a unified KV cache, one sampler
chain per sequence, the reusable llama_batch and (see genes.py) the LoRA adapters. Every
method runs on the engine thread; `handle` maps a typed job to a typed result. It never
decides anything: which tokens go into a step, which state to copy and when is the actors'
business.

`Engine` is assembled here from mixins, one module per job, all sharing the one object
(the engine thread is their only caller, so they need no locks and no messages between
them): the start (context.py, with log_capture.py), props and chat facts (props.py), text
(vocab.py), the step (step.py), state copies and cuts (state_copy.py), sampler chains
(sampling.py), embeddings (embed.py). This module holds the engine's per-sequence
bookkeeping, the job dispatch and `run_job`.
"""

from __future__ import annotations

import collections
import ctypes
from typing import Any

import msgspec

from actord.engine import backend_sampling
from actord.engine import jobs as J
from actord.engine.context import Context
from actord.engine.draft import Drafter, open_drafter
from actord.engine.embed import Embedding
from actord.engine.genes import GeneCatalog
from actord.engine.llama import lib
from actord.engine.mtp import MtpDrafter, open_mtp
from actord.engine.props import Props
from actord.engine.sleep import Sleeping
from actord.engine.sampling import Sampling
from actord.engine.state_copy import StateCopy
from actord.engine.step import Stepping
from actord.engine.vocab import Vocab
from actord.service.config import Config
from actord.service.errors import ActordError, EngineError, InvalidParams


class Engine(Context, Props, Vocab, Stepping, StateCopy, Sampling, Embedding, Sleeping):
    def __init__(self, config: Config, *, n_rs_seq: int = 0) -> None:
        """`n_rs_seq`: recurrent-state snapshots per sequence for rollback (libllama's
        experimental cparam). 0, the default, is what actord runs without speculation: the
        rollback it allows is right only inside the batch just decoded (see `seq_rm`), which
        a job between steps never is. With speculation on a recurrent or hybrid target it is
        raised to spec_n_max: a verify rolls back inside its own batch (`_verify`)."""
        self.config, self.n_rs_seq_asked = config, n_rs_seq  # what a wake opens again (sleep.py)
        on_gpu = self._open(config, n_rs_seq)
        self._batch_seq = [-1] * self.n_batch  # seq_id[k][0] as `_step` last wrote it (-1: unknown)
        self._batch_one = 0  # n_seq_id[k] == 1 for every k below this
        self.samplers: dict[int, Any] = {}
        self.backend_sampling = False  # resolved below, once the draft context is known
        self.backend_seqs: set[int] = set()
        self.greedy: set[int] = set()  # seqs whose chain is greedy alone (sampling.py `_greedy_rows`)
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
        self.watches: dict[int, Any] = {}  # seq -> its lazy grammar / preserved tokens (sampling.Watch)
        self.grammar_first = False  # bench seam: apply the grammar to every candidate, every token
        self.grammar_samples = 0  # constrained samples, and those that masked the whole vocabulary
        self.grammar_masked = 0
        self.grammar_cut = 0
        self.seq_grammar: dict[int, bytes] = {}
        self.cut_grammars: dict[bytes, None] = {}
        self._cand: Any = None
        self._ids: Any = None
        self.genes = GeneCatalog(self.model, self.ctx)
        self.step_no = 0
        self.epoch = 0  # bumped by a failed step: steps planned before it are skipped
        self.last_sampled: dict[int, int] = {}  # seq -> its token sampled in the last step
        self.before_decode: Any = None  # set by the engine thread: called right before llama_decode
        self.records: collections.deque[J.StepRecord] = collections.deque(maxlen=4096)
        self._piece_buf = ctypes.create_string_buffer(256)
        self.drafter: Drafter | MtpDrafter | None = None
        try:
            if config.spec_mode == "mtp":
                self.drafter = open_mtp(config, self.model, self.ctx, threads=self.threads, digest=self.weights_digest)
            else:
                self.drafter = open_drafter(config, self.model, self.vocab, swa_full=self.swa.full,
                                            threads=self.threads)
        except BaseException:
            self.close()
            raise
        self.backend_sampling = backend_sampling.resolve(config.backend_sampling, on_gpu, self.drafter is not None)
        self.device_report = msgspec.structs.replace(self.device_report, backend_sampling=self.backend_sampling)
        self.props = self._props(config)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        if self.ctx is None:  # asleep (sleep.py) or closed: libllama holds nothing of ours
            self._asleep = None
            return
        for seq in list(self.samplers):
            self._free_sampler(seq)
        self.close_embed()
        if getattr(self, "drafter", None) is not None:
            self.drafter.close()
            self.drafter = None
        self.genes.close()
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)
        self.ctx = self.model = None

    # -- dispatch ----------------------------------------------------------------------

    def handle(self, job: J.Job) -> Any:
        if self._asleep is not None and not isinstance(job, J.Sleep):
            if isinstance(job, J.QUIET):
                return self.asleep_answer(job)
            self.wake()
        match job:
            case J.Step():
                return self.step(job)
            case J.Tokenize(text=text, add_special=add, parse_special=parse):
                return self.tokenize(text, add, parse)
            case J.Detokenize(tokens=tokens):
                return b"".join(self.piece(t) for t in tokens).decode(errors="replace")
            case J.Pieces(tokens=tokens, special=special):
                n_vocab = lib.llama_vocab_n_tokens(self.vocab)
                bad = [t for t in tokens if not 0 <= t < n_vocab]
                if bad:  # libllama would read out of bounds
                    raise InvalidParams(f"token ids out of range [0, {n_vocab})", bad=bad[:8])
                return [self.piece(t, special) for t in tokens]
            case J.SeqRm(seq=seq, p0=p0, p1=p1, draft=draft_only):
                self._check_seq(seq)
                if self.drafter is not None:  # the draft sequence never holds more than the target's
                    self.drafter.seq_rm(seq, p0, p1)
                return True if draft_only else self.seq_rm(seq, p0, p1)
            case J.SeqCopy(src=src, dst=dst):
                self._check_seq(src)
                self._check_seq(dst)
                if src == dst:
                    raise InvalidParams("a sequence cannot be copied onto itself", seq=src)
                if self.drafter is not None:
                    self.drafter.seq_rm(dst, -1, -1)
                lib.llama_memory_seq_rm(self.mem, dst, -1, -1)
                lib.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
                return True
            case J.SeqShare(src=src, dst=dst, n=n, checkpoint=None):
                return self.seq_share(src, dst, n)
            case J.SeqShare(src=src, dst=dst, n=n, checkpoint=data):
                return self.seq_share_from_checkpoint(src, dst, n, data)
            case J.SetSampler(seq=seq, params=params):
                return self.set_sampler(seq, params)
            case J.FreeSampler(seq=seq):
                self._free_sampler(seq)
                return None
            case J.StateSize(draft=True) | J.StateGet(draft=True) | J.StateSet(draft=True) | J.MemoryRange(draft=True):
                return self._draft_job(job)
            case J.StateSize(seq=seq, partial=partial):
                self._check_seq(seq)
                return int(lib.llama_state_seq_get_size_ext(self.ctx, seq, self._flags(partial)))
            case J.StateGet(seq=seq, partial=partial, into=into, capacity=capacity, then_erase=erase, p0=p0, p1=p1):
                if erase and (self.drafter is not None or p0 or p1 >= 0):
                    raise InvalidParams("then_erase takes a whole target sequence, on a context without a draft")
                if p0 or p1 >= 0:
                    return self.state_get_range(seq, p0, p1, partial, into, capacity)
                return self.state_get(seq, partial, into, capacity, then_erase=erase)
            case J.StateSet(base=None, base_seq=-1, seq=seq, data=data, partial=partial):
                return self.state_set(seq, data, partial)
            case J.StateSet():
                return self.state_set_on_base(job)
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
            case J.Embed(inputs=inputs):
                return self.embed(inputs, self.threads)
            case J.GeneLoad() | J.GeneUnload() | J.GenePageOut() | J.GenePageIn() | J.GeneList():
                return self.genes.handle(job)
            case J.Sleep():
                return self.sleep()
            case J.Fail(reason=reason):
                raise EngineError(f"injected engine failure: {reason}")
            case _:
                raise InvalidParams(f"unknown engine job {type(job).__name__}")

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise InvalidParams(f"sequence {seq} out of range", seq=seq)


def run_job(engine: Engine, job: J.Job) -> Any:
    """Run one job; typed errors pass through, anything else becomes an EngineError."""
    try:
        return engine.handle(job)
    except ActordError:
        raise
    except Exception as e:  # a bug or a libllama surprise must not kill the engine thread
        raise EngineError(f"{type(e).__name__}: {e}", job=type(job).__name__) from e
