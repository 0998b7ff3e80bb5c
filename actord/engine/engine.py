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
import os
import time
from typing import Any

import msgspec
import numpy as np

from actord.service.config import Config, engine_threads
from actord.policy import speculation as S
from actord.engine import backend_sampling, devices
from actord.engine import jobs as J
from actord.engine.draft import Drafter, open_drafter
from actord.engine.mtp import MtpDrafter, open_mtp
from actord.engine.embed import Embedding
from actord.engine.genes import GeneCatalog
from actord.engine.sampling import Sampling
from actord.engine.step_contract import check_step, run_in_epoch
from actord.engine.llama import lib
from actord.service.errors import ActordError, EngineError, InvalidParams, KvCacheFull, PageDoesNotFit
from actord.policy import device as device_policy
from actord.policy.swa import choose_swa_full

_log_cb: Any = None
_quiet_cb: Any = None
# While capturing, libllama's log lines are kept here (context creation: how "auto" flash
# attention resolved is only ever logged); otherwise they are dropped without reaching
# Python: a Python callback costs a GIL round trip per line, and an adapter build alone logs
# ~160 lines (measured: a gene page_in 2.9 ms with a Python no-op callback, 1.9 ms without).
_log_capture: list[str] | None = None


def _on_llama_log(level: int, text: bytes | None, data: Any) -> None:
    if _log_capture is not None and text:
        _log_capture.append(text.decode(errors="replace"))


def _silence_llama_logs() -> None:
    """Drop libllama's logs in C: libc's abs() serves as the no-op callback (it reads its
    first, integer argument only, and the caller ignores its result: harmless under every
    C calling convention libllama is built for); a Python no-op where libc has none."""
    global _log_cb, _quiet_cb
    if _log_cb is None:
        _log_cb = lib.llama_log_callback(_on_llama_log)
        try:
            _quiet_cb = ctypes.cast(ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p), lib.llama_log_callback)
        except (AttributeError, OSError):
            _quiet_cb = _log_cb
    lib.llama_log_set(_quiet_cb, ctypes.c_void_p())


def _capture_llama_logs() -> None:
    lib.llama_log_set(_log_cb, ctypes.c_void_p())


def _flash_attn_resolved(asked: str, log_lines: list[str]) -> str:
    """What libllama made of flash attention: asked outright, or how "auto" resolved (it says
    so in its log only: "Flash Attention enabled" / "... not supported, set to disabled")."""
    if asked != "auto":
        return asked
    text = "".join(log_lines)
    if "Flash Attention enabled" in text:
        return "on"
    if "Flash Attention not supported" in text:
        return "off"
    return ""


_FLASH_ATTN_TYPE = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type


def _main_device(devs: list[J.DeviceInfo], main_gpu: int) -> tuple[str, int, int] | None:
    """(name, free, total) of the GPU(s) the model runs on, None for the CPU alone: GPU
    `main_gpu`, or every GPU together when layers are split between them (-1)."""
    gpus = [d for d in devs if d.type in ("gpu", "igpu")]
    if not gpus:
        return None
    if main_gpu >= 0:
        if main_gpu >= len(gpus):
            raise InvalidParams(f"main_gpu {main_gpu}: this machine has {len(gpus)} GPU(s)",
                                main_gpu=main_gpu, gpus=[d.name for d in gpus])
        gpus = [gpus[main_gpu]]
    name = "+".join(f"{d.name} ({d.description})" for d in gpus)
    return name, sum(d.free_bytes for d in gpus), sum(d.total_bytes for d in gpus)


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


_NO_REPLAY: list = []  # never appended to: a step without rollback "replay" shares it

class Engine(Sampling, Embedding):
    def __init__(self, config: Config, *, n_rs_seq: int = 0) -> None:
        """`n_rs_seq`: recurrent-state snapshots per sequence for rollback (libllama's
        experimental cparam). 0, the default, is what actord runs without speculation: the
        rollback it allows is right only inside the batch just decoded (see `seq_rm`), which
        a job between steps never is. With speculation on a recurrent or hybrid target it is
        raised to spec_n_max: a verify rolls back inside its own batch (`_verify`)."""
        if not os.path.exists(config.model):
            raise InvalidParams(f"model file not found: {config.model}", path=config.model)
        if n_rs_seq < 0:
            raise InvalidParams("n_rs_seq must be >= 0", n_rs_seq=n_rs_seq)
        global _log_capture
        _silence_llama_logs()
        lib.llama_backend_init()
        offload = devices.gpu_offload()
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        mparams.load_mtp = config.spec_mode == "mtp"  # the nextn block's tensors (skipped otherwise)
        if config.main_gpu >= 0:  # the whole model on that GPU
            mparams.split_mode = lib.LLAMA_SPLIT_MODE_NONE
            mparams.main_gpu = config.main_gpu
        # On a GPU when the build offloads, a layer is asked to, and a GPU is there (a bad
        # --main-gpu is refused here, before the model loads).
        on_gpu = offload and config.n_gpu_layers != 0 and _main_device(devices.probe(), config.main_gpu) is not None
        self.model = lib.llama_model_load_from_file(config.model.encode(), mparams)
        if not self.model:
            raise EngineError(f"could not load model {config.model}")
        after_model = _main_device(devices.probe(), config.main_gpu) if on_gpu else None
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.recurrent = bool(lib.llama_model_is_recurrent(self.model))
        self.hybrid = bool(lib.llama_model_is_hybrid(self.model))
        if config.spec_mode and (self.recurrent or self.hybrid):
            # A verify rolls rejected drafts back inside the batch it just decoded: n_rs_seq
            # snapshots (one per draft token) where the architecture has them (qwen35), else
            # a copy of the recurrent state before the verify (see `_verify`).
            n_rs_seq = max(n_rs_seq, config.spec_n_max)
        self.kv_bytes_per_token = self._kv_bytes_per_token()
        n_swa = int(lib.llama_model_n_swa(self.model)) if hasattr(lib, "llama_model_n_swa") else 0
        swa_budget = device_policy.swa_budget(
            config.device_bytes, gpu=after_model[0] if after_model else None,
            total_bytes=after_model[2] if after_model else 0, free_after_model=after_model[1] if after_model else 0)
        self.swa = choose_swa_full(
            config.swa_full, n_swa=n_swa, bytes_per_token=self.kv_bytes_per_token, n_ctx=config.ctx,
            device_bytes=swa_budget, host_bytes=_host_bytes(), share=config.swa_full_share,
            device_name="--device-bytes" if config.device_bytes or not after_model else f"{after_model[0]} free memory",
        )
        cparams = lib.llama_context_default_params()
        cparams.flash_attn_type = _FLASH_ATTN_TYPE[config.flash_attn]
        cparams.n_ctx = config.ctx
        cparams.n_batch = config.batch
        cparams.n_ubatch = config.batch
        cparams.n_seq_max = config.slots
        threads = self.threads = engine_threads(config.threads)
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True
        cparams.swa_full = self.swa.full
        cparams.no_perf = True
        # libllama 0.3.36 clamps it to 0 for architectures without recurrent rollback
        # (llm_arch_supports_rs_rollback: qwen35 has it, mamba2 and attention-only models not).
        cparams.n_rs_seq = n_rs_seq
        _log_capture = []
        _capture_llama_logs()
        try:
            self.ctx = lib.llama_init_from_model(self.model, cparams)
        finally:
            ctx_log, _log_capture = _log_capture, None
            _silence_llama_logs()
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise EngineError("could not create a llama context (ctx too large?)")
        self.device_report = self._device_report(config, offload, after_model, ctx_log)
        self.mem = lib.llama_get_memory(self.ctx)
        self.swa_full = self.swa.full
        self.n_ctx = lib.llama_n_ctx(self.ctx)
        self.n_batch = lib.llama_n_batch(self.ctx)
        self.n_seq_max = config.slots
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        b = self.batch
        # The batch's arrays never move: bind them once, not per token per step.
        self._batch_views = (b.token, b.pos, b.n_seq_id, b.seq_id, b.logits)
        self._decode = lib.raw("llama_decode")
        self._sample = lib.raw("llama_sampler_sample")
        self._get_logits = lib.raw("llama_get_logits")
        self._get_logits_ith = lib.raw("llama_get_logits_ith")
        self._token_text: dict[int, tuple[bytes, bool]] = {}  # a vocab's pieces never change
        self.n_rs_seq = int(lib.llama_n_rs_seq(self.ctx))
        # How a verify takes back rejected drafts: "cut" (seq_rm: attention memory), "rs"
        # (seq_rm within n_rs_seq, inside the verify batch: recurrent memory with rollback
        # snapshots) or "replay" (restore the recurrent state copied before the verify and
        # decode the accepted tokens again: recurrent memory without them, e.g. mamba2).
        self.rollback = "cut" if not (self.recurrent or self.hybrid) else (
            "rs" if self.n_rs_seq >= config.spec_n_max else "replay")
        self.replays = 0  # steps that restored and re-decoded rejected verifies (rollback "replay")
        try:
            self.memory = self._measure_memory()  # (writes the batch: the marks below start after it)
            self.weights_digest = self._weights_digest(config.model)
        except BaseException:
            lib.llama_batch_free(self.batch)
            lib.llama_free(self.ctx)
            lib.llama_model_free(self.model)
            raise
        self._batch_seq = [-1] * self.n_batch  # seq_id[k][0] as `_step` last wrote it (-1: unknown)
        self._batch_one = 0  # n_seq_id[k] == 1 for every k below this
        self.samplers: dict[int, Any] = {}
        self.backend_sampling = False  # resolved below, once the draft context is known
        self.backend_seqs: set[int] = set()
        self.greedy: set[int] = set()  # seqs whose chain is greedy alone (sampling.py `_greedy_rows`)
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
                self.drafter = open_mtp(config, self.model, self.ctx, threads=threads, digest=self.weights_digest)
            else:
                self.drafter = open_drafter(config, self.model, self.vocab, swa_full=self.swa.full, threads=threads)
        except BaseException:
            self.close()
            raise
        self.backend_sampling = backend_sampling.resolve(config.backend_sampling, on_gpu, self.drafter is not None)
        self.device_report = msgspec.structs.replace(self.device_report, backend_sampling=self.backend_sampling)
        self.props = msgspec.structs.replace(self._props(), device=self.device_report)
        if self.drafter is not None:
            self.props = msgspec.structs.replace(self.props, spec=config.spec_mode, spec_n_max=self.drafter.n_max,
                                                 spec_rollback=self.rollback,
                                                 draft_desc=self.drafter.desc, draft_n_vocab=self.drafter.n_vocab,
                                                 draft_digest=self.drafter.digest)

    def _device_report(self, config: Config, offload: bool, after_model: tuple[str, int, int] | None,
                       ctx_log: list[str]) -> J.DeviceReport:
        """Where the model runs, how flash attention resolved, and what --device-bytes means here."""
        devs = devices.probe()
        after_ctx = _main_device(devs, config.main_gpu) if after_model else None
        name, free, total = after_ctx if after_ctx else ("", 0, 0)
        budget = device_policy.device_budget(
            config.device_bytes, gpu=name or None, total_bytes=total,
            free_after_model=after_model[1] if after_model else 0, free_after_context=free,
            kv_bytes=self.kv_bytes_per_token * config.ctx,
        )
        main = next((d for d in devs if after_ctx and d.name in name), devs[0] if devs else None)
        return J.DeviceReport(
            backend=main.backend if main else "CPU",
            device=f"{main.name} ({main.description})" if main and not after_ctx else name,
            gpu_offload=offload, n_gpu_layers=config.n_gpu_layers if offload else 0, main_gpu=config.main_gpu,
            flash_attn=config.flash_attn, flash_attn_used=_flash_attn_resolved(config.flash_attn, ctx_log),
            v_trans=config.flash_attn == "off", free_bytes=free, total_bytes=total,
            budget_bytes=budget.bytes, budget_reason=budget.reason, devices=devs,
        )

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
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
            kv_bytes_per_token=self.memory.kv_bytes_per_token,
            kv_swa_bytes_per_token=self.memory.kv_swa_bytes_per_token,
            recurrent_state_bytes=self.memory.recurrent_state_bytes,
            # A pure recurrent model has no attention layer: nothing holds a cell per token.
            kv_cells=0 if recurrent and not hybrid and self.memory.kv_bytes_per_token == 0 else self.n_ctx,
            n_rs_seq=self.n_rs_seq,
            n_layer_nextn=int(lib.llama_model_n_layer_nextn(self.model)),
            weights_digest=self.weights_digest,
            pooling=self.pooling(),
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
        """An estimate before the context exists (for the --swa-full choice): every layer's K
        and V at f16 (the default type). Right for attention-only models, the only ones with a
        sliding window here; it counts a hybrid's recurrent layers as attention (4x too much on
        Qwen3.5) and is 0 on Mamba (no KV heads). Props report `_measure_memory`'s figures."""
        arch = self._meta_str("general.architecture") or ""
        n_layer = int(lib.llama_model_n_layer(self.model))
        n_head_kv = int(lib.llama_model_n_head_kv(self.model))
        head = int(lib.llama_model_n_embd(self.model)) // max(1, int(lib.llama_model_n_head(self.model)))
        k = self._meta_int(f"{arch}.attention.key_length") or head
        v = self._meta_int(f"{arch}.attention.value_length") or head
        return n_layer * n_head_kv * (k + v) * 2

    def _measure_memory(self) -> J.MemoryLayout:
        """What one sequence really holds, measured once on the fresh context.

        Decodes one token, then a second, on sequence 0 (llama_state_seq_get_size after each,
        full and LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), then erases it; the cell layout after is
        what it was before. libllama 0.3.36's per-sequence state is: per attention cell its
        pos/seq meta and every attention layer's K and V rows (the KV cache; SWA layers in a
        second cache on iSWA models), plus, on recurrent/hybrid memory, one fixed state (conv +
        SSM rows of every recurrent layer) whatever the length. PARTIAL_ONLY writes only the
        SWA cache on iSWA, only the recurrent part on hybrid memory, and everything on plain
        attention or pure recurrent memory. So: the per-token growth is the attention layers'
        bytes (0 on Mamba), the one-token state less one token's growth is the fixed part.
        Two one-token decodes: ~47 ms at start on Gemma 3 270M, microseconds on the tiny models.
        """
        flags = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = lambda f: int(lib.llama_state_seq_get_size_ext(self.ctx, 0, f))  # noqa: E731
        b = self.batch
        sizes: list[tuple[int, int]] = []
        tok = max(0, int(lib.llama_vocab_bos(self.vocab)))
        try:
            for pos in (0, 1):
                b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0] = tok, pos, 1, 1
                b.seq_id[0][0] = 0
                b.n_tokens = 1
                rc = lib.llama_decode(self.ctx, b)
                if rc != 0:
                    raise EngineError("the memory probe's decode failed", rc=rc)
                sizes.append((size(0), size(flags)))
        finally:
            lib.llama_memory_seq_rm(self.mem, 0, -1, -1)
        (s1, p1), (s2, p2) = sizes
        kv = s2 - s1
        n_swa = int(lib.llama_model_n_swa(self.model))
        return J.MemoryLayout(
            kv_bytes_per_token=kv,
            kv_swa_bytes_per_token=(p2 - p1) if n_swa > 0 and not (self.recurrent or self.hybrid) else 0,
            recurrent_state_bytes=(s1 - kv) if self.recurrent or self.hybrid else 0,
        )

    @staticmethod
    def _weights_digest(path: str) -> str:
        """Once at start: a digest of the weights (actord/engine/weights.py: sampled, 30-60 ms
        on Gemma 3 270M, not growing with the weights' bytes), cached in props and in every
        page file."""
        from actord.engine.weights import weights_digest

        try:
            return weights_digest(path)
        except (OSError, ValueError) as e:
            raise EngineError(f"could not digest the model's weights: {e}", path=path) from e

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """llama_memory_seq_rm, refusing what recurrent memory only pretends to do.

        libllama 0.3.36 on recurrent state (llama_memory_recurrent::seq_rm; hybrid memory asks
        the recurrent part first): erasing a whole sequence works; cutting at or past its end
        changes nothing and returns True; cutting into it returns False when n_rs_seq == 0, and
        with n_rs_seq > 0 returns True for a rollback of up to n_rs_seq tokens (once: the
        snapshot index is single-use), but the snapshots hold the states after the last
        n_rs_seq + 1 tokens of the last ubatch decoded, so the state is right only when the
        position rolled back to lies inside the batch just decoded: after one-token steps it
        is accepted and wrong. A range in the middle [p0, p1) with p1 at or below the end
        returns True and removes nothing. A SeqRm job runs between steps (two steps may be in
        flight), never inside the batch just decoded: on recurrent or hybrid memory it does
        only the whole erase and the cut at the end; any other cut is refused (False) here.
        """
        self._check_seq(seq)
        if (self.recurrent or self.hybrid) and not (p0 <= 0 and p1 < 0):
            end = int(lib.llama_memory_seq_pos_max(self.mem, seq)) + 1  # 0 when empty
            if not (p0 >= end and (p1 < 0 or p1 >= p0)):
                return False
        return bool(lib.llama_memory_seq_rm(self.mem, seq, p0, p1))

    # -- dispatch ----------------------------------------------------------------------

    def handle(self, job: J.Job) -> Any:
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
            case J.StateGet(seq=seq, partial=partial, into=into, capacity=capacity, then_erase=erase):
                if erase and self.drafter is not None:
                    raise InvalidParams("then_erase takes the target's sequence only on a context without a draft")
                return self.state_get(seq, partial, into, capacity, then_erase=erase)
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
            case J.Embed(inputs=inputs):
                return self.embed(inputs, self.threads)
            case J.GeneLoad() | J.GeneUnload() | J.GenePageOut() | J.GenePageIn() | J.GeneList():
                return self.genes.handle(job)
            case J.Fail(reason=reason):
                raise EngineError(f"injected engine failure: {reason}")
            case _:
                raise InvalidParams(f"unknown engine job {type(job).__name__}")

    def _draft_job(self, job: Any) -> Any:
        """A state job on the draft context's sequence. Without a draft context there is no
        draft state: size 0, nothing to copy, a set that changes nothing."""
        self._check_seq(job.seq)
        d = self.drafter
        # The MTP head's state is its carried hidden row (a header) and then its KV.
        head = d.header_size() if isinstance(d, MtpDrafter) else 0
        match job:
            case J.StateSize():
                return head + int(lib.llama_state_seq_get_size_ext(d.ctx, job.seq, 0)) if d is not None else 0
            case J.StateGet():
                if d is None:
                    return J.StateData(data=bytearray(), n_bytes=0, t_ms=0.0)
                st = self.state_get(job.seq, False, ctx=d.ctx)
                if not head:
                    return st
                data = d.header(job.seq) + bytes(st.data)  # type: ignore[union-attr]
                return J.StateData(data=memoryview(data), n_bytes=len(data), t_ms=st.t_ms)
            case J.StateSet():
                if d is None:
                    return J.StateData(data=bytearray(), n_bytes=0, t_ms=0.0)
                data = memoryview(job.data).cast("B")
                if head and not d.adopt_header(job.seq, data):  # type: ignore[union-attr]
                    d.seq_rm(job.seq, -1, -1)
                    return J.StateData(data=bytearray(), n_bytes=0, t_ms=0.0)
                try:
                    return self.state_set(job.seq, data[head:], False, ctx=d.ctx, mem=d.mem)
                except PageDoesNotFit:  # the sequence was cleared: a cold draft, not an error
                    if head:
                        d.seq_rm(job.seq, -1, -1)
                    return J.StateData(data=bytearray(), n_bytes=0, t_ms=0.0)
            case J.MemoryRange():
                if d is None:
                    return J.SeqRange(pos_min=-1, pos_max=-1)
                return J.SeqRange(pos_min=int(lib.llama_memory_seq_pos_min(d.mem, job.seq)),
                                  pos_max=int(lib.llama_memory_seq_pos_max(d.mem, job.seq)))
        raise InvalidParams(f"not a draft job: {type(job).__name__}")

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

    # -- the step ----------------------------------------------------------------------

    def step(self, job: J.Step) -> J.StepOut:
        return run_in_epoch(self, job, self._step)

    def _step(self, job: J.Step) -> J.StepOut:
        last = self.last_sampled
        fed_end, ends, end_tokens, text = self.fed_end, self.ends_on_eog, self.end_tokens, self._token_text
        check_step(job, self.n_batch, self.n_seq_max, self.samplers, last, fed_end)
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
        # Rollback "replay": the recurrent state of each drafting sequence before the verify.
        saved = {i: self.state_get(job.entries[i].seq, True).data for i in drafts} if (
            drafts and self.rollback == "replay") else {}
        token, position, n_seq_id, seq_id, logits = self._batch_views
        # What the batch already holds is not written again: every n_seq_id below the mark is
        # 1, and seq_id[k][0] is `held[k]` (libllama reads the batch, never writes it; a
        # steady decode puts each sequence at the same index step after step).
        held = self._batch_seq
        k = 0
        last_index: list[int] = []
        follow = d is not None and d.every_step  # the MTP head reads this decode's hidden rows
        spans: list[tuple[int, int]] = []  # each entry's first batch row and row count (MTP)
        skipped: set[int] | None = None  # entries not decoded (their request ended at a token fed)
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
        self.batch.n_tokens = k
        if self.before_decode is not None:
            self.before_decode()
        t0 = time.perf_counter()
        rc = self._decode(self.ctx, self.batch) if k else 0  # (every entry skipped: nothing to decode)
        t1 = time.perf_counter()
        if rc != 0 and extent:
            self.drafter.undo(job.entries, extent)  # type: ignore[union-attr]
        if rc == 1:  # no cells for this batch; libllama left the memory as it was
            raise KvCacheFull("llama_decode found no free KV cells for the step", rc=rc, n_tokens=k)
        if rc != 0:
            raise EngineError("llama_decode failed", rc=rc, n_tokens=k)
        if follow:
            d.decoded(job.entries, spans, token)  # type: ignore[union-attr]
        self._replay: list[tuple[int, Any, list[int], int]] = [] if saved else _NO_REPLAY
        out: list[J.EntryOut] = []
        last.clear()
        sample, ctx, samplers, text = self._sample, self.ctx, self.samplers, self._token_text
        grammars, logprobs, watches, greedy = self.grammars, self.logprobs, self.watches, self.greedy
        EntryOut = J.EntryOut
        # Without drafts the logit rows are the sampling entries' in order: greedy-only chains
        # take their tokens from one argmax over those rows.
        argmax: list[int] | None = None
        row = 0
        if greedy and not drafts:
            n_out, use = 0, False
            for i, e in enumerate(job.entries):
                if e.sample and not (skipped and i in skipped):
                    if not (e.feed_last or e.tokens):  # (its logits flag lands on another's token)
                        use = False
                        break
                    n_out += 1
                    use = use or e.seq in greedy
            if use:
                argmax = self._greedy_rows(n_out)
        for i, (e, idx) in enumerate(zip(job.entries, last_index)):
            if idx < 0:
                out.append(EntryOut(seq=e.seq, skipped=True))
                continue
            if drafts and i in drafts:
                out.append(self._verify(e, idx, drafts[i], extent[i], saved.get(i)))
                continue
            if e.checkpoint:
                ckpt, ckpt_pos = self.state_get(e.seq, True).data, e.pos0 + len(e.tokens) + e.feed_last
            else:
                ckpt, ckpt_pos = None, 0
            if e.sample:
                seq = e.seq
                grammar, n_top = seq in grammars, logprobs.get(seq)
                refused = ""
                if grammar:
                    tok, refused = self._sample_constrained(seq, idx, self._row(idx))
                elif argmax is not None and seq in greedy:
                    tok = argmax[row]
                else:
                    tok = sample(samplers[seq], ctx, idx)
                row += 1
                last[seq] = tok
                known = text.get(tok)
                if known is None:
                    known = text[tok] = (self.piece(tok), bool(lib.llama_vocab_is_eog(self.vocab, tok)))
                piece = known[0]
                if watches and seq in watches:  # a lazy grammar or preserved tokens (tool calls)
                    piece = self._watch(seq, watches[seq], tok, piece)
                if n_top is None and not refused:  # the common case: no extras to build
                    out.append(EntryOut(seq, tok, piece, known[1], ckpt, ckpt_pos))
                else:
                    lp, top = self._logprobs(idx, tok, n_top) if n_top is not None else (None, [])
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

    def _verify(self, e: J.StepEntry, idx: int, draft: list[int], extent: int, saved: Any = None) -> J.EntryOut:
        """A drafted entry after the decode: the request's own sampling (its chain, its
        grammar, its logprobs: as the plain path in `_step`) runs at each position in order
        while it picks the draft (policy/speculation.py `accept`); the rejected positions leave the
        target's and the draft's memory in this same job.

        How the target takes them back (`self.rollback`): attention memory cuts them
        (seq_rm). Recurrent or hybrid memory with n_rs_seq >= k (qwen35) cuts them too: the
        state rolled back to is the one after the entry's own token or an accepted draft,
        all of them in the batch just decoded, whose last k + 1 tokens libllama keeps in one
        ubatch with a snapshot after each (llama_memory_recurrent::seq_rm, split_equal's
        n_keep_tail): the one place that rollback is right (tests/serving/test_recurrent_rollback.py).
        Recurrent memory without snapshots (mamba2: llm_arch_supports_rs_rollback is false)
        restores the recurrent state copied before the verify and decodes the entry's tokens
        and the accepted drafts again, after every entry of the step has sampled
        (`_replay_accepted`)."""
        seq, text = e.seq, self._token_text
        chain, constrained, n_top = self.samplers[seq], seq in self.grammars, self.logprobs.get(seq)
        refused: dict[int, str] = {}

        def known(tok: int) -> tuple[bytes, bool]:
            k = text.get(tok)
            if k is None:
                k = text[tok] = (self.piece(tok), bool(lib.llama_vocab_is_eog(self.vocab, tok)))
            return k

        def sample(j: int) -> int:
            if not constrained:
                return int(self._sample(chain, self.ctx, idx + j))
            tok, why = self._sample_constrained(seq, idx + j, self._row(idx + j))
            if why:
                refused[j] = why
            return tok

        toks = S.accept(draft, sample, lambda t: known(t)[1] or bool(refused))
        keep = e.pos0 + len(e.tokens) + len(toks) - 1  # the entry's tokens and the accepted drafts
        if len(toks) - 1 < len(draft):
            if saved is not None:
                self._replay.append((seq, saved, list(e.tokens) + draft[:len(toks) - 1], e.pos0))
            elif not lib.llama_memory_seq_rm(self.mem, seq, keep, -1):
                raise EngineError("the target refused to cut back a rejected draft", seq=seq, pos=keep)
        n = self.drafter.keep(seq, keep, extent)  # type: ignore[union-attr]
        self.last_sampled[seq] = toks[-1]
        rows = []
        for j, t in enumerate(toks):
            piece, eog = known(t)
            lp, top = self._logprobs(idx + j, t, n_top) if n_top is not None else (None, [])
            rows.append(J.Sampled(token=t, piece=piece, eog=eog, logprob=lp, top=top, refused=refused.get(j, "")))
        f = rows[0]
        return J.EntryOut(seq=seq, token=f.token, piece=f.piece, eog=f.eog, logprob=f.logprob, top=f.top,
                          refused=f.refused, draft_n=n, drafted=len(draft), more=rows[1:])

    def _replay_accepted(self) -> None:
        """Rollback "replay": each sequence that rejected drafts gets back the recurrent
        state it had before the verify, is cut there (its attention part, on hybrid memory),
        and decodes the entry's tokens and its accepted drafts again, all in one decode
        without outputs. Runs after every entry sampled: the decode replaces the logits."""
        token, position, n_seq_id, seq_id, logits = self._batch_views
        k = 0
        for seq, state, toks, pos0 in self._replay:
            self.state_set(seq, state, True)
            if not lib.llama_memory_seq_rm(self.mem, seq, pos0, -1):
                raise EngineError("the target refused to cut back to its state before a verify", seq=seq, pos=pos0)
            for j, t in enumerate(toks):
                token[k], position[k], n_seq_id[k], logits[k] = t, pos0 + j, 1, 0
                seq_id[k][0] = self._batch_seq[k] = seq  # `_step` trusts what it last wrote
                k += 1
        self._replay = []
        self.replays += 1
        self.batch.n_tokens = k
        rc = self._decode(self.ctx, self.batch)
        if rc != 0:
            raise EngineError("decoding the accepted drafts again failed", rc=rc, n_tokens=k)

    # -- state copies ------------------------------------------------------------------

    def state_get(self, seq: int, partial: bool, into: J.HostBuffer | None = None, capacity: int = 0,
                  ctx: Any = None, then_erase: bool = False) -> J.StateData:
        """Copy a sequence's state into host memory, once: libllama writes it straight into
        `into` (a pooled, already-faulted buffer) when that is large enough, else into a
        fresh buffer of at least `capacity` bytes. The result views that very buffer. `ctx`:
        another context's sequence (the draft's). `then_erase`: the sequence is removed once
        copied (a page_out's take).

        Into a pooled buffer the state is written without asking its size first
        (llama_state_seq_get_size_ext walks the whole state as a dry run: 0.1 ms of a 1.3 ms
        copy for Gemma at 4k): libllama writes at most the buffer's capacity and answers
        what it wrote, 0 when the state did not fit (then the size is asked and a fresh
        buffer taken)."""
        self._check_seq(seq)
        ctx = ctx or self.ctx
        t0 = time.perf_counter()
        flags = self._flags(partial)
        n = 0
        if into is not None:
            arr = into.array
            ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            tl = time.perf_counter()
            n = int(lib.llama_state_seq_get_data_ext(ctx, ptr, arr.nbytes, seq, flags))
            lib_s = time.perf_counter() - tl
        if n == 0:
            size = int(lib.llama_state_seq_get_size_ext(ctx, seq, flags))
            # np.empty, not bytearray: a bytearray is zero-filled first, a second pass over
            # every page of a multi-MB buffer (measured: 7.2 ms vs 4.0 ms for 20.5 MB, where a
            # copy into a warm buffer took 4.1 ms).
            arr = np.empty(max(size, capacity, 1), dtype=np.uint8)
            ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            tl = time.perf_counter()
            n = int(lib.llama_state_seq_get_data_ext(ctx, ptr, size, seq, flags))
            lib_s = time.perf_counter() - tl
            if n != size:
                raise EngineError(f"state copy wrote {n} of {size} bytes", seq=seq)
        t = time.perf_counter()
        if then_erase:  # not part of the copy's time (libllama's seq_rm: ~0.4 ms for 4k cells)
            self.seq_rm(seq, -1, -1)
        return J.StateData(data=memoryview(arr)[:n], n_bytes=n, t_ms=(t - t0) * 1e3, lib_ms=lib_s * 1e3)

    def state_set(self, seq: int, data: Any, partial: bool, ctx: Any = None, mem: Any = None) -> J.StateData:
        """Set a sequence's state from host memory, read in place: libllama is handed the
        buffer's own address (a read-only buffer too, a mapped page file say), no copy."""
        self._check_seq(seq)
        ctx, mem = ctx or self.ctx, mem or self.mem
        t0 = time.perf_counter()
        view = memoryview(data).cast("B")
        size = view.nbytes
        # numpy takes any contiguous buffer, read-only ones included, without copying.
        src_arr = np.frombuffer(view, dtype=np.uint8) if size else np.empty(1, dtype=np.uint8)
        src = ctypes.cast(src_arr.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        tl = time.perf_counter()
        n = int(lib.llama_state_seq_set_data_ext(ctx, src, size, seq, self._flags(partial)))
        lib_s = time.perf_counter() - tl
        del src, src_arr
        if n == 0:
            # libllama clears the destination sequence when a restore fails part-way.
            lib.llama_memory_seq_rm(mem, seq, -1, -1)
            raise PageDoesNotFit(
                "the state does not fit this context (or was taken from another model)",
                seq=seq, n_bytes=size,
            )
        return J.StateData(data=bytearray(), n_bytes=n, t_ms=(time.perf_counter() - t0) * 1e3, lib_ms=lib_s * 1e3)


def run_job(engine: Engine, job: J.Job) -> Any:
    """Run one job; typed errors pass through, anything else becomes an EngineError."""
    try:
        return engine.handle(job)
    except ActordError:
        raise
    except Exception as e:  # a bug or a libllama surprise must not kill the engine thread
        raise EngineError(f"{type(e).__name__}: {e}", job=type(job).__name__) from e
