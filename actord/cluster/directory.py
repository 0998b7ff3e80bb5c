"""The router's directory: which node owns each mind, at which epoch.

A mind has exactly one owner: the (node, epoch) this directory names. Nodes may hold other
copies for a while (a migration's destination before the flip, a lost node's files, a
source not yet told to drop), but each is fenced by its epoch: a node serves a mind only at
the epoch it was given, and the router sends a turn only to the directory's (node, epoch).

Every change is persisted (durable.write_json) before the call that made it returns, and
epochs are issued from a per-mind counter that is persisted before any node hears of the
epoch, so no epoch is ever issued twice, even across a router crash.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from actord.cluster.durable import read_json, write_json
from actord.vocabulary.errors import InvalidParams

VERSION = 1


class Entry(msgspec.Struct, frozen=True):
    node: str
    epoch: int


class State(msgspec.Struct):
    version: int = VERSION
    minds: dict[str, Entry] = {}
    issued: dict[str, int] = {}  # mind -> the highest epoch ever issued for it
    nodes: list[str] = []  # nodes registered with the router, in order
    lost: list[str] = []  # nodes declared lost (never given minds again under that name)


class Directory:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        state = read_json(self.path, State)
        if state is not None and state.version != VERSION:
            raise InvalidParams(f"directory {self.path} has version {state.version}, not {VERSION}")
        self.state = state or State()

    def _persist(self) -> None:
        write_json(self.path, self.state)

    # -- reads ---------------------------------------------------------------------------

    def get(self, mind: str) -> Entry | None:
        return self.state.minds.get(mind)

    def minds_on(self, node: str) -> list[str]:
        return sorted(m for m, e in self.state.minds.items() if e.node == node)

    def counts(self) -> dict[str, int]:
        out = {n: 0 for n in self.live_nodes()}
        for e in self.state.minds.values():
            out[e.node] = out.get(e.node, 0) + 1
        return out

    def live_nodes(self) -> list[str]:
        return [n for n in self.state.nodes if n not in self.state.lost]

    # -- changes (each persisted before it returns) --------------------------------------

    def add_node(self, node: str) -> bool:
        if node in self.state.nodes and node not in self.state.lost:
            return False
        if node in self.state.lost:
            self.state.lost.remove(node)
        if node not in self.state.nodes:
            self.state.nodes.append(node)
        self._persist()
        return True

    def mark_lost(self, node: str) -> None:
        if node not in self.state.lost:
            self.state.lost.append(node)
            self._persist()

    def issue(self, mind: str) -> int:
        """A fresh epoch for `mind`, never issued before (persisted first)."""
        epoch = self.state.issued.get(mind, 0) + 1
        self.state.issued[mind] = epoch
        self._persist()
        return epoch

    def assign(self, mind: str, node: str, epoch: int) -> Entry:
        """`mind` is now owned by `node` at `epoch` (a placement, or a migration's flip)."""
        if epoch > self.state.issued.get(mind, 0):
            raise InvalidParams(f"epoch {epoch} of {mind!r} was never issued", mind=mind, epoch=epoch)
        old = self.state.minds.get(mind)
        if old is not None and epoch <= old.epoch:
            raise InvalidParams(f"{mind!r} is at epoch {old.epoch}; {epoch} is not newer", mind=mind, epoch=epoch)
        entry = Entry(node=node, epoch=epoch)
        self.state.minds[mind] = entry
        self._persist()
        return entry

    def forget(self, mind: str) -> None:
        if self.state.minds.pop(mind, None) is not None:
            self._persist()
