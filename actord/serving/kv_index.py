"""Where KV states live, as each place last said: the slots' sequences (and their
checkpoints) and the page store's pages and bases. One owner of the index that slots, the
placer and the façade ask instead of reading each other's fields (or asking the page store
for what it published already).

Why: a request that starts on one slot may take cells another slot's sequence holds (a
share of the prefix, a checkpoint at the shared point, a page-in onto a base a peer holds,
a fork), and the placement of an unnamed request asks which idle slot holds most of its
prompt. Each of those used to read the other slot's fields; now each slot publishes a
frozen record (`Held`) whenever what it holds, its lineage, its checkpoints or whether its
cells hold steady changes, and every question is a pure query over those records. A record
is only ever written by its own slot (`publish`), so a slot's state has one owner, and a
reader sees what the slot said at its last change, never a half-made update: the slots and
this index share one event loop, and a slot publishes before each await that could let a
reader in.

The page store publishes each page's size by name (`publish_page`) and each base's tokens
in its scope (`publish_base`) at every change of its names and bases, so a placement learns
where a mind is, and whether a base begins her prompt, without a delivery; the page store
answers the moves themselves (a page-in of a page gone since is refused, typed, and the
placer plans again). The base files (storage/bases.py `BaseIndex`: their tokens and
identity, read from their headers) are the page files' records, kept by the page files as
they publish, remove and sweep them, and asked here beside the bases in page RAM
(`base_file_for`), so a new mind's start is planned from this one index. A mind's own page
file is looked up on disk, not here: a cluster's rehome copies one into the folder of a
running daemon.

"Steady" is the promise a share rests on: the cells of `tokens` do not change until the
slot publishes again (it is quiet, or running an enrolled request, which only adds cells
past them; a cut-back publishes a new epoch first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from actord.policy.checkpoint_records import SlotCheckpoint
from actord.policy.prefix_index import common_prefix
from actord.storage.bases import BaseIndex
from actord.vocabulary.kv_identity import Lineage

MIN_SHARE = 32  # tokens: below this a prefill costs less than a share's bookkeeping


class Held(msgspec.Struct, frozen=True):
    """One slot's sequence as the slot last published it. `tokens` is the slot's own list,
    which it replaces and never mutates, so the record is a snapshot without a copy."""

    slot: int
    seq: int
    tokens: list[int]
    lineage: Lineage
    epoch: int  # moves on at every change of `tokens` that is not an extension
    quiet: bool  # no request and no handler at work: every engine job of the sequence returned
    steady: bool  # quiet, or running an enrolled request (its cells below `tokens` stay)
    running: list[int] | None = None  # the enrolled request's prompt: the sequence holds it, or will
    checkpoints: tuple[SlotCheckpoint, ...] = ()


class KvIndex:
    """The slots' published sequences, by slot id, the page store's pages and bases, and the
    questions asked of them."""

    def __init__(self, n_slots: int, base_files: BaseIndex | None = None) -> None:
        self._held: list[Held | None] = [None] * n_slots
        self._pages: dict[str, int] = {}  # page name -> its tokens (the page store's)
        self._bases: dict[int, tuple[list[int], str]] = {}  # base generation -> (its tokens, its scope)
        self._base_files = base_files  # the page files' (None: no start from a base file)

    # -- the page store's records: written by it alone ----------------------------------

    def publish_page(self, name: str, n_tokens: int | None) -> None:
        """Page `name` holds `n_tokens` tokens now (None: there is no page of that name)."""
        if n_tokens is None:
            self._pages.pop(name, None)
        else:
            self._pages[name] = n_tokens

    def publish_base(self, gen: int, tokens: list[int] | None, scope: str = "") -> None:
        """Base generation `gen` holds `tokens` in `scope` (None: it is gone). `tokens` is the
        base's own list, which is never mutated."""
        if tokens is None:
            self._bases.pop(gen, None)
        else:
            self._bases[gen] = (tokens, scope)

    def page_tokens(self, name: str) -> int | None:
        return self._pages.get(name)

    def base_for(self, prompt: Sequence[int], scope: str) -> int:
        """The longest base of `scope` whose whole tokens `prompt` (all but its last token)
        begins with, whatever its genes (a hint: the slot finds the base under the request's
        whole lineage). O(bases), and bases are few (one per prefix minds share)."""
        best = 0
        for tokens, base_scope in self._bases.values():
            n = len(tokens)
            if base_scope == scope and best < n < len(prompt) and list(prompt[:n]) == tokens:
                best = n
        return best

    def base_file_for(self, prompt: list[int], scope: str, fp: dict[str, Any] | None = None,
                      genes: list[list[Any]] | None = None) -> tuple[str, int] | None:
        """(key, its tokens) of the longest base file of `scope` whose tokens `prompt` (all
        but its last token) begins with, under the model fingerprint `fp` and the gene
        digests `genes` (None: any, a hint where the asker does not know them yet)."""
        if self._base_files is None:
            return None
        return self._base_files.longest(prompt, fp, genes, scope)

    # -- the slots' records: each written by its own slot --------------------------------

    def publish(self, held: Held) -> None:
        self._held[held.slot] = held

    def of(self, slot: int) -> Held | None:
        return self._held[slot] if 0 <= slot < len(self._held) else None

    def _peers(self, slot: int) -> list[Held]:
        return [h for h in self._held if h is not None and h.slot != slot]

    def best_source(self, slot: int, prompt: Sequence[int], lineage: Lineage, own: int) -> tuple[Held | None, int]:
        """The steady peer holding the longest prefix of `prompt` (at most all but its last
        token) under `lineage`, if it beats `own` by MIN_SHARE; else (None, 0)."""
        if len(prompt) <= MIN_SHARE:
            return None, 0
        limit = len(prompt) - 1
        best, best_n = None, own + MIN_SHARE - 1
        for h in self._peers(slot):
            if h.lineage != lineage or len(h.tokens) <= best_n or not h.steady:
                continue
            n = min(common_prefix(h.tokens, prompt), limit)
            if n > best_n:
                best, best_n = h, n
        return (best, best_n) if best is not None else (None, 0)

    def shared_point(self, slot: int, prompt: Sequence[int], lineage: Lineage) -> int:
        """Where `prompt` parts from what the other slots hold under `lineage` (the longest
        prefix it shares with one): where minds that open alike diverge. 0 below MIN_SHARE."""
        n = max((common_prefix(h.tokens, prompt) for h in self._peers(slot) if h.lineage == lineage), default=0)
        return min(n, len(prompt) - 1) if n >= MIN_SHARE else 0

    def best_checkpoint(self, slot: int, prompt: Sequence[int], lineage: Lineage,
                        own: int) -> tuple[Held | None, SlotCheckpoint | None]:
        """The steady peer's checkpoint (at or below where the prompt parts from that peer's
        sequence) that starts `prompt` furthest, if it beats `own` by MIN_SHARE."""
        if len(prompt) <= MIN_SHARE:
            return None, None
        best, best_ck, best_n = None, None, own + MIN_SHARE - 1
        for h in self._peers(slot):
            if h.lineage != lineage or not h.checkpoints or not h.steady:
                continue
            lcp = min(common_prefix(h.tokens, prompt), len(prompt) - 1)
            for ck in reversed(h.checkpoints):
                if best_n < ck.pos <= lcp:
                    best, best_ck, best_n = h, ck, ck.pos
                    break
        return best, best_ck

    def peer_shared(self, slot: int, tokens: Sequence[int], lineage: Lineage) -> int:
        """Tokens a peer's sequence shares with `tokens`, or the prompt of the request it runs
        (its sequence holds it, or will: a twin that started together with this one holds
        nothing yet by its token list)."""
        def held(h: Held) -> Sequence[int]:
            return h.running if h.running is not None and len(h.running) > len(h.tokens) else h.tokens

        return max((common_prefix(held(h), tokens) for h in self._peers(slot) if h.lineage == lineage), default=0)

    def holding(self, slot: int, tokens: Sequence[int], n: int, lineage: Lineage) -> Held | None:
        """A steady peer whose sequence begins with `tokens[:n]` under `lineage`."""
        for h in self._peers(slot):
            if h.lineage == lineage and h.steady and len(h.tokens) >= n and h.tokens[:n] == list(tokens[:n]):
                return h
        return None

    def quiet_with(self, src: int, tokens: Sequence[int]) -> Held | None:
        """Slot `src`'s record if it is quiet and holds exactly `tokens` (a fork's source)."""
        h = self.of(src)
        return h if h is not None and h.quiet and h.tokens == list(tokens) else None

    def prefix_held(self, slot: int, prompt: Sequence[int], lineage: Lineage) -> int:
        """How much of `prompt` slot `slot` holds under `lineage` (placement's measure)."""
        h = self.of(slot)
        return common_prefix(h.tokens, prompt) if h is not None and h.lineage == lineage else 0
