"""Embeddings, where the model pools: a second libllama context on the same loaded model.

actord's one context is generative (logits, per-sequence KV for the slots). A model whose
GGUF names a pooling type (`{arch}.pooling_type`: mean, CLS, last; an embedding model such
as a BERT, or a decoder trained for embeddings) also gets, on the first embeddings request,
a small context of its own on the engine thread: `embeddings = true`, the model's pooling,
one sequence, one ubatch the size of its n_ctx (pooling needs the whole input in one
batch). No second model load: both contexts share the weights. A model without pooling (a
generative LM) is refused with a typed InvalidParams, as llama-server refuses pooling
`none` on its OpenAI route. An input runs as one decode between the slots' steps, so it
holds the engine thread as a prompt of its length would.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

from actord.engine.llama import lib
from actord.vocabulary.errors import EngineError, InvalidParams, PromptTooLong

POOLING = {1: "mean", 2: "cls", 3: "last"}  # libllama's pooling types that give one vector per input


def pooling_type(ctx: Any) -> int:
    """The pooling type libllama reads from the model (llama_pooling_type of a context on it)."""
    return int(lib.llama_pooling_type(ctx))


class Embedder:
    """The embeddings context on the engine's model, made on the first request, and its job."""

    def __init__(self, model: Any, ctx: Any, n_ctx: int) -> None:
        """`ctx`: the engine's own context (its pooling is the model's), `n_ctx` its size."""
        self.model, self.ctx, self.n_ctx = model, ctx, n_ctx
        self._embed: tuple[Any, Any, int] | None = None  # (context, batch, n_ctx), made on first use

    def embed(self, inputs: list[list[int]], threads: int) -> list[list[float]]:
        """One L2-normalized vector per input (token lists), pooled as the model says."""
        pooling = pooling_type(self.ctx)
        if pooling not in POOLING:
            raise InvalidParams("this model does not pool (it names no pooling type: a generative model): "
                                "embeddings need an embedding model, and actord runs one model", param="model",
                                pooling=pooling)
        if self._embed is None:
            cp = lib.llama_context_default_params()
            n = min(int(lib.llama_model_n_ctx_train(self.model)) or self.n_ctx, self.n_ctx)
            cp.n_ctx = cp.n_batch = cp.n_ubatch = n
            cp.n_seq_max = 1
            cp.embeddings = True
            cp.pooling_type = pooling
            cp.n_threads = cp.n_threads_batch = threads
            cp.no_perf = True
            ctx = lib.llama_init_from_model(self.model, cp)
            if not ctx:
                raise EngineError("could not create the embeddings context")
            self._embed = (ctx, lib.llama_batch_init(n, 0, 1), int(lib.llama_n_ctx(ctx)))
        ctx, batch, n_ctx = self._embed
        n_embd = int(lib.llama_model_n_embd(self.model))
        out = []
        for i, toks in enumerate(inputs):
            if not toks:
                raise InvalidParams(f"input[{i}] is empty", param="input")
            if len(toks) > n_ctx:
                raise PromptTooLong(f"input[{i}] of {len(toks)} tokens does not fit the embeddings context of "
                                    f"{n_ctx}", n_prompt_tokens=len(toks), n_ctx=n_ctx, param="input")
            lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
            for k, t in enumerate(toks):
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = t, k, 1
                batch.seq_id[k][0], batch.logits[k] = 0, 1
            batch.n_tokens = len(toks)
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                raise EngineError("llama_decode failed in the embeddings context", rc=rc)
            ptr = lib.llama_get_embeddings_seq(ctx, 0)
            if not ptr:
                raise EngineError("the embeddings context returned no pooled vector")
            vec = list(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))[:n_embd])
            norm = math.sqrt(sum(v * v for v in vec)) or 1.0
            out.append([v / norm for v in vec])
        return out

    def close(self) -> None:
        if self._embed is not None:
            ctx, batch, _ = self._embed
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)
            self._embed = None
