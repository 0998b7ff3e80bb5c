"""A stand-in engine that answers every job at once, with no model.

Why: on a CPU a real decode step hides what Python costs around it. With this engine a
step costs nothing, so what a benchmark measures is the orchestration alone (the actors,
the scheduling core, the engine thread's hand-offs). It keeps the engine's contract (the
same jobs, the same result types, sequences and positions checked, `feed_last` and epochs
honoured: tests/testing/test_fake_engine_contract.py runs it beside the real engine), and it
samples a deterministic token per (sequence, position), so outputs are reproducible.
"""

from __future__ import annotations

from typing import Any

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.engine.step_contract import check_step, run_in_epoch
from actord.vocabulary.errors import InvalidParams, PageDoesNotFit, SlotBusy


class FakeEngine:
    def __init__(self, config: Config, n_vocab: int = 512, device: J.DeviceReport | None = None) -> None:
        self.n_ctx = config.ctx
        self.n_batch = config.batch
        self.n_seq_max = config.slots
        self.n_vocab = n_vocab
        self.epoch = 0
        self.step_no = 0
        self.last_sampled: dict[int, int] = {}
        self.samplers: set[int] = set()
        self.held: dict[int, int] = {}  # seq -> positions held
        self.before_decode: Any = None  # as the real engine: called where llama_decode would run
        self.props = J.ModelProps(
            n_ctx=self.n_ctx, n_batch=self.n_batch, n_seq_max=self.n_seq_max, n_vocab=n_vocab, n_ctx_train=self.n_ctx,
            n_swa=0, recurrent=False, hybrid=False, needs_checkpoints=False, bos=1, eos=2, desc="fake engine",
            kv_bytes_per_token=64, prompt_logits=config.prompt_logits_memo,
            # A test stands in a GPU here (its budget included); the default is the CPU's.
            device=device or J.DeviceReport(budget_bytes=config.device_bytes),
        )
        self._pieces = [b"t%d " % t for t in range(n_vocab)]

    def close(self) -> None:
        pass

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise InvalidParams(f"sequence {seq} out of range", seq=seq)

    _asleep: Any = None  # as the real engine's (engine/sleep.py): the next non-quiet job wakes it

    @property
    def asleep(self) -> bool:
        return self._asleep is not None

    def handle(self, job: J.Job) -> Any:
        if self._asleep is not None and not isinstance(job, (J.Sleep, *J.QUIET)):
            self._asleep = None
        match job:
            case J.Sleep():
                held = sorted(s for s, n in self.held.items() if n)
                if held:
                    raise SlotBusy("sequences still hold cells: the engine stays awake", seqs=held)
                self._asleep = True
                return True
            case J.Step():
                return run_in_epoch(self, job, self._step)
            case J.ModelInfo():
                return self.props
            case J.Tokenize(text=text):
                return [1] + [5 + (b % (self.n_vocab - 5)) for b in text.encode()]
            case J.Detokenize(tokens=tokens):
                return b"".join(self._pieces[t] for t in tokens).decode()
            case J.SetSampler(seq=seq):
                self._check_seq(seq)
                self.samplers.add(seq)
                return None
            case J.FreeSampler(seq=seq):
                self.samplers.discard(seq)
                return None
            case J.SeqRm(seq=seq, draft=True):
                self._check_seq(seq)
                return True
            case J.SeqRm(seq=seq, p0=p0):
                self._check_seq(seq)
                self.held[seq] = 0 if p0 < 0 else min(self.held.get(seq, 0), p0)
                return True
            case J.SeqCopy(src=src, dst=dst):
                self._check_seq(src)
                self._check_seq(dst)
                if src == dst:
                    raise InvalidParams("a sequence cannot be copied onto itself", seq=src)
                self.held[dst] = self.held.get(src, 0)
                return True
            case J.SeqShare(src=src, dst=dst, n=n):  # (attention only: a checkpoint changes nothing here)
                self._check_seq(src)
                self._check_seq(dst)
                if src == dst:
                    raise InvalidParams("a sequence cannot share its own cells", seq=src)
                if not 0 < n <= self.held.get(src, 0):
                    return False
                self.held[dst] = n
                return True
            case J.StateSize(seq=seq):
                self._check_seq(seq)
                return 16 + 4 * self.held.get(seq, 0)
            case J.StateGet(seq=seq, into=into, then_erase=erase, p0=p0, p1=p1):
                self._check_seq(seq)
                held = self.held.get(seq, 0)
                n = 16 + 4 * (max(0, min(held, p1 if p1 >= 0 else held) - p0))
                if erase:
                    self.held[seq] = 0
                if into is not None and into.capacity >= n:  # as the engine: written in place
                    into.array[:n] = 0
                    return J.StateData(data=memoryview(into.array)[:n], n_bytes=n, t_ms=0.0)
                return J.StateData(data=bytearray(n), n_bytes=n, t_ms=0.0)
            case J.StateSet(seq=seq, data=data, base=base, base_seq=base_seq, n_base=n_base):
                self._check_seq(seq)
                n = memoryview(data).nbytes
                rest = max(0, (n - 16) // 4)
                if base_seq >= 0 or base is not None:  # a shared base, then the rest on it
                    if base_seq >= 0 and self.held.get(base_seq, 0) < n_base:
                        self.held[seq] = 0
                        raise PageDoesNotFit("base sequence no longer holds the shared positions", seq=seq)
                    self.held[seq] = n_base + rest
                else:
                    self.held[seq] = rest
                return J.StateData(data=bytearray(), n_bytes=n, t_ms=0.0)
            case J.MemoHeld(seq=seq):  # no logits kept: a reuse decodes its token (held = its end)
                self._check_seq(seq)
                return self.props.prompt_logits
            case J.MemoryRange(seq=seq):
                self._check_seq(seq)
                return J.SeqRange(pos_min=0, pos_max=self.held.get(seq, 0) - 1)
            case J.StepRecords():
                return []
            case J.GeneList():
                return []
            case _:
                raise InvalidParams(f"the fake engine does not run {type(job).__name__}")

    def _step(self, job: J.Step) -> J.StepOut:
        n = check_step(job, self.n_batch, self.n_seq_max, self.samplers, self.last_sampled)
        out: list[J.EntryOut] = []
        sampled: dict[int, int] = {}
        for e in job.entries:
            end = e.pos0 + len(e.tokens) + e.feed_last
            self.held[e.seq] = end
            if e.sample:
                tok = 5 + (e.seq * 31 + end * 7) % (self.n_vocab - 5)
                sampled[e.seq] = tok
                out.append(J.EntryOut(seq=e.seq, token=tok, piece=self._pieces[tok]))
            else:
                out.append(J.EntryOut(seq=e.seq))
        if self.before_decode is not None:
            self.before_decode()
        self.last_sampled = sampled
        self.step_no += 1
        return J.StepOut(step=self.step_no, entries=out, n_tokens=n, t_decode_ms=0.0, t_sample_ms=0.0,
                         epoch=self.epoch)
