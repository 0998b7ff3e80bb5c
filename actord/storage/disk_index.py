"""The page folder's index: every page file's bytes and its last use, in memory.

Why: a daemon of 10,000 minds must start serving within seconds without reading the bodies
of 10,000 page files, answer "which minds live on disk" without listing the folder at every
call, and keep a disk budget (`--page-disk-bytes`) that evicts the least recently used file
first. One scan at start (names and sizes: one `scandir` per folder, on a worker
thread, after the publications a crash cut short are rolled forward) fills it; from then on
the daemon's own publications, reads and removals keep it, on the event loop, so it is never
read and written from two threads.

A generation's sidecars are counted with their main file: the index holds one entry per
page file name, its bytes the sum of the files of its generation. Files written into the
folder by something else while the daemon runs are not in it until the next start (a
restore of one still works: restores look the file up, not the index).

Last use is an order, not a clock: an OrderedDict, least recently used first, so touching
an entry and finding the oldest are O(1) (SGLang's and vLLM's LRU free lists are the same
structure). At start the order is the files' modification times.
"""

from __future__ import annotations

import stat
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterator

from actord.storage.osfs import OsFs
from actord.storage.pagefile import SUFFIXES
from actord.storage.paths import LOCK_NAME, MAX_DEPTH, RESERVED_PREFIX
from actord.vocabulary.names import MIND_FILE_SUFFIX

_SIDECARS = tuple(s for s in SUFFIXES if s)


def scan(root: Path, fs: OsFs) -> list[tuple[str, int, int]]:
    """(name relative to root, bytes of its generation, mtime ns of its main file) for every
    page file under `root`, oldest first. Worker-thread work: a scandir per folder (a stat
    per entry); no file is opened."""
    mains: dict[str, list[int]] = {}
    sidecars: dict[str, int] = {}

    def walk(folder: Path, prefix: str, depth: int) -> None:
        for n, mode, size, mtime in fs.scan(folder):
            if n.startswith(RESERVED_PREFIX) or n == LOCK_NAME:
                continue
            rel = prefix + n
            if stat.S_ISDIR(mode):
                if depth + 1 < MAX_DEPTH:
                    walk(folder / n, rel + "/", depth + 1)
            elif stat.S_ISREG(mode):
                if n.endswith(_SIDECARS):
                    sidecars[rel] = size
                else:
                    mains[rel] = [size, mtime]

    if fs.stat(root) is not None:
        walk(root, "", 0)
    for rel, size in sidecars.items():
        for s in _SIDECARS:
            if rel.endswith(s) and rel[: -len(s)] in mains:
                mains[rel[: -len(s)]][0] += size
                break
        else:  # a sidecar without its main file ("x.ckpt" may itself be a page file's name)
            mains.setdefault(rel, [size, 0])
    return sorted(((n, b, t) for n, (b, t) in mains.items()), key=lambda e: (e[2], e[0]))


class DiskIndex:
    """Page file name -> bytes, least recently used first; plus the bytes reserved by
    publications under way (so two of them cannot both fit the budget's last room)."""

    def __init__(self, budget: int = 0) -> None:
        self.budget = budget  # 0: none
        self.files: OrderedDict[str, int] = OrderedDict()
        self.used = 0
        self.reserved = 0
        self.loaded = False
        # Files a client wrote by name (`slot.save`, `page.spill`: their meta says `kept`),
        # which the budget never evicts; and the files found at start whose header the sweep
        # (files.py `sweep`) has not read yet, so which of the two they are is not known.
        self.kept: set[str] = set()
        self.unswept: set[str] = set()

    def load(self, entries: list[tuple[str, int, int]]) -> None:
        for name, n, _ in entries:
            self.set(name, n)
        self.unswept = {name for name, _, _ in entries}
        self.loaded = True

    def set(self, name: str, n_bytes: int, *, kept: bool = False) -> None:
        """`name` was just published (its bytes now `n_bytes`; by a client by name: `kept`):
        the most recently used."""
        self.used += n_bytes - self.files.pop(name, 0)
        self.files[name] = n_bytes
        self.unswept.discard(name)
        (self.kept.add if kept else self.kept.discard)(name)

    def learned(self, name: str, kept: bool) -> None:
        """The sweep read `name`'s header (found at start): whether a client kept it by name.
        A file published since is as its publication said."""
        if name in self.unswept:
            self.unswept.discard(name)
            if kept:
                self.kept.add(name)

    def touch(self, name: str) -> None:
        if name in self.files:
            self.files.move_to_end(name)

    def remove(self, name: str) -> None:
        self.used -= self.files.pop(name, 0)
        self.kept.discard(name)
        self.unswept.discard(name)

    def over(self, name: str, n_bytes: int) -> int:
        """Bytes to free before `n_bytes` replace `name`'s generation within the budget."""
        if not self.budget:
            return 0
        return max(0, self.used + self.reserved - self.files.get(name, 0) + n_bytes - self.budget)

    def victims(self, need: int, spare: Callable[[str], bool]) -> Iterator[str]:
        """Mind files (`<mind>.page`), least recently used first, that `spare` does not
        keep, until their bytes reach `need`. Only minds' files the daemon wrote: a mind
        whose file goes is re-prefilled at worst; a file a client saved by name (`kept`,
        "ada.page" too) is its to remove, and is counted, never evicted, and one found at
        start is not evicted before the sweep has read which it is."""
        got = 0
        for name, n in list(self.files.items()):
            if got >= need:
                return
            if name.endswith(MIND_FILE_SUFFIX) and "/" not in name and name not in self.kept \
                    and name not in self.unswept and not spare(name):
                got += n
                yield name

    def minds(self, after: str = "", limit: int = 0) -> list[tuple[str, int]]:
        """(mind, bytes) of the minds with a page file, by name, after `after`; at most
        `limit` (0: all). A sort of the names: O(files log files), no disk access."""
        names = sorted(n[: -len(MIND_FILE_SUFFIX)] for n in self.files
                       if n.endswith(MIND_FILE_SUFFIX) and "/" not in n)
        from bisect import bisect_right

        names = names[bisect_right(names, after):] if after else names
        if limit:
            names = names[:limit]
        return [(m, self.files[m + MIND_FILE_SUFFIX]) for m in names]
