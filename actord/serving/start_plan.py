"""Where a request's sequence starts: the one plan, pure, over what the places that hold
prefixes said.

Why one module: "may this request reuse those cells, and from where?" used to be answered
in several places by several owners. The answer is made of two decisions taken by the two
actors that hold their facts, each a pure function here:

- `plan_mind_step`, the placer's (serving/placer.py): a mind not in a slot comes back from
  her page in RAM, her page file, a base (in page RAM or a base file) her prompt begins
  with, or fresh; and whether the slot's own mind must make way first. Its facts
  (`MindFound`) are what the index said (the page store's pages and bases, the page
  files' base files), one look for her own file, and what moves that failed taught
  since: the placer calls it again after each step until it starts.
- `plan_start`, the slot's (serving/prefix_share.py): beyond what its own cells hold, a
  request starts from a peer's cells or a peer's checkpoint, from the sequence index.

Every fact is under the request's KV identity (vocabulary/kv_identity.py): the index
(serving/kv_index.py) answers only for the request's lineage, so a plan never crosses genes
or tenants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from actord.policy.checkpoint_records import SlotCheckpoint
from actord.serving.kv_index import MIN_SHARE, Held, KvIndex
from actord.vocabulary.kv_identity import Lineage


class MindFound(msgspec.Struct, frozen=True):
    """What the placer knows of a mind it brings into a slot, and of that slot.

    `page`: her page's tokens in page RAM (None: no page, or one the cache has no room for
    this turn: it stays whole for a later one); `file`: her page file is there and was not
    refused before; `base`: the tokens of the longest base (page RAM first, else a base
    file) that begins her prompt, under her lineage; `slot_mind`: the slot may hold a mind
    (False only where the placer's table says it holds none); `made_way`: the slot's mind
    went to her page and the slot is empty."""

    page: int | None = None
    file: bool = False
    base: int = 0
    slot_mind: bool = True
    made_way: bool = False


class MindStep(msgspec.Struct, frozen=True):
    """The placer's next move: "page_in" her page (`n` tokens; the slot's mind is paged out
    in the same message); "make_way" (the slot's mind to her page, then plan again);
    "restore" her page file; "base" (start from the `n`-token base); "fresh" (prefill; with
    `slot_clears` the slot makes way itself as it takes the request, else it is erased
    first unless it made way)."""

    how: Literal["page_in", "make_way", "restore", "base", "fresh"]
    n: int = 0
    slot_clears: bool = False


def plan_mind_step(found: MindFound) -> MindStep:
    """The next step of bringing a mind in, from what is known now. A mind's own state comes
    first (her page, then her file: her whole history, not only a prefix); a base saves
    its prefix's prefill; an empty slot with nothing to bring takes the request as it is,
    with no move before (one delivery fewer)."""
    if found.page is not None:
        return MindStep(how="page_in", n=found.page)
    if not found.made_way:
        if not found.slot_mind and not found.file and found.base < MIN_SHARE:
            return MindStep(how="fresh", slot_clears=True)
        return MindStep(how="make_way")
    if found.file:
        return MindStep(how="restore")
    if found.base >= MIN_SHARE:
        return MindStep(how="base", n=found.base)
    return MindStep(how="fresh")


class Start(msgspec.Struct, frozen=True):
    """Where a request's sequence starts, beyond what its own slot holds: from its own cells
    ("own", `n` = what it holds), a peer's first `n` cells ("cells"), or a peer's cells below
    `checkpoint` with the checkpoint's state set over them ("checkpoint")."""

    how: str
    n: int
    src: Held | None = None
    checkpoint: SlotCheckpoint | None = None


def plan_start(index: KvIndex, slot: int, prompt: Sequence[int], lineage: Lineage, own: int, *,
               cells: bool, checkpoints: bool) -> Start:
    """The one decision of where slot `slot`'s request starts, from what it holds itself
    (`own` tokens of `prompt`, under `lineage`) and what the index says the others hold:
    a peer's cells where the memory can share them (`cells`), else a peer's checkpoint where
    it keeps them (`checkpoints`), each only where it saves MIN_SHARE tokens over `own`."""
    if own >= len(prompt) - MIN_SHARE:
        return Start(how="own", n=own)
    if cells:
        src, n = index.best_source(slot, prompt, lineage, own)
        if src is not None:
            return Start(how="cells", n=n, src=src)
    if checkpoints:
        src, ck = index.best_checkpoint(slot, prompt, lineage, own)
        if src is not None and ck is not None:
            return Start(how="checkpoint", n=ck.pos, src=src, checkpoint=ck)
    return Start(how="own", n=own)
