"""Every message actors exchange: one tagged union per mailbox.

Actors are nouns, messages are verbs (`Complete`, `PageOut`) or facts (`StepResult`).
Messages are pure data; reply channels and stream sinks travel in the envelope.
"""

from __future__ import annotations

import msgspec

from actord.api import CompletionRequest


class Msg(msgspec.Struct, tag=True, frozen=True):
    pass


# ---- Slot inbox ------------------------------------------------------------------------


class Complete(Msg):
    rid: int
    req: CompletionRequest


class CancelRequest(Msg):
    rid: int


class StepResult(Msg):
    """What the engine did for this slot in one step; the reply is a `SlotNext`."""

    step: int
    fed: list[int]
    token: int = -1
    piece: bytes = b""
    eog: bool = False
    checkpoint: bytearray | None = None
    checkpoint_pos: int = 0


class StepFailed(Msg):
    error_type: str
    message: str


class Erase(Msg):
    pass


class Info(Msg):
    pass


class PageOutSlot(Msg):
    page: str


class PageInSlot(Msg):
    page: str
    evict_first: bool = False  # the placer's page-in: whatever landed in the slot meanwhile makes way


class SaveSlot(Msg):
    file: str


class RestoreSlot(Msg):
    file: str


class DropCheckpoint(Msg):
    """From the CheckpointBudget: this checkpoint was evicted to fit the budget; drop it."""

    pos: int


class GenesGranted(Msg):
    """From the GeneResidency: the genes of acquisition `ticket` are on device and in use."""

    ticket: int
    paged_in: list[int] = []


class GenesRefused(Msg):
    ticket: int
    error_type: str
    message: str


class Evict(Msg):
    """Give up the sequence if idle: to the mind's page, else its file, else dropped.

    Told by the GeneResidency (device room; the slot tells back `EvictDone`), asked by the
    Scheduler (KV cells; the reply is the number of cells freed). A busy slot refuses.
    """

    reason: str  # "device" | "kv"


class NoRoom(Msg):
    """From the Scheduler: no KV cell can be had for this slot's next step."""


SlotInbox = (
    Complete | CancelRequest | StepResult | StepFailed | Erase | Info | PageOutSlot | PageInSlot
    | SaveSlot | RestoreSlot | DropCheckpoint | GenesGranted | GenesRefused | Evict | NoRoom
)


class SlotNext(msgspec.Struct, frozen=True):
    action: str  # "feed" (decode `token` next), "continue" (prompt goes on), "done"
    token: int = -1
    checkpoint_at: list[int] = []


# ---- Scheduler inbox -------------------------------------------------------------------


class Enroll(Msg):
    slot: int
    seq: int
    tokens: list[int]
    pos0: int
    genes: tuple[tuple[int, float], ...] = ()
    checkpoint_at: list[int] = []  # absolute positions after which to snapshot


class RunStep(Msg):
    pass


class Cells(Msg):
    """A slot's sequence now holds `n` KV cells (told after changes outside a step)."""

    slot: int
    n: int


class MakeRoom(Msg):
    """From above (placer, clients): slot `slot` is about to take `cells` cells (a page-in,
    a restore): evict idle slots until they are free, and hold them for it."""

    slot: int
    cells: int


SchedulerInbox = Enroll | RunStep | Cells | MakeRoom
