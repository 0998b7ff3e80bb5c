"""Typed engine jobs and their results.

A job is pure data: what to do to libllama, never why. Actors build jobs, the engine thread
runs them one at a time, and the result (or a typed error) comes back to the awaiting task.
Being msgspec Structs, jobs and results can be digested into a trace and replayed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class Job(msgspec.Struct, tag=True, frozen=True):
    # How the engine thread queues a job (engine/thread.py): `between_steps`, at the next
    # step boundary, ahead of steps already queued; `overlaps`, its result may wait for the
    # next step's decode to reach the loop. Class-level, so neither is in the job's data.
    between_steps: ClassVar[bool] = False
    overlaps: ClassVar[bool] = False


class SamplingParams(msgspec.Struct, frozen=True):
    """One sequence's samplers: a grammar (beside the chain: Samplers.sample_constrained),
    then the chain in this order: logit biases, penalties, then greedy or
    top_k/top_p/min_p/temperature/dist."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0
    grammar: str = ""  # GBNF, root rule "root"; "" = unconstrained
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); -inf bans the token
    penalty_last_n: int = 0  # how many of the last sampled tokens the penalties count (0 = off)
    repeat_penalty: float = 1.0  # 1 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0  # 0 = off
    # Log probabilities of each sampled token (and of the `top_logprobs` likeliest ones),
    # from the step's raw logits; -1 = not asked (nothing computed).
    top_logprobs: int = -1
    # The logprobs are of the candidates the chain left, after its samplers (llama-server's
    # post_sampling_probs): the sequence samples through the engine's candidate array
    # (Samplers.sample_constrained) so that array can be read.
    post_sampling: bool = False
    # A lazy grammar: free sampling until one of these (text, at_start) appears in the output,
    # then the grammar, fed from the trigger's start (Samplers.watch). () = from the first token.
    grammar_triggers: tuple[tuple[str, bool], ...] = ()
    # Control tokens (by their text) whose text the output's pieces keep.
    preserve: tuple[str, ...] = ()
    # The request ends at an end-of-generation token (it does not ignore eos), and at any of
    # `end_tokens` (its stop tokens): once such a token is fed, a `feed_last` entry planned
    # before anyone knew (pipeline depth >= 3) is not decoded (EntryOut.skipped), so the KV
    # ends at that token as it does at depth 2.
    end_on_eog: bool = False
    end_tokens: tuple[int, ...] = ()


class ModelInfo(Job):
    pass


class Tokenize(Job):
    text: str
    add_special: bool = True
    parse_special: bool = True

    between_steps = True  # the vocabulary only: no sequence, no context state


class Detokenize(Job):
    tokens: list[int]

    between_steps = True


class Pieces(Job):
    """Each token's bytes (llama_token_to_piece); `special`: control tokens as their text,
    as llama-server's /tokenize pieces and /detokenize render them."""

    tokens: list[int]
    special: bool = True

    between_steps = True


class SeqRm(Job):
    """Remove positions [p0, p1) of a sequence; p1 = -1 means to the end. The draft
    context's sequence (speculation) is cut alike; with `draft`, only it is."""

    seq: int
    p0: int = 0
    p1: int = -1
    draft: bool = False
    # A cut to p0 that a resume at p0 relies on: refused (False, nothing removed) unless the
    # sliding-window layers hold every position p0 attends to (state_copy.py `window_whole`).
    window: bool = False

    # Sent only for a sequence that no queued step holds (an idle slot's; a lost slot's once
    # nothing of it is in flight), so it runs at the next step boundary (engine/thread.py).
    # A rollback of a sequence with steps in flight must be a job of its own, in order.
    between_steps = True


class SeqCopy(Job):
    """Make sequence `dst` hold what sequence `src` holds (llama_memory_seq_rm of dst, then
    llama_memory_seq_cp src -> dst, as llama-server forks an `n_cmpl` prompt to its child
    slots). With the unified KV cache the cells are shared, not copied; recurrent state
    shares its cell until dst's next decode copies it. The draft context's dst sequence
    (speculation) is cleared: it catches up from zero. Both sequences must be idle (no queued
    step holds either), as for SeqRm."""

    src: int
    dst: int

    between_steps = True


class SeqShare(Job):
    """Make sequence `dst` hold the first `n` positions of sequence `src`, shared: dst is
    cleared, then llama_memory_seq_cp over [0, n) adds dst to those cells of the unified KV
    cache (nothing is copied). Answers False, dst untouched, when src does not hold [0, n)
    whole: fewer positions, a sliding window already past what position n attends to, or
    recurrent memory (one state at the end of a sequence, not one per cell). `src` may have
    a request running: the job runs between steps and cells below `n` never change while it
    runs. The draft context's dst sequence is cleared (it catches up from zero)."""

    src: int
    dst: int
    n: int
    # A checkpoint of src's at n (a partial state: the recurrent state, or the sliding-window
    # cells, as of position n): dst takes src's attention cells below n and this for the
    # rest, so memory that cannot share cells starts where src's checkpoint left it.
    checkpoint: bytes | bytearray | memoryview | None = None

    between_steps = True


class SetSampler(Job):
    seq: int
    params: SamplingParams

    between_steps = True  # a request's start, before any step holds its sequence


class FreeSampler(Job):
    seq: int


class StepEntry(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    tokens: list[int]
    pos0: int
    sample: bool  # take logits for the last token and sample from the seq's sampler
    checkpoint: bool = False  # snapshot the seq's partial state right after this decode
    # Decode the token this seq sampled in the engine's previous step (then `tokens` is
    # empty): the scheduler plans step k+1 before step k's sample reaches Python, so the
    # engine never waits for Python between two steps.
    feed_last: bool = False
    # Speculative decoding (engine/draft.py, policy/speculation.py). `draft_tokens` go into the draft
    # context's sequence at `draft_pos0` before the step (the draft catching up with what
    # the target holds); then, with `draft` = k > 0, the draft model proposes k tokens after
    # the entry's last token, which the target decodes in this same batch and verifies
    # (a k-token draft needs draft_pos0 + len(draft_tokens) == pos0 + len(tokens)).
    draft_tokens: list[int] = []
    draft_pos0: int = 0
    draft: int = 0
    # The prompt's last logits (engine/step.py `Stepper.memo`): MEMO_KEEP, this entry ends a
    # prompt and the engine keeps its last row for the sequence; MEMO_REUSE, the entry's one
    # token is already the sequence's cell at pos0 (the slot kept it) and is sampled from the
    # kept row when that row is still the cells' own, else decoded again.
    memo: int = 0


MEMO_KEEP = 1
MEMO_REUSE = 2


class Step(Job):
    """One llama_decode over every entry (continuous batching), then sampling.

    `epoch` is the engine epoch the plan was made in: a failed step ends the epoch, and the
    steps planned before anyone knew are skipped (`StepSkipped`), changing nothing."""

    entries: list[StepEntry]
    genes: tuple[tuple[int, float], ...] = ()
    epoch: int = 0

    # Steps overlap the loop's work on the step before (engine/thread.py).
    overlaps = True


class StateSize(Job):
    seq: int
    partial: bool = False
    draft: bool = False  # the draft context's sequence, not the target's

    # A state move of an idle slot's sequence (no queued step holds it): runs at the next
    # step boundary, ahead of steps already queued (engine/thread.py).
    between_steps = True


class MemoHeld(Job):
    """Does sequence `seq` hold the logits of `token` at `pos` kept from its prompt's decode
    (StepEntry.memo)? A slot asks before it keeps a prompt's last cell for a MEMO_REUSE."""

    seq: int
    pos: int
    token: int

    between_steps = True  # an idle slot's sequence, as a state move's


class HostBuffer:
    """A host buffer a state is copied into: pre-faulted memory from the page store's pool
    (serving/buffer_pool.py), so a page_out writes warm pages instead of faulting fresh ones.

    Its content before the copy is stale and no part of a job: a trace digests only its
    capacity (repr)."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array  # a writable, C-contiguous numpy uint8 array

    @property
    def capacity(self) -> int:
        return int(self.array.nbytes)

    def __repr__(self) -> str:
        return f"HostBuffer({self.capacity})"


class StateGet(Job):
    """Copy a sequence's state into host memory, once: libllama writes it into `into` when
    given (and large enough), else into a fresh buffer of at least `capacity` bytes."""

    seq: int
    partial: bool = False
    into: Any = None  # HostBuffer | None
    capacity: int = 0
    draft: bool = False  # the draft context's sequence instead (speculative decoding)
    # Remove the sequence once it is copied (a page_out's take: one engine round trip less
    # than a StateGet and then a SeqRm; the caller sets the state back if the page cannot
    # be kept). Only the target's sequence, and only on a context without a draft.
    then_erase: bool = False
    # Only positions [p0, p1) (p1 -1: to the end): a shared prefix's page, or a page of what
    # follows one. Copied through the engine's scratch sequence (the cells are shared, then
    # written out as that sequence's state), so the bytes are libllama's own format.
    p0: int = 0
    p1: int = -1

    # A state move of an idle slot's sequence (no queued step holds it): runs at the next
    # step boundary, ahead of steps already queued (engine/thread.py).
    between_steps = True


class StateSet(Job):
    """Set a sequence's state. With a base (`base_seq` >= 0: that sequence's first `n_base`
    cells, shared as SeqShare does; else `base` data: a shared prefix's state), `data` holds
    only the positions from `n_base` on and goes in through the scratch sequence, so the
    sequence ends up holding base + data; `n_tokens` (when >= 0) is what it must then hold,
    else the sequence is cleared and PageDoesNotFit raised."""

    seq: int
    data: bytes | bytearray | memoryview
    partial: bool = False
    base: bytes | bytearray | memoryview | None = None
    base_seq: int = -1
    n_base: int = 0
    n_tokens: int = -1
    # The draft context's sequence. A refused draft state clears that sequence and answers
    # n_bytes 0 (a cold draft), never an error: the target's state is what matters.
    draft: bool = False

    # A state move of an idle slot's sequence (no queued step holds it): runs at the next
    # step boundary, ahead of steps already queued (engine/thread.py).
    between_steps = True


class MemoryRange(Job):
    seq: int
    draft: bool = False

    between_steps = True  # read-only, an idle slot's sequence (a resume's check)


class StepRecords(Job):
    pass


# Jobs that read what the engine already knows: they neither wake a sleeping engine nor
# count as activity for the idle clock (the memory report asks StepRecords on a timer).
QUIET: tuple[type, ...] = (ModelInfo, StepRecords)  # ChatInfo joins below, once defined


class GeneLoad(Job):
    path: str
    image: bytes  # read from disk on a worker thread, never on the engine thread


class GeneUnload(Job):
    id: int


class GenePageOut(Job):
    id: int


class GenePageIn(Job):
    id: int


class GeneList(Job):
    pass


class ChatInfo(Job):
    """What chat rendering needs from the model: its template and special-token texts."""


QUIET = (*QUIET, ChatInfo)


class Embed(Job):
    """One pooled, L2-normalized vector per input (token lists): Engine.embed (engine/embed.py)."""

    inputs: list[list[int]]


class Sleep(Job):
    """Free the model and the context (llama-server's sleep): refused while any sequence
    holds cells. Gene images stay in host RAM; the next job that needs libllama loads the
    model again (Engine.wake), with the genes that were resident made resident again."""


class Fail(Job):
    """Test and simulation seam: a job that fails on the engine thread."""

    reason: str = "injected"


# ---- results -------------------------------------------------------------------------


class DeviceInfo(msgspec.Struct, frozen=True):
    """One ggml backend device (ggml_backend_dev_*), its memory when read."""

    name: str  # "CUDA0", "Metal", "CPU"
    description: str  # "NVIDIA H200", the CPU's model name
    type: str  # cpu | gpu | igpu | accel | meta
    backend: str  # the backend registry's name: "CUDA", "Metal", "CPU"
    free_bytes: int
    total_bytes: int


class DeviceReport(msgspec.Struct, frozen=True):
    """Where the engine computes and what that leaves (props["device"])."""

    backend: str = "CPU"  # the backend of the device the model runs on
    device: str = ""  # that device's name and description
    gpu_offload: bool = False  # llama_supports_gpu_offload(): a GPU backend is present
    n_gpu_layers: int = 0  # layers asked to be offloaded (-1 = all); 0 where no GPU backend
    main_gpu: int = 0
    flash_attn: str = "auto"  # as asked: auto | on | off
    flash_attn_used: str = ""  # what libllama resolved: on | off ("" = not reported)
    # The KV cache's V layout: transposed when flash attention is off outright (libllama
    # sizes V so only the non-FA path reads it transposed; "auto" keeps it untransposed). A
    # state taken from one layout does not restore into the other: page files record it.
    v_trans: bool = False
    # The KV cache's element types (--cache-type-k / -v): a state holds its cells in them, so
    # page files record them and refuse a state of other types.
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    free_bytes: int = 0  # the main device's free memory after the model and context (0: CPU)
    total_bytes: int = 0
    budget_bytes: int = 0  # what --device-bytes resolved to (0 = unlimited; actord.policy.device)
    budget_reason: str = ""
    devices: list[DeviceInfo] = []
    backend_sampling: bool = False  # eligible sampler chains run in the decode's graph


class ModelProps(msgspec.Struct, frozen=True):
    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_vocab: int
    n_ctx_train: int
    n_swa: int
    recurrent: bool
    hybrid: bool
    needs_checkpoints: bool
    bos: int
    eos: int
    desc: str
    swa_full: bool = False  # the cache keeps every position of every layer (no checkpoints needed)
    swa_full_reason: str = ""  # why (actord.policy.swa)
    # Measured on the context (Context._measure_memory): a sequence of n tokens holds
    # recurrent_state_bytes + n * kv_bytes_per_token bytes of state (what a page copies).
    kv_bytes_per_token: int = 0  # attention layers only (SWA layers included, as a full cache)
    kv_swa_bytes_per_token: int = 0  # the SWA layers' part of it (bounded by the window unless swa_full)
    recurrent_state_bytes: int = 0  # fixed per sequence (recurrent/hybrid), whatever its length
    # Cells a token takes in the attention KV cache's n_ctx (the scheduler's charge); 0 when
    # nothing does (pure recurrent: sequences are not bounded by n_ctx).
    kv_cells: int = 0
    n_rs_seq: int = 0  # recurrent snapshots per sequence (device rows x (1 + n_rs_seq)); 0 in actord
    n_layer_nextn: int = 0  # MTP (nextn) layers in the model file
    weights_digest: str = ""  # actord/engine/weights.py: a page or file from other weights is refused
    pooling: int = 0  # libllama's pooling type (0 none: no embeddings; 1 mean, 2 cls, 3 last: engine/embed.py)
    device: DeviceReport = DeviceReport()  # backend, devices, offload, flash attention, budget
    # Speculative decoding as started: "" (none), "draft" (a separate draft model) or "mtp"
    # (the model's own MTP head, engine/mtp.py), with at most spec_n_max draft tokens per
    # step and the drafter's description. spec_rollback: how a verify takes rejected drafts
    # back from the target (engine/step.py `_verify`): "cut" (attention memory), "rs"
    # (recurrent rollback snapshots, n_rs_seq >= spec_n_max) or "replay" (the recurrent
    # state copied before the verify, restored, the accepted tokens decoded again).
    spec: str = ""
    spec_n_max: int = 0
    spec_rollback: str = ""
    draft_desc: str = ""
    draft_n_vocab: int = 0
    draft_digest: str = ""  # the draft model's weights digest: a page's draft state names it
    # A slot may keep its prompt's last cell and sample a repeat of that prompt from the
    # logits the engine kept (StepEntry.memo): attention memory (a recurrent state cannot cut
    # that one cell back when the logits are gone), no drafter, Config.prompt_logits_memo.
    prompt_logits: bool = False


class MemoryLayout(msgspec.Struct, frozen=True):
    kv_bytes_per_token: int
    kv_swa_bytes_per_token: int
    recurrent_state_bytes: int


class Sampled(msgspec.Struct, frozen=True, array_like=True):
    """One more token a speculating entry's target sampled (as EntryOut's own fields)."""

    token: int
    piece: bytes
    eog: bool
    logprob: float | None = None
    top: list[tuple[int, float, bytes]] = []
    refused: str = ""


class EntryOut(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    token: int = -1  # sampled token, -1 when the entry did not sample
    piece: bytes = b""
    eog: bool = False
    checkpoint: bytearray | None = None  # partial state after this entry's decode
    checkpoint_pos: int = 0
    # Asked for (SamplingParams.top_logprobs >= 0): the sampled token's log probability
    # under the model (log-softmax of the raw logits) and the likeliest tokens' (token,
    # logprob, piece), most likely first.
    logprob: float | None = None
    top: list[tuple[int, float, bytes]] = []
    # Why the sample is not usable ("" = it is): the sequence's grammar allowed no token
    # its other samplers left. The request ends with an InvalidParams; `token` is what the
    # engine feeds if a step in flight feeds it.
    refused: str = ""
    # A speculating entry: the draft tokens the target accepted, as the target sampled them
    # after `token` (its KV holds the entry's tokens and these), how far the draft context's
    # sequence reaches after the step (-1: the entry did not touch it), and how many tokens
    # were drafted (fewer than the entry's `draft` when the draft context could not).
    more: list[Sampled] = []
    draft_n: int = -1
    drafted: int = 0  # tokens the draft model proposed for this entry (the target verified them)
    # A `feed_last` entry not decoded: the sequence was fed a token that ends its request
    # (SamplingParams.end_on_eog, end_tokens); nothing of it is in the KV.
    skipped: bool = False


class StepOut(msgspec.Struct, frozen=True):
    step: int
    entries: list[EntryOut]
    n_tokens: int
    t_decode_ms: float
    t_sample_ms: float
    epoch: int = 0


class StepRecord(msgspec.Struct, frozen=True):
    step: int
    seqs: list[int]
    n_tokens: int
    genes: tuple[tuple[int, float], ...]
    drafts: list[list[int]] = []  # per entry, the tokens the draft model proposed (speculation)
    draft_in: int = 0  # tokens the draft context caught up on before drafting


class SeqRange(msgspec.Struct, frozen=True):
    pos_min: int
    pos_max: int


class GeneInfo(msgspec.Struct, frozen=True):
    id: int
    path: str
    resident: bool
    n_bytes: int
    n_moved: int = 0
    t_ms: float = 0.0
    # The adapter file's content digest: what names the gene outside this process (a page
    # file's genes), where ids are load order (vocabulary/kv_identity.py).
    digest: str = ""


class ChatTemplateInfo(msgspec.Struct, frozen=True):
    template: str | None  # tokenizer.chat_template, None when the model ships none
    bos_text: str
    eos_text: str
    add_bos: bool
    bos: int
    arch: str = ""  # general.architecture: which built-in template a model without its own gets


class StateData(msgspec.Struct, frozen=True):
    data: bytearray | memoryview  # a writable host buffer the engine filled in place
    n_bytes: int
    t_ms: float
    lib_ms: float = 0.0  # of t_ms, the time inside llama_state_seq_get/set_data alone
