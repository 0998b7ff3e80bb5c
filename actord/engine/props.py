"""What the model and the context say about themselves: `ModelProps` (the serving side plans
from them: n_ctx, memory kinds, bytes per token, the draft) and the chat template's facts.

Built once at start on the engine thread (engine/engine.py) and answered from then on
(`ModelInfo`, `ChatInfo` jobs) without a libllama call: the figures never change.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.engine import jobs as J
from actord.engine.context import model_desc
from actord.engine.llama import lib
from actord.service.config import Config


class Props:
    """A mixin of Engine: props and chat template info (see the module docstring)."""

    model: Any
    vocab: Any
    drafter: Any

    def _props(self, config: Config) -> J.ModelProps:
        """The model's and the context's facts, where the model runs, and the draft's."""
        n_swa = int(lib.llama_model_n_swa(self.model)) if hasattr(lib, "llama_model_n_swa") else 0
        recurrent = bool(lib.llama_model_is_recurrent(self.model))
        hybrid = bool(lib.llama_model_is_hybrid(self.model)) if hasattr(lib, "llama_model_is_hybrid") else False
        props = J.ModelProps(
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
            desc=model_desc(self.model),
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
            device=self.device_report,
        )
        if self.drafter is None:
            return props
        return msgspec.structs.replace(props, spec=config.spec_mode, spec_n_max=self.drafter.n_max,
                                       spec_rollback=self.rollback, draft_desc=self.drafter.desc,
                                       draft_n_vocab=self.drafter.n_vocab, draft_digest=self.drafter.digest)

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
            arch=self._meta_str("general.architecture") or "",
        )
