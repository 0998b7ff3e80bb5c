"""What the model and the context say about themselves: `ModelProps` (the serving side plans
from them: n_ctx, memory kinds, bytes per token, the draft) and the chat template's facts.

Built once at start on the engine thread (engine/engine.py) and answered from then on
(`ModelInfo`, `ChatInfo` jobs) without a libllama call: the figures never change.
"""

from __future__ import annotations

import msgspec

from actord.engine import jobs as J
from actord.engine.context import Context, model_desc
from actord.engine.draft import Drafter
from actord.engine.embed import pooling_type
from actord.engine.llama import lib
from actord.engine.mtp import MtpDrafter
from actord.engine.vocab import Vocab
from actord.vocabulary.config import Config


def model_props(config: Config, c: Context, drafter: Drafter | MtpDrafter | None) -> J.ModelProps:
    """The model's and the context's facts, where the model runs, and the draft's."""
    n_swa = int(lib.llama_model_n_swa(c.model)) if hasattr(lib, "llama_model_n_swa") else 0
    recurrent = bool(lib.llama_model_is_recurrent(c.model))
    hybrid = bool(lib.llama_model_is_hybrid(c.model)) if hasattr(lib, "llama_model_is_hybrid") else False
    props = J.ModelProps(
        n_ctx=c.n_ctx,
        n_batch=c.n_batch,
        n_seq_max=c.n_seq_max,
        n_vocab=lib.llama_vocab_n_tokens(c.vocab),
        n_ctx_train=lib.llama_model_n_ctx_train(c.model),
        n_swa=n_swa,
        recurrent=recurrent,
        hybrid=hybrid,
        # Memory that cannot be cut back to an arbitrary position needs checkpoints.
        needs_checkpoints=recurrent or hybrid or (n_swa > 0 and not c.swa_full),
        bos=lib.llama_vocab_bos(c.vocab),
        eos=lib.llama_vocab_eos(c.vocab),
        desc=model_desc(c.model),
        swa_full=c.swa_full and n_swa > 0,
        swa_full_reason=c.swa.reason,
        kv_bytes_per_token=c.memory.kv_bytes_per_token,
        kv_swa_bytes_per_token=c.memory.kv_swa_bytes_per_token,
        recurrent_state_bytes=c.memory.recurrent_state_bytes,
        # A pure recurrent model has no attention layer: nothing holds a cell per token.
        kv_cells=0 if recurrent and not hybrid and c.memory.kv_bytes_per_token == 0 else c.n_ctx,
        n_rs_seq=c.n_rs_seq,
        n_layer_nextn=int(lib.llama_model_n_layer_nextn(c.model)),
        weights_digest=c.weights_digest,
        pooling=pooling_type(c.ctx),
        device=c.device_report,
        prompt_logits=config.prompt_logits_memo and not (recurrent or hybrid) and drafter is None,
    )
    if drafter is None:
        return props
    return msgspec.structs.replace(props, spec=config.spec_mode, spec_n_max=drafter.n_max,
                                   spec_rollback=c.rollback, draft_desc=drafter.desc,
                                   draft_n_vocab=drafter.n_vocab, draft_digest=drafter.digest)


def chat_info(c: Context, vocab: Vocab) -> J.ChatTemplateInfo:
    """The GGUF's tokenizer.chat_template (None if absent) and the BOS/EOS texts."""
    raw = lib.llama_model_chat_template(c.model, None)
    bos = int(lib.llama_vocab_bos(c.vocab))
    return J.ChatTemplateInfo(
        template=raw.decode(errors="replace") if raw else None,
        bos_text=vocab.token_text(bos),
        eos_text=vocab.token_text(int(lib.llama_vocab_eos(c.vocab))),
        add_bos=bool(lib.llama_vocab_get_add_bos(c.vocab)),
        bos=bos,
        arch=c.meta_str("general.architecture") or "",
    )
