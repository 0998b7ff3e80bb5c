"""The checkpoint records, in one place: what a context checkpoint is wherever it lives.

A context checkpoint is a snapshot of a sequence's memory at a position (prompt tokens
covered), taken so a later prompt that diverges after it resumes there instead of from zero.
It has three shapes:

    SlotCheckpoint    its bytes in host RAM: held by a slot, and by a page while the slot's
                      state is paged out (the same record travels; it is frozen)
    StoredCheckpoint  its bytes as a page file holds them (storage/pagefile.py)
    CheckpointSize    its position and size only: what the CheckpointBudget mirrors of a
                      slot's list, and what simulations and tests plan with

Policy reads any of them through `CheckpointLike` (a position and a byte size). Pure data
that serving, storage and policy may all import (nothing here imports them).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

__all__ = ["CheckpointLike", "CheckpointSize", "SlotCheckpoint", "StoredCheckpoint"]


class CheckpointLike(Protocol):
    """Anything with a position (prompt tokens covered) and a byte size."""

    @property
    def pos(self) -> int: ...

    @property
    def n_bytes(self) -> int: ...


class SlotCheckpoint(msgspec.Struct, frozen=True):
    """A checkpoint's bytes in host RAM, in a slot or in its page."""

    pos: int
    data: bytearray

    @property
    def n_bytes(self) -> int:
        return len(self.data)


class StoredCheckpoint(msgspec.Struct, frozen=True):
    """A checkpoint as a page file holds it (a read may hand back a view of the file's bytes)."""

    pos: int
    data: bytes | bytearray | memoryview


class CheckpointSize(msgspec.Struct, frozen=True):
    """A checkpoint without its bytes: what the budget mirrors, and what simulations use."""

    pos: int
    n_bytes: int
