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


class SaveSlot(Msg):
    file: str


class RestoreSlot(Msg):
    file: str


class DropCheckpoint(Msg):
    """From the CheckpointBudget: this checkpoint was evicted to fit the budget; drop it."""

    pos: int


SlotInbox = (
    Complete | CancelRequest | StepResult | StepFailed | Erase | Info | PageOutSlot | PageInSlot
    | SaveSlot | RestoreSlot | DropCheckpoint
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


SchedulerInbox = Enroll | RunStep
