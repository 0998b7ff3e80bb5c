"""What the router's parts share (`RouterShared`): the directory, the node links and the
minds' locks, made once by the router (router.py) and given to each part (node loss,
migrations, turns) as one record, instead of each part taking the three apart."""

from __future__ import annotations

from dataclasses import dataclass

from actord.cluster.directory import Directory
from actord.cluster.locks import MindLocks
from actord.cluster.nodelink import NodeLink


@dataclass(frozen=True)
class RouterShared:
    dir: Directory
    nodes: NodeLink
    locks: MindLocks
