"""A node's fences: the epoch it holds each mind at, and the turns it applied to it.

A turn is (mind, epoch, turn id). This node runs it only if it holds the mind at exactly
that epoch (else `StaleEpoch`: the mind moved, or was never given to this node) and has not
applied that turn id to the mind before (else `DuplicateTurn`, carrying the answer it
recorded, so a retry after a lost reply gets the turn's one answer and nothing runs twice).

Each mind's record is one small JSON file in the node's fence folder, written crash-safely
after the turn is applied and before its answer leaves the node; the record survives the
daemon (a restart reloads it) and, in a shared cluster folder, the node: the node that
takes a lost node's minds over takes their records too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from actord.cluster.durable import read_json, remove, write_json
from actord.vocabulary.errors import DuplicateTurn, StaleEpoch
from actord.storage.osfs import OsFs


class TurnRecord(msgspec.Struct, frozen=True):
    turn: str
    result: Any = None


class MindFence(msgspec.Struct, frozen=True):
    mind: str
    epoch: int
    turns: list[TurnRecord] = []  # the most recent applied turns, oldest first


class FenceBook:
    def __init__(self, folder: str | Path, keep: int = 16, fs: OsFs | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.fs = fs or OsFs()
        self.minds: dict[str, MindFence] = {}
        for name in self.fs.listdir(self.folder):
            if name.endswith(".json") and not name.startswith("."):
                rec = read_json(self.folder / name, MindFence, self.fs)
                if rec is not None:
                    self.minds[rec.mind] = rec

    def _path(self, mind: str) -> Path:
        return self.folder / f"{mind}.json"

    @staticmethod
    def load(folder: str | Path, mind: str) -> MindFence | None:
        """Another node's record of `mind` (a lost node's folder), or None."""
        return read_json(Path(folder) / f"{mind}.json", MindFence)

    def held(self, mind: str) -> int | None:
        rec = self.minds.get(mind)
        return None if rec is None else rec.epoch

    def check(self, mind: str, epoch: int, turn: str) -> None:
        """Refuse a turn this node must not run; nothing changes either way."""
        rec = self.minds.get(mind)
        if rec is None or rec.epoch != epoch:
            held = None if rec is None else rec.epoch
            raise StaleEpoch(f"this node holds {mind!r} at epoch {held}, not {epoch}", mind=mind, epoch=epoch,
                             held=held)
        for t in rec.turns:
            if t.turn == turn:
                raise DuplicateTurn(f"turn {turn} of {mind!r} was applied here already", mind=mind, turn=turn,
                                    result=t.result, epoch=rec.epoch)

    def hold(self, mind: str, epoch: int, turns: list[TurnRecord] | None = None) -> None:
        rec = MindFence(mind=mind, epoch=epoch, turns=list(turns or [])[-self.keep:])
        write_json(self._path(mind), rec, self.fs)
        self.minds[mind] = rec

    def record(self, mind: str, epoch: int, turn: str, result: Any) -> None:
        rec = self.minds[mind]
        assert rec.epoch == epoch
        turns = [*rec.turns, TurnRecord(turn=turn, result=result)][-self.keep:]
        self.hold(mind, epoch, turns)

    def turns(self, mind: str) -> list[TurnRecord]:
        rec = self.minds.get(mind)
        return [] if rec is None else list(rec.turns)

    def drop(self, mind: str) -> None:
        remove(self._path(mind), self.fs)
        self.minds.pop(mind, None)
