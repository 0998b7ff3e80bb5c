"""Opening the model and its context, and what that start measures: where it runs.

Everything here runs once per start or wake of the engine (engine/engine.py), on the engine thread:
load the model, choose --swa-full (policy/swa.py) from an estimate of the KV's bytes, create
the one context (n_seq_max = slots, unified KV) while libllama's log is kept
(engine/log_capture.py: how "auto" flash attention resolved is said there only), then
measure what a sequence really holds and digest the weights. Kept apart from the engine's
per-step code because none of it runs again, and because it is where devices are probed
(engine/devices.py) and --device-bytes is read against them (policy/device.py).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from actord.engine import devices, log_capture
from actord.engine import jobs as J
from actord.engine.llama import lib
from actord.policy import device as device_policy
from actord.policy.swa import SwaChoice, choose_swa_full
from actord.vocabulary.config import Config, engine_threads
from actord.vocabulary.errors import EngineError, InvalidParams


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
GGML_TYPE = {"f16": 1, "q4_0": 2, "q8_0": 8}  # enum ggml_type, for Config.CACHE_TYPES
# Bytes per element of each cache type (ggml's block sizes: q8_0 is 34 bytes per 32, q4_0 18).
TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


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


def context_params(config: Config, *, threads: int, swa_full: bool) -> Any:
    """A context's parameters as actord makes every one from its Config (the target's, a draft
    model's, the MTP head's): a ubatch as large as the batch, one sequence per slot in one
    unified KV, the same threads for both decode kinds, no perf counters."""
    cp = lib.llama_context_default_params()
    cp.n_ctx = config.ctx
    cp.n_batch = config.batch
    cp.n_ubatch = config.batch
    # One sequence beyond the slots: the engine's scratch, through which part of a sequence
    # is copied out or set in (llama_state_seq_* move whole sequences only).
    cp.n_seq_max = config.slots + 1
    cp.n_threads = threads
    cp.n_threads_batch = threads
    cp.kv_unified = True
    cp.swa_full = swa_full
    cp.no_perf = True
    cp.type_k = GGML_TYPE[config.cache_type_k]  # --cache-type-k / -v (every context: target, draft, MTP)
    cp.type_v = GGML_TYPE[config.cache_type_v]
    return cp


def model_desc(model: Any) -> str:
    """libllama's one-line description of a model (architecture, size, type)."""
    desc = ctypes.create_string_buffer(256)
    lib.llama_model_desc(model, desc, 256)
    return desc.value.decode(errors="replace")


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


class Context:
    """The model, its one context, the reusable batch, and what the start measured of them
    (see the module docstring). The engine's collaborators read these; only `close` frees them."""

    model: Any
    ctx: Any
    vocab: Any
    mem: Any
    batch: Any
    recurrent: bool
    hybrid: bool
    swa: SwaChoice
    kv_bytes_per_token: int

    def __init__(self, config: Config, n_rs_seq: int) -> None:
        """Load the model, create the context and the batch, measure them (`on_gpu`: the
        model runs on a GPU). A context that cannot be made or measured is freed with the model."""
        if not os.path.exists(config.model):
            raise InvalidParams(f"model file not found: {config.model}", path=config.model)
        if n_rs_seq < 0:
            raise InvalidParams("n_rs_seq must be >= 0", n_rs_seq=n_rs_seq)
        log_capture.silence()
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
        self.kv_bytes_per_token = self._kv_bytes_per_token(config.cache_type_k, config.cache_type_v)
        n_swa = int(lib.llama_model_n_swa(self.model)) if hasattr(lib, "llama_model_n_swa") else 0
        swa_budget = device_policy.swa_budget(
            config.device_bytes, gpu=after_model[0] if after_model else None,
            total_bytes=after_model[2] if after_model else 0, free_after_model=after_model[1] if after_model else 0)
        self.swa = choose_swa_full(
            config.swa_full, n_swa=n_swa, bytes_per_token=self.kv_bytes_per_token, n_ctx=config.ctx,
            device_bytes=swa_budget, host_bytes=_host_bytes(), share=config.swa_full_share,
            device_name="--device-bytes" if config.device_bytes or not after_model else f"{after_model[0]} free memory",
        )
        self.threads = engine_threads(config.threads)
        cparams = context_params(config, threads=self.threads, swa_full=self.swa.full)
        cparams.flash_attn_type = _FLASH_ATTN_TYPE[config.flash_attn]
        # libllama 0.3.36 clamps it to 0 for architectures without recurrent rollback
        # (llm_arch_supports_rs_rollback: qwen35 has it, mamba2 and attention-only models not).
        cparams.n_rs_seq = n_rs_seq
        with log_capture.capture() as ctx_log:
            self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise EngineError("could not create a llama context (ctx too large?)")
        self.device_report = self._device_report(config, offload, after_model, ctx_log)
        self.mem = lib.llama_get_memory(self.ctx)
        self.swa_full = self.swa.full
        self.n_ctx = lib.llama_n_ctx(self.ctx)
        self.n_batch = lib.llama_n_batch(self.ctx)
        self.n_ubatch = lib.llama_n_ubatch(self.ctx)  # how libllama splits a decode (engine/step.py `_one_ubatch`)
        self.n_seq_max = config.slots
        self.scratch = config.slots  # the sequence part-copies go through (context_params)
        self.n_swa = n_swa
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        b = self.batch
        # The batch's arrays never move: bind them once, not per token per step.
        self.batch_views = (b.token, b.pos, b.n_seq_id, b.seq_id, b.logits)
        self.decode = lib.raw("llama_decode")
        self.sample = lib.raw("llama_sampler_sample")
        self.get_logits = lib.raw("llama_get_logits")
        self.get_logits_ith = lib.raw("llama_get_logits_ith")
        self.n_rs_seq = int(lib.llama_n_rs_seq(self.ctx))
        # How a verify takes back rejected drafts: "cut" (seq_rm: attention memory), "rs"
        # (seq_rm within n_rs_seq, inside the verify batch: recurrent memory with rollback
        # snapshots) or "replay" (restore the recurrent state copied before the verify and
        # decode the accepted tokens again: recurrent memory without them, e.g. mamba2).
        self.rollback = "cut" if not (self.recurrent or self.hybrid) else (
            "rs" if self.n_rs_seq >= config.spec_n_max else "replay")
        try:
            self.memory = self._measure_memory()  # (writes the batch: the marks below start after it)
            self.weights_digest = self._weights_digest(config.model)
        except BaseException:
            lib.llama_batch_free(self.batch)
            lib.llama_free(self.ctx)
            lib.llama_model_free(self.model)
            raise
        self.on_gpu = on_gpu

    def close(self) -> None:
        """Free the batch, the context and the model, once."""
        if self.ctx is None:
            return
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)
        self.ctx = self.model = self.batch = None

    def check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise InvalidParams(f"sequence {seq} out of range", seq=seq)

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
            v_trans=config.flash_attn == "off", cache_type_k=config.cache_type_k, cache_type_v=config.cache_type_v,
            free_bytes=free, total_bytes=total,
            budget_bytes=budget.bytes, budget_reason=budget.reason, devices=devs,
        )

    def meta_str(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(64)
        if lib.llama_model_meta_val_str(self.model, key.encode(), buf, 64) < 0:
            return None
        return buf.value.decode(errors="replace")

    def _meta_int(self, key: str) -> int | None:
        try:
            return int(self.meta_str(key) or "")
        except ValueError:
            return None

    def _kv_bytes_per_token(self, type_k: str = "f16", type_v: str = "f16") -> int:
        """An estimate before the context exists (for the --swa-full choice): every layer's K
        and V in the cache's types (--cache-type-k / -v). Right for attention-only models, the only ones with a
        sliding window here; it counts a hybrid's recurrent layers as attention (4x too much on
        Qwen3.5) and is 0 on Mamba (no KV heads). Props report `_measure_memory`'s figures."""
        arch = self.meta_str("general.architecture") or ""
        n_layer = int(lib.llama_model_n_layer(self.model))
        n_head_kv = int(lib.llama_model_n_head_kv(self.model))
        head = int(lib.llama_model_n_embd(self.model)) // max(1, int(lib.llama_model_n_head(self.model)))
        k = self._meta_int(f"{arch}.attention.key_length") or head
        v = self._meta_int(f"{arch}.attention.value_length") or head
        return int(n_layer * n_head_kv * (k * TYPE_BYTES[type_k] + v * TYPE_BYTES[type_v]))

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
