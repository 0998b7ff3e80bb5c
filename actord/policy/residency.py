"""Residency policy for genes and slot state under one device budget. Pure: no I/O, no clock.

Temperature is LRU-2 (O'Neil et al.): a gene's heat is the time of its second-last use by
any mind, so a gene used once recently is colder than one used twice, and there is no decay
constant to tune. Time is a logical counter passed in by the caller.

Order of sacrifice when room is needed: cold, unpinned, idle genes first (a gene pages back
in milliseconds), then idle slots, coldest first (a slot costs a mind her state). A pinned
gene (in some mind's current gene set), a gene a processing slot applies and a processing
slot are never chosen.
"""

from __future__ import annotations

from typing import Iterable

import msgspec


class GeneView(msgspec.Struct, frozen=True):
    id: int
    n_bytes: int
    resident: bool
    uses: tuple[int, ...] = ()  # logical times of the last two uses, oldest first


class SlotView(msgspec.Struct, frozen=True):
    id: int
    n_bytes: int  # device bytes of the slot's state (0 when empty)
    processing: bool
    last_use: int


class RoomPlan(msgspec.Struct, frozen=True):
    genes: list[int]  # to page out, in order
    slots: list[int]  # to page out, in order
    fits: bool


def heat(uses: Iterable[int]) -> tuple[int, int]:
    """LRU-2 key: (second-last use, last use); never used = coldest."""
    u = list(uses)[-2:]
    if not u:
        return (-1, -1)
    if len(u) == 1:
        return (-1, u[0])
    return (u[0], u[1])


def record_use(uses: tuple[int, ...], now: int) -> tuple[int, ...]:
    return (*uses, now)[-2:]


def device_used(genes: Iterable[GeneView], slots: Iterable[SlotView]) -> int:
    return sum(g.n_bytes for g in genes if g.resident) + sum(s.n_bytes for s in slots)


def plan_room(
    need: int, budget: int, genes: list[GeneView], slots: list[SlotView],
    protected_genes: set[int], pinned: set[int],
) -> RoomPlan:
    """What to page out so that `need` more bytes fit under `budget` (0 = unlimited).

    Unpinned cold genes go first; a pinned gene and a protected (in use) gene always stay.
    Then idle slots, coldest first.
    """
    if budget <= 0:
        return RoomPlan(genes=[], slots=[], fits=True)
    free = budget - device_used(genes, slots)
    out_genes: list[int] = []
    out_slots: list[int] = []
    candidates = sorted(
        (g for g in genes if g.resident and g.id not in protected_genes and g.id not in pinned),
        key=lambda g: (heat(g.uses), g.id),
    )
    for g in candidates:
        if free >= need:
            break
        out_genes.append(g.id)
        free += g.n_bytes
    for s in sorted((s for s in slots if not s.processing and s.n_bytes > 0), key=lambda s: (s.last_use, s.id)):
        if free >= need:
            break
        out_slots.append(s.id)
        free += s.n_bytes
    return RoomPlan(genes=out_genes, slots=out_slots, fits=free >= need)
