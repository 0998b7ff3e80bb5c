"""The engine: mechanism only, and only ever on the engine thread.

It owns the model, one context with `n_seq_max = slots` and a unified KV cache, one sampler
chain per sequence, the reusable llama_batch and (see genes.py) the LoRA adapters. Every
method runs on the engine thread; `handle` maps a typed job to a typed result. It never
decides anything: which tokens go into a step, which state to copy and when is the actors'
business.

`Engine` holds its collaborators and calls them, each the owner of its own state (the
engine thread is their only caller, so they need no locks and no messages between them):
the model and its context (context.py, with log_capture.py), text (vocab.py), sampler
chains (sampling.py), the step (step.py), state copies and cuts (state_copy.py), the
drafter (draft.py or mtp.py), the genes (genes.py), embeddings (embed.py). What it keeps
itself is the job dispatch, the props (props.py) and, while asleep, one record (sleep.py).
Nothing is shared by inheritance: each collaborator is given what it reads.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import msgspec

from actord.engine import backend_sampling
from actord.engine import jobs as J
from actord.engine.context import Context
from actord.engine.draft import Drafter, open_drafter
from actord.engine.embed import Embedder
from actord.engine.genes import GeneCatalog
from actord.engine.llama import lib
from actord.engine.mtp import MtpDrafter, open_mtp
from actord.engine.props import chat_info, model_props
from actord.engine.sampling import Samplers
from actord.engine.sleep import Asleep
from actord.engine.state_copy import StateCopier
from actord.engine.step import Stepper
from actord.engine.vocab import Vocab
from actord.vocabulary.config import Config
from actord.vocabulary.errors import ActordError, EngineError, InvalidParams, SlotBusy
from actord.vocabulary.log import get

log = get("actord.engine")


class Engine:
    context: Context
    vocab: Vocab
    genes: GeneCatalog
    drafter: Drafter | MtpDrafter | None
    samplers: Samplers
    copier: StateCopier
    stepper: Stepper
    embedder: Embedder
    props: J.ModelProps

    def __init__(self, config: Config, *, n_rs_seq: int = 0, stepper: Callable[..., Stepper] = Stepper) -> None:
        """`n_rs_seq`: recurrent-state snapshots per sequence for rollback (libllama's
        experimental cparam). 0, the default, is what actord runs without speculation: the
        rollback it allows is right only inside the batch just decoded (see `seq_rm`), which
        a job between steps never is. With speculation on a recurrent or hybrid target it is
        raised to spec_n_max: a verify rolls back inside its own batch (`_verify`).
        `stepper`: what makes the Stepper (Stepper's own arguments): a test's or the
        simulation's that fails chosen steps, say."""
        self.config, self.n_rs_seq_asked = config, n_rs_seq  # what a wake opens again
        self._make_stepper = stepper
        self._asleep: Asleep | None = None  # what a wake restores; None while awake
        self._open(None)

    def _open(self, kept: Asleep | None) -> None:
        """Open libllama's objects and the collaborators over them: at start, and at a wake
        with what the sleep `kept`. Nothing is assigned until all of it opened."""
        config = self.config
        c = Context(config, self.n_rs_seq_asked)
        genes = GeneCatalog(c.model, c.ctx)
        try:
            drafter: Drafter | MtpDrafter | None
            if config.spec_mode == "mtp":
                drafter = open_mtp(config, c.model, c.ctx, threads=c.threads, digest=c.weights_digest)
            else:
                drafter = open_drafter(config, c.model, c.vocab, swa_full=c.swa.full, threads=c.threads)
        except BaseException:
            genes.close()
            c.close()
            raise
        vocab = Vocab(c.vocab)
        on_backend = backend_sampling.resolve(config.backend_sampling, c.on_gpu, drafter is not None)
        samplers = Samplers(config, c, vocab, backend_sampling=on_backend)
        copier = StateCopier(c, drafter)
        memo = config.prompt_logits_memo
        if kept is None:
            stepper = self._make_stepper(c, vocab, samplers, copier, drafter, genes, keep_memo=memo)
        else:
            stepper = self._make_stepper(c, vocab, samplers, copier, drafter, genes, epoch=kept.epoch,
                                         step_no=kept.step_no, records=kept.records, before_decode=kept.before_decode,
                                         keep_memo=memo)
        props = model_props(config, c, drafter)
        device = msgspec.structs.replace(props.device, backend_sampling=on_backend)
        props = msgspec.structs.replace(props, device=device)
        self.context, self.vocab, self.genes, self.drafter = c, vocab, genes, drafter
        self.samplers, self.copier, self.stepper = samplers, copier, stepper
        self.embedder = Embedder(c.model, c.ctx, c.n_ctx)
        self.props = props
        if kept is not None:
            genes.attach(kept.genes)

    # -- what the engine thread and tests reach --------------------------------------------

    @property
    def before_decode(self) -> Any:
        """Called right before each llama_decode of a step (the engine thread sets it)."""
        return self.stepper.before_decode

    @before_decode.setter
    def before_decode(self, hook: Any) -> None:
        self.stepper.before_decode = hook

    @property
    def asleep(self) -> bool:
        return self._asleep is not None

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        if self.context.ctx is None:  # asleep or closed: libllama holds nothing of ours
            self._asleep = None
            return
        self.samplers.close()
        self.embedder.close()
        if self.drafter is not None:
            self.drafter.close()
        self.genes.close()
        self.context.close()

    def sleep(self) -> bool:
        """Free libllama's objects, keeping what a wake needs (engine/sleep.py)."""
        if self._asleep is not None:
            return True
        c = self.context
        held = [s for s in range(c.n_seq_max + 1) if lib.llama_memory_seq_pos_max(c.mem, s) >= 0]
        if held:
            raise SlotBusy("sequences still hold cells: the engine stays awake", seqs=held)
        t0 = time.perf_counter()
        st = self.stepper
        kept = Asleep(epoch=st.epoch, step_no=st.step_no, records=st.records, before_decode=st.before_decode,
                      genes=self.genes.detach(), props=self.props, chat=chat_info(c, self.vocab))
        self.close()
        self._asleep = kept
        log.info("engine.asleep", t_ms=round((time.perf_counter() - t0) * 1e3, 1))
        return True

    def wake(self) -> None:
        kept = self._asleep
        assert kept is not None
        t0 = time.perf_counter()
        self._open(kept)  # raises with _asleep kept: a later job tries again
        self._asleep = None
        log.info("engine.awake", t_ms=round((time.perf_counter() - t0) * 1e3, 1), genes=len(kept.genes.resident))

    # -- dispatch ----------------------------------------------------------------------

    def handle(self, job: J.Job) -> Any:
        if self._asleep is not None and not isinstance(job, J.Sleep):
            if isinstance(job, J.QUIET):
                return self._asleep.answer(job)
            self.wake()
        c, copier = self.context, self.copier
        match job:
            case J.Step():
                return self.stepper.step(job)
            case J.Tokenize(text=text, add_special=add, parse_special=parse):
                return self.vocab.tokenize(text, add, parse)
            case J.Detokenize(tokens=tokens):
                return b"".join(self.vocab.piece(t) for t in tokens).decode(errors="replace")
            case J.Pieces(tokens=tokens, special=special):
                n_vocab = self.vocab.n_tokens
                bad = [t for t in tokens if not 0 <= t < n_vocab]
                if bad:  # libllama would read out of bounds
                    raise InvalidParams(f"token ids out of range [0, {n_vocab})", bad=bad[:8])
                return [self.vocab.piece(t, special) for t in tokens]
            case J.SeqRm(seq=seq, p0=p0, p1=p1, draft=draft_only, window=window):
                c.check_seq(seq)
                if window and not draft_only and p1 < 0 and 0 < p0 and not copier.window_whole(seq, p0):
                    return False  # refused before anything (the draft's sequence too) is cut
                if self.drafter is not None:  # the draft sequence never holds more than the target's
                    self.drafter.seq_rm(seq, p0, p1)
                if draft_only:
                    return True
                self.stepper.forget(seq, p0)
                return copier.seq_rm(seq, p0, p1)
            case J.SeqCopy(src=src, dst=dst):
                c.check_seq(src)
                c.check_seq(dst)
                if src == dst:
                    raise InvalidParams("a sequence cannot be copied onto itself", seq=src)
                if self.drafter is not None:
                    self.drafter.seq_rm(dst, -1, -1)
                lib.llama_memory_seq_rm(c.mem, dst, -1, -1)
                lib.llama_memory_seq_cp(c.mem, src, dst, -1, -1)
                copier.copied(src, dst)
                self.stepper.copy_memo(src, dst)
                return True
            case J.SeqShare(src=src, dst=dst, n=n, checkpoint=None):
                self.stepper.forget(dst)
                if not copier.seq_share(src, dst, n):
                    return False
                self.stepper.copy_memo(src, dst, n)
                return True
            case J.SeqShare(src=src, dst=dst, n=n, checkpoint=data):
                self.stepper.forget(dst)  # its window's cells come from a checkpoint, not src's
                return copier.seq_share_from_checkpoint(src, dst, n, data)
            case J.MemoHeld(seq=seq, pos=pos, token=token):
                return self.stepper.holds_memo(seq, pos, token)
            case J.SetSampler(seq=seq, params=params):
                return self.samplers.set_sampler(seq, params)
            case J.FreeSampler(seq=seq):
                self.samplers.free_sampler(seq)
                return None
            case J.StateSize(draft=True) | J.StateGet(draft=True) | J.StateSet(draft=True) | J.MemoryRange(draft=True):
                return copier.draft_job(job)
            case J.StateSize(seq=seq, partial=partial):
                c.check_seq(seq)
                return int(lib.llama_state_seq_get_size_ext(c.ctx, seq, copier.flags(partial)))
            case J.StateGet(seq=seq, partial=partial, into=into, capacity=capacity, then_erase=erase, p0=p0, p1=p1):
                if erase and (self.drafter is not None or p0 or p1 >= 0):
                    raise InvalidParams("then_erase takes a whole target sequence, on a context without a draft")
                if p0 or p1 >= 0:
                    return copier.state_get_range(seq, p0, p1, partial, into, capacity)
                if erase:
                    self.stepper.forget(seq)
                return copier.state_get(seq, partial, into, capacity, then_erase=erase)
            case J.StateSet(base=None, base_seq=-1, seq=seq, data=data, partial=partial):
                self.stepper.forget(seq)
                return copier.state_set(seq, data, partial)
            case J.StateSet():
                self.stepper.forget(job.seq)
                return copier.state_set_on_base(job)
            case J.MemoryRange(seq=seq):
                c.check_seq(seq)
                return J.SeqRange(
                    pos_min=copier.pos_min(seq),
                    pos_max=int(lib.llama_memory_seq_pos_max(c.mem, seq)),
                )
            case J.StepRecords():
                return list(self.stepper.records)
            case J.ModelInfo():
                return self.props
            case J.ChatInfo():
                return chat_info(c, self.vocab)
            case J.Embed(inputs=inputs):
                return self.embedder.embed(inputs, c.threads)
            case J.GeneLoad() | J.GeneUnload() | J.GenePageOut() | J.GenePageIn() | J.GeneList():
                return self.genes.handle(job)
            case J.Sleep():
                return self.sleep()
            case J.Fail(reason=reason):
                raise EngineError(f"injected engine failure: {reason}")
            case _:
                raise InvalidParams(f"unknown engine job {type(job).__name__}")


def run_job(engine: Engine, job: J.Job) -> Any:
    """Run one job; typed errors pass through, anything else becomes an EngineError."""
    try:
        return engine.handle(job)
    except ActordError:
        raise
    except Exception as e:  # a bug or a libllama surprise must not kill the engine thread
        raise EngineError(f"{type(e).__name__}: {e}", job=type(job).__name__) from e
