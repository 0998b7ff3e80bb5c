"""Every message actors exchange: one tagged union per mailbox.

Actors are nouns, messages are verbs (`Complete`, `PageOut`) or facts (`Ended`).
Messages are pure data; reply channels and stream sinks travel in the envelope.
"""

from __future__ import annotations

import msgspec

from actord.vocabulary.types import CompletionRequest, ThoughtBudget


class Msg(msgspec.Struct, tag=True, frozen=True):
    pass


# ---- Slot inbox ------------------------------------------------------------------------


class Complete(Msg):
    rid: int
    req: CompletionRequest
    # Forwarded by the placer as the mind's resident slot: if the slot no longer holds
    # `req.mind` when it starts (evicted or moved meanwhile; the slot's tell of it crossed
    # the forward), it hands the request back to the placer (`Misplaced`) to place again.
    resident: bool = False
    # Forwarded by the placer as a new mind's fresh start on a slot its table says holds no
    # mind: the slot makes way itself first (whatever it holds goes as an eviction would
    # take it: a mind to her page, an unnamed sequence dropped), in this same message.
    fresh: bool = False
    # The rest of a request that gave its slot up (policy/yielding.py): placed only once
    # no placement older than it, of another mind, still waits for a slot.
    yielded: bool = False
    # The engine time its earlier parts had (their `Timings.engine_ms`): a continuation goes
    # on with its request's one `request_engine_s` account, not a fresh one.
    engine_s: float = 0.0


class CancelRequest(Msg):
    rid: int


class Ended(Msg):
    """From the Scheduler: request `rid` is over and nothing of it is in flight. The
    sequence's KV holds exactly `kv_tokens`, unless `cut_back`: a failed step may have left
    cells past them, which the slot removes (or, where the memory refuses, erases)."""

    rid: int
    kv_tokens: list[int]
    reason: str
    cut_back: bool = False
    draft_n: int = 0  # how much of kv_tokens the draft context's sequence holds (speculation)


class CheckpointTaken(Msg):
    """From the Scheduler: the engine snapshotted request `rid`'s sequence at `pos`."""

    rid: int
    pos: int
    data: bytearray


class Erase(Msg):
    # The caller's scope, where a front's client asks (service/tenancy.py): another scope's
    # cells are not hers to erase, and the slot answers as an empty one would.
    scope: str | None = None


class Info(Msg):
    # As Erase's: another scope's sequence is reported as no sequence (its size, checkpoints
    # and genes are facts of another tenant's prompt).
    scope: str | None = None


class PageOutSlot(Msg):
    page: str
    # The caller's scope, where a front's client asks (service/tenancy.py): cells of another
    # scope are not hers to copy, and the slot answers as an empty one (SlotEmpty).
    scope: str | None = None


class PageInSlot(Msg):
    """Take page `page` into the (empty) slot.

    The placer's page-in (`evict_first`) first pages out whatever the slot holds to its
    mind's page (a sequence without a mind is dropped); when the page RAM refuses, nothing
    moves and the slot answers `PageRamExceeded` (its data names the mind), so the placer
    spills by its own order and asks again. `room` is a KV room token the asker holds for
    this move: the slot hands it back with its cell count (`Cells.release`), one tell for
    both, whatever the outcome. `room_cells` (>= 0) is how many cells that room holds: a
    page of more tokens (replaced since the asker sized it) is refused with `ContextFull`
    before anything moves."""

    page: str
    evict_first: bool = False
    room: int = 0
    room_cells: int = -1


class SaveSlot(Msg):
    file: str
    # Write-behind and a graceful stop (service/persist.py): save only while the slot holds
    # this mind, and only if its sequence changed since it was last written to or read from
    # her file (else the answer says "skipped" and nothing is written).
    mind: str | None = None
    scope: str | None = None  # as PageOutSlot's
    # A client's file by name (`slot.save`): the disk budget never evicts it
    # (storage/disk_index.py); the daemon's own saves of minds are evictable.
    kept: bool = False


class RestoreSlot(Msg):
    """Restore file `file` into the slot. `room_cells` (>= 0) is how many KV cells the asker
    holds for it, sized by the file's header when it looked: a file written again since with
    more tokens is refused with `ContextFull` before anything moves (-1: unchecked)."""

    file: str
    room_cells: int = -1


class DropCheckpoint(Msg):
    """From the CheckpointBudget: this checkpoint was evicted to fit the budget; drop it."""

    pos: int


class GenesGranted(Msg):
    """From the GeneResidency: the genes of acquisition `ticket` are on device and in use."""

    ticket: int
    paged_in: list[int] = []
    # The granted genes' content digests by id: the slot keeps them with its cells, so a page
    # or file of its state names them by content even after a gene is unloaded.
    digests: dict[int, str] = {}


class GenesRefused(Msg):
    ticket: int
    error_type: str
    message: str


class Evict(Msg):
    """Give up the sequence if idle: to the mind's page, else its file, else dropped.

    Told by the GeneResidency (device room; the slot tells back `EvictDone`), asked by the
    Scheduler (KV cells; the reply is `(cells freed, the seq of its last Cells tell)`). A
    busy slot refuses.
    """

    reason: str  # "device" | "kv"


class Fork(Msg):
    """Asked by the system (n > 1 choices: actord/chat/choices.py): when idle, hold a copy of
    slot `src`'s sequence, which must be idle and hold exactly `tokens` (else nothing
    changes and the reply is False). A mind this slot held goes to its page first (as an
    eviction). The reply: whether the copy was made."""

    src: int
    tokens: list[int]


class FromBase(Msg):
    """From the placer, for a new mind about to start in this (erased) slot: take the
    longest base in page RAM (the state of a prefix minds share, serving/page_bases.py)
    that begins `req`'s prompt, else the longest base file of her identity (storage/bases.py),
    unless another slot's sequence holds more of it (the request
    then shares those cells when it starts). `room` is a KV room token held for it, handed
    back with the slot's cell count, as for a page-in. Answers the tokens taken (0: none)."""

    req: CompletionRequest
    room: int = 0


SlotInbox = (
    Complete | CancelRequest | Ended | CheckpointTaken | Erase | Info | PageOutSlot | PageInSlot
    | SaveSlot | RestoreSlot | DropCheckpoint | GenesGranted | GenesRefused | Evict | Fork | FromBase
)


# ---- Scheduler inbox -------------------------------------------------------------------


class Enroll(Msg):
    """From a slot: run request `rid` on its sequence. The sequence's KV holds
    `prompt[:pos0]`; the envelope carries the client's reply channel and stream sink: the
    scheduler answers the client itself and tells the slot `Ended`."""

    rid: int
    slot: int
    seq: int
    prompt: list[int]
    pos0: int
    n_predict: int
    genes: tuple[tuple[int, float], ...] = ()
    checkpoint_at: list[int] = []  # absolute positions after which to snapshot
    stop: list[str] = []
    stop_tokens: list[int] = []
    ignore_eos: bool = False
    stream: bool = False
    resumed_from_checkpoint: bool = False
    t_start: float = 0.0
    spec: int = 0  # draft up to this many tokens per step (0: no speculation)
    draft_pos0: int = 0  # the draft context's sequence holds prompt[:draft_pos0]
    logprobs: bool = False  # the engine returns logprobs: collect them for the answer and the stream
    epoch: int = 0  # the sequence's epoch (serving/prefix_share.py): a cut below pos0 moved it on
    progress: bool = False  # stream a chunk per decoded piece of the prompt (return_progress)
    timings: bool = False  # every streamed chunk carries the timings so far (timings_per_token)
    thought_budget: ThoughtBudget | None = None  # the request's reasoning budget (serving/steps/thought.py)
    # The sequence's scope (vocabulary/kv_identity.py), and whether it may take a running twin's
    # prompt cells (a full attention cache, nothing of its own held, no draft context).
    scope: str = ""
    twin: bool = False
    # The prompt's last logits (engine/jobs.py StepEntry.memo): 0, none; MEMO_KEEP, the engine
    # keeps them for the sequence; MEMO_REUSE, the KV also holds prompt[pos0], the prompt's
    # last cell, kept so that the first token is sampled from the logits kept with it.
    memo: int = 0
    # It may end a part early, giving its slot up to a waiting mind, and go on as a
    # continuation (policy/yielding.py): a mind's request whose sampling loses nothing.
    yieldable: bool = False
    continued: bool = False  # the rest of a request that gave its slot up: its prompt was counted
    engine_s: float = 0.0  # Complete.engine_s: the engine time its request had before this part


class Waiting(Msg):
    """From the placer: how many placements wait for a slot now. While any do, a yieldable
    generation past `yield_after_tokens` gives its slot up (policy/yielding.py)."""

    n: int


class Abort(Msg):
    """End request `rid` at the next step (idempotent)."""

    rid: int


class RunStep(Msg):
    pass


class Cells(Msg):
    """A slot's sequence now holds `n` KV cells (told after changes outside a step). `seq`
    counts the slot's tells: the scheduler ignores one older than what it already knows (an
    eviction's answer carries the count it left, and a tell queued before it is stale)."""

    slot: int
    n: int
    seq: int = 0
    release: int = 0  # a room token the count now stands for (a page-in's): released with it
    # The sequence's epoch, and, after a share by cells, the sequence whose first
    # `shared` cells these are and its epoch then (serving/prefix_share.py).
    epoch: int = 0
    shared_from: int = -1
    shared_epoch: int = 0
    shared: int = 0


class MakeRoom(Msg):
    """From above (placer, clients): slot `slot` is about to take `cells` cells (a page-in,
    a restore): evict idle slots until they are free (`evict`; without it, only what is
    free now: a fork, actord/chat/choices.py, never costs another slot its sequence), and hold
    them for it. The reply is a `Room`: the cells held and the token that `ReleaseRoom`
    gives back once the move is over (however it ended)."""

    slot: int
    cells: int
    evict: bool = True


class ReleaseRoom(Msg):
    token: int


class Room(Msg):
    token: int
    cells: int


class SlotLost(Msg):
    """Slot `slot`'s actor crashed: its request ends, and once nothing of it is in flight
    its sequence is cleared and its cells are free again (nobody owns them any more)."""

    slot: int


SchedulerInbox = Enroll | Abort | RunStep | Cells | MakeRoom | ReleaseRoom | SlotLost | Waiting
