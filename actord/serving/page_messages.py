"""The page store's vocabulary: a page generation, what the store answers, its inbox.

Apart from the actor (serving/page_store.py, which re-exports every name here) so that the
store's rules fit one file; the slots, the spill and the façade speak these messages.

A page may stand on a *base*: the state of a prefix that several pages share, stored once
as a generation of its own with no name (the store's `_Gen` of `Page.base.gen`). Such a
page's `state` holds only the positions from `n_base` on; its `tokens` are all of them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.serving.messages import Msg
from actord.policy.checkpoint_placement import Divergence
from actord.policy.checkpoint_records import SlotCheckpoint


class Page(msgspec.Struct, frozen=True):
    """One generation of a page. Its buffers are never mutated after commit."""

    gen: int
    name: str
    n_bytes: int
    state: bytearray
    tokens: list[int]
    checkpoints: list[SlotCheckpoint] = []  # the slot's, as they were
    genes: tuple[tuple[int, float], ...] = ()
    scope: str = ""  # with genes, the lineage of its cells (vocabulary/kv_identity.py)
    gene_digests: tuple[str, ...] = ()  # `genes` by content, in order: what its page file records
    draft: bytearray | None = None  # the draft context's sequence state (speculation), if any
    draft_n: int = 0  # how many of `tokens` that state holds
    # The mind's divergence history and where its last prompt ended (checkpoint placement).
    divergences: list[Divergence] = []
    prompt_end: int = 0
    # The shared prefix this page stands on (the base's own generation: a page-in or spill
    # has its bytes), and how many leading tokens it holds; `state` is the rest.
    base: "Page | None" = None
    n_base: int = 0


class PageInfo(msgspec.Struct, frozen=True):
    page: str
    gen: int
    n_bytes: int
    n_tokens: int
    n_checkpoints: int
    holders: int
    n_base: int = 0  # tokens of a shared prefix the page stands on (its base, stored once)
    base_pages: int = 0  # pages standing on that base (this one included)
    base: int = -1  # that base's generation (-1: none), so a caller can group pages by base
    base_bytes: int = 0  # the bytes it holds, once for all its pages


# ---- inbox ------------------------------------------------------------------------------


class Admit(Msg):
    name: str
    n_bytes: int


class AdmitState(Msg):
    """Admit a page whose sequence state is `n_state` of its `n_bytes`, and hand out the
    buffer the state is to be copied into (a warm one from the pool when one fits). The
    page's charge is `n_bytes` plus the buffer's bytes beyond `n_state` (PageAdmission.n_bytes)."""

    name: str
    n_bytes: int
    n_state: int


class PageAdmission(msgspec.Struct, frozen=True):
    """The store's answer to AdmitState: room reserved for a page's state, and where to copy it."""

    reservation: int
    n_bytes: int  # the charge: what the page's Commit must carry
    into: Any = None  # HostBuffer from the pool, or None: the engine allocates `capacity`
    capacity: int = 0


class Commit(Msg):
    reservation: int
    page: Page


class CancelReservation(Msg):
    reservation: int


class Take(Msg):
    name: str


class Return(Msg):
    """A page_in failed: the page goes back under its name (if no newer one took it)."""

    gen: int


class Release(Msg):
    gen: int


class DropPage(Msg):
    name: str


class ListPages(Msg):
    """The pages by name; `after` a name and at most `limit` of them (0: all), so that a
    store of 10,000 pages answers a page of them at a time."""

    after: str = ""
    limit: int = 0
    # A tenant's listing (vocabulary/kv_identity.py): only the pages of this scope, each under the
    # name its client knows it by, `after` one such name. None: every page, as kept.
    scope: str | None = None


class SpillVictim(Msg):
    """Of `candidates` (page names, oldest first), the one to spill: the oldest that is a
    page and stands on no base other pages share, else the oldest that is a page; None
    when none is. The asker sends a bounded prefix of its own order."""

    candidates: list[str]


class Unpersisted(Msg):
    """(name, generation) of every page whose generation is not in its mind's page file,
    oldest change first (write-behind and a graceful stop write them)."""


class SpillBegin(Msg):
    name: str


class SpillEnd(Msg):
    gen: int
    drop: bool = False
    persisted: bool = False  # the spill was to the page's own mind file: that generation is on disk


class StoreStats(Msg):
    pass


class FindBase(Msg):
    """Before a page-out: the longest base held for (tokens, genes, scope), and how many leading
    tokens (whole blocks) the tokens share with another page, whose prefix would be worth a
    base of its own. A base found is held for the asker: it passes to the page committed on
    it, or goes back by Release(gen=base.gen)."""

    name: str  # the page being made: an older generation of it is not "another page"
    tokens: list[int]
    genes: tuple[tuple[int, float], ...] = ()
    scope: str = ""
    # The page's whole admission, made in this same ask when no base is found and too little
    # is shared to make one (a page-out on nothing shared costs no ask more than before).
    whole: AdmitState | None = None


class BaseFound(msgspec.Struct, frozen=True):
    base: Page | None  # its tokens are the n_base it covers
    shared: int = 0  # block-aligned tokens in common with another page (when no base)
    admission: PageAdmission | None = None  # FindBase.whole, admitted (no base, nothing shared)


class AdmitBase(Msg):
    """Admit a base of `n_state` state bytes (charged `n_bytes`, already copied: no buffer is
    handed out); its Commit carries a Page with no name, answered with the base held for
    the committer (as FindBase holds one)."""

    n_bytes: int
    n_state: int


PageStoreInbox = (
    Admit | AdmitState | Commit | CancelReservation | Take | Return | Release | DropPage | ListPages
    | SpillBegin | SpillEnd | StoreStats | FindBase | AdmitBase | SpillVictim | Unpersisted
)


class PageStoreStats(msgspec.Struct, frozen=True):
    charged: int
    ceiling: int
    pages: int
    generations: int
    reservations: int
    live_bytes: int
    earmarked: int = 0
    pooled: int = 0  # bytes of warm state buffers kept for the next page_out (within the ceiling)
    pool_buffers: int = 0
    pool_hits: int = 0
    pool_misses: int = 0
    bases: int = 0  # shared prefixes stored once (generations with no name)
    base_bytes: int = 0
    shared_bytes: int = 0  # what whole pages would have charged beyond what is charged
    unpersisted: int = 0  # pages whose generation is not yet in their page file
