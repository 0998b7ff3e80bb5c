"""The PageStore: named pages of slot state in host RAM, under one byte ceiling.

Policy only: it admits, charges, hands out and takes back pages; the bytes are copied by
the engine (out of and into the context) and written by storage worker threads (spill).

Charging rule (from the original server, where getting it wrong leaked or double-counted
hundreds of MB): a page's charge is measured at admission, before any copy, and that same
number is what the store charges. The charge lives as long as any owner holds the page:
the store itself, a slot that took it for page_in until the copy is done, an in-flight
spill. So a page a spill still holds after page_in, drop or replacement keeps counting.
Replacing a page under the same name subtracts the old one at admission only if the store
is its sole owner. Every change of the count happens in this actor's handlers, so the
invariant `charged == sum(live generations) + sum(reservations)` is checkable at any
message boundary.

What the ceiling bounds, exactly: `charged - earmarked <= ceiling` at every message
boundary. A replacement admitted against the old generation's bytes holds both generations
between admission and commit; the old one's bytes (up to the new one's size) are
*earmarked*: no new holder may extend its life (a spill of an earmarked generation is
admitted only if its bytes fit on their own), so they are freed at commit, or when a
page-in that took the old generation meanwhile lets go of it. So `charged` may exceed the
ceiling by at most the earmarked bytes, and only while a replacement is under way.

Bases (issue 25): the state of a prefix several pages share is stored once, as a generation
with no name (so ListPages, take, drop and spill never see it; the charging invariant and
the ceiling hold unchanged, it is one more generation). A page on a base holds it: the hold
its maker got from FindBase or the base's Commit passes to the page at the page's commit,
and `_unhold` of the page's generation lets go of the base, so a base lives exactly as long
as a page (or a page-in or spill of one) stands on it, and its bytes are charged once. Two
prefix indexes (policy/prefix_index.py) answer FindBase in one walk over the asked tokens'
blocks: one over the bases, one over the pages' own tokens (a prefix that another page
shares is worth a base: the page-out that asks makes one from its own sequence).

Persistence (issue 34): the store knows which pages' current generation is not yet in the
page's own file (`dirty`, oldest change first): a commit makes a page dirty, a spill to its
own file (SpillEnd.persisted) of the generation still current makes it clean, a take or drop
forgets it. Write-behind and a graceful stop ask `Unpersisted` and write those.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import msgspec

from actord.serving.kernel import Actor, Dispatcher, Envelope
from actord.serving.buffer_pool import BufferPool, buffer_of, capacity_for
from actord.serving.kv_index import KvIndex
from actord.serving.page_messages import (  # noqa: I001
    Admit, AdmitBase, AdmitState, BaseFound, CancelReservation, Commit, DropPage, FindBase, ListPages, Page,
    PageAdmission, PageInfo, PageStoreInbox, PageStoreStats, Release, Return, SpillBegin, SpillEnd,
    SpillVictim, StoreStats, Take, Unpersisted,
)
from actord.vocabulary.errors import InvalidParams, PageNotFound, PageRamExceeded
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics
from actord.vocabulary.kv_identity import client_name
from actord.policy.prefix_index import BLOCK, PrefixIndex, common_prefix

__all__ = [  # the vocabulary lives in serving/page_messages.py; its users import it from here
    "Admit", "AdmitBase", "AdmitState", "BaseFound", "CancelReservation", "Commit", "DropPage", "FindBase",
    "ListPages", "Page", "PageAdmission", "PageInfo", "PageStore", "PageStoreInbox", "PageStoreStats", "Release",
    "Return", "SpillBegin", "SpillEnd", "SpillVictim", "StoreStats", "Take", "Unpersisted",
]

log = get("actord.pages")


@dataclass
class _Gen:
    page: Page | None  # None while only reserved
    n_bytes: int
    holders: int


class PageStore(Actor[PageStoreInbox]):
    rank = 40

    def __init__(self, dispatcher: Dispatcher, ceiling: int, metrics: Metrics, capacity: int = 256,
                 index: KvIndex | None = None) -> None:
        super().__init__(dispatcher, "pagestore", capacity)
        # Where every change of a page's name or of a base is published (serving/kv_index.py):
        # a placement reads it there instead of asking.
        self.index = index if index is not None else KvIndex(0)
        self.ceiling = ceiling
        self.metrics = metrics
        self.names: dict[str, int] = {}
        self.gens: dict[int, _Gen] = {}
        self.reserved: dict[int, tuple[str, int]] = {}
        self._ids = itertools.count(1)
        self.charged = 0
        self.earmarks: dict[int, int] = {}  # generation -> bytes a replacement counted as freed
        self._earmark_of: dict[int, int] = {}  # reservation -> the generation it earmarked
        # Warm state buffers of pages gone (serving/buffer_pool.py), within the ceiling:
        # effective + pool.bytes <= ceiling at every message boundary.
        self.pool = BufferPool()
        self.bases = PrefixIndex()  # base generation -> its tokens
        self.page_index = PrefixIndex()  # page generation -> its tokens
        self.on_base: dict[int, int] = {}  # base generation -> page generations standing on it
        self.dirty: dict[str, int] = {}  # page -> its generation not yet in its file, oldest change first

    async def handle(self, msg: PageStoreInbox, env: Envelope[PageStoreInbox]) -> None:
        reply = env.reply
        match msg:
            case Admit(name=name, n_bytes=n):
                out = self.admit(name, n)
            case AdmitState(name=name, n_bytes=n, n_state=n_state):
                out = self.admit_state(name, n, n_state)
            case Commit(reservation=r, page=page):
                out = self.commit(r, page)
            case CancelReservation(reservation=r):
                out = self.cancel(r)
            case Take(name=name):
                out = self.take(name)
            case Return(gen=gen):
                out = self.give_back(gen)
            case Release(gen=gen):
                out = self.release(gen)
            case DropPage(name=name):
                out = self.drop(name)
            case ListPages(after=after, limit=limit, scope=None):
                out = [self.info(n) for n in self.page_names(after, limit)]
            case ListPages(after=after, limit=limit, scope=str(scope)):
                out = [msgspec.structs.replace(self.info(n), page=c) for c, n in self.scoped_names(scope, after, limit)]
            case SpillVictim(candidates=candidates):
                out = self.spill_victim(candidates)
            case Unpersisted():
                out = list(self.dirty.items())
            case SpillBegin(name=name):
                out = self.spill_begin(name)
            case SpillEnd(gen=gen, drop=drop, persisted=persisted):
                g = self.gens.get(gen)
                if persisted and g is not None and g.page is not None and self.dirty.get(g.page.name) == gen:
                    del self.dirty[g.page.name]
                out = self.spill_end(gen, drop)
            case StoreStats():
                out = self.stats()
            case FindBase(name=name, tokens=tokens, genes=genes, scope=scope, whole=whole):
                out = self.find_base(name, tokens, genes, scope)
                if out.base is None and out.shared < BLOCK and whole is not None:
                    out = BaseFound(base=None, shared=out.shared,
                                    admission=self.admit_state(whole.name, whole.n_bytes, whole.n_state))
            case AdmitBase(n_bytes=n):
                # Copied before its admission (its size is known only then): no pooled buffer.
                out = PageAdmission(reservation=self.admit("", n), n_bytes=n)
            case _:
                raise InvalidParams(f"page store cannot handle {type(msg).__name__}")
        self._publish_metrics()
        if reply is not None:
            reply.send(out)

    # -- the rules ---------------------------------------------------------------------

    def admit(self, name: str, n_bytes: int) -> int:
        """A reservation for page `name`'s generation; name "" is a base (AdmitBase)."""
        if len(name) > 255 or "\0" in name:
            raise InvalidParams("page names are 1-255 characters without NUL", page=name)
        old = self.names.get(name)
        replaced = self._replaced(name, n_bytes)
        if self.effective - replaced + n_bytes > self.ceiling:
            # A refusal, not a failure: page RAM is a cache, and its callers (the placer, an
            # eviction) spill to a file when it is full. Counted apart, logged at info.
            self.metrics.page_refused_total.inc()
            log.info("page.refused", page=name, n_bytes=n_bytes, charged=self.charged, ceiling=self.ceiling)
            raise PageRamExceeded(
                f"page of {n_bytes} bytes would exceed the page RAM ceiling",
                page=name, n_bytes=n_bytes, charged=self.charged, ceiling=self.ceiling,
            )
        r = next(self._ids)
        self.reserved[r] = (name, n_bytes)
        self.charged += n_bytes
        if replaced:
            self.earmarks[old] = replaced  # type: ignore[index]
            self._earmark_of[r] = old  # type: ignore[assignment]
        self.pool.trim(self.ceiling - self.effective)  # the pages' bytes come first
        return r

    def _replaced(self, name: str, n_bytes: int) -> int:
        """The bytes an admission under `name` counts as freed: the old generation's, when the
        store is its sole owner (and no other replacement counted them already)."""
        old = self.names.get(name)
        if old is not None and self.gens[old].holders == 1 and old not in self.earmarks:
            return min(self.gens[old].n_bytes, n_bytes)
        return 0

    def admit_state(self, name: str, n_bytes: int, n_state: int) -> PageAdmission:
        """Admit, and choose the buffer the state goes into: a warm pooled one that fits, else
        a fresh one with headroom. Its bytes beyond the state are charged with the page."""
        buf = self.pool.take(n_state)
        capacity = buf.capacity if buf is not None else capacity_for(n_state)
        charge = n_bytes + capacity - n_state
        if self.effective - self._replaced(name, charge) + charge > self.ceiling:
            # The buffer's slack (pooled, or a fresh one's headroom) would pass the ceiling:
            # the exact size may still fit, in a fresh buffer of just that size.
            buf, capacity, charge = None, n_state, n_bytes
        r = self.admit(name, charge)
        return PageAdmission(reservation=r, n_bytes=charge, into=buf, capacity=capacity)

    @property
    def earmarked(self) -> int:
        return sum(self.earmarks.values())

    @property
    def effective(self) -> int:
        """What the ceiling bounds: the charge less the bytes a replacement will free."""
        return self.charged - self.earmarked

    def commit(self, reservation: int, page: Page) -> PageInfo | Page:
        name, n_bytes = self.reserved.pop(reservation)
        self._earmark_of.pop(reservation, None)
        assert page.n_bytes == n_bytes and page.name == name and page.gen == reservation, \
            "a page must be charged what was admitted"
        self.gens[page.gen] = _Gen(page=page, n_bytes=n_bytes, holders=1)
        if not name:  # a base: its one hold is its maker's, until a page takes it over
            self.bases.add(page.gen, page.tokens, page.genes, page.scope)
            self.on_base[page.gen] = 0
            self.index.publish_base(page.gen, page.tokens, page.scope)
            log.info("page.base_created", gen=page.gen, n_tokens=len(page.tokens), n_bytes=n_bytes)
            return page
        if page.base is not None:  # the maker's hold on the base is now the page's
            assert page.base.gen in self.on_base, "a page must stand on a base its maker holds"
            self.on_base[page.base.gen] += 1
            log.info("page.on_base", page=name, base=page.base.gen, n_base=page.n_base, n_bytes=n_bytes,
                     pages_on_base=self.on_base[page.base.gen])
        self.page_index.add(page.gen, page.tokens, page.genes, page.scope)
        old = self.names.get(name)
        self.names[name] = page.gen
        self.index.publish_page(name, len(page.tokens))
        self.dirty.pop(name, None)
        self.dirty[name] = page.gen
        if old is not None:
            self._unhold(old)
        return self.info(name)

    def find_base(self, name: str, tokens: list[int], genes: tuple[tuple[int, float], ...],
                  scope: str = "") -> BaseFound:
        """The longest base whose whole tokens begin `tokens` (held for the asker); else how
        many tokens `tokens` share exactly with another page (the index finds the page by
        blocks; the shared part may end mid-block, where the two minds part)."""
        for gen in self.bases.wholes(tokens, genes, scope):
            g = self.gens[gen]  # type: ignore[index]
            assert g.page is not None
            n = len(g.page.tokens)
            if n <= len(tokens) and tokens[:n] == g.page.tokens:
                g.holders += 1
                return BaseFound(base=g.page)
        other, _ = self.page_index.longest(tokens, genes, exclude=self.names.get(name), scope=scope)
        if other is None:
            return BaseFound(base=None, shared=0)
        page = self.gens[other].page  # type: ignore[index]
        assert page is not None
        return BaseFound(base=None, shared=common_prefix(page.tokens, tokens))

    def cancel(self, reservation: int) -> None:
        entry = self.reserved.pop(reservation, None)
        if entry is not None:
            self.charged -= entry[1]
            gen = self._earmark_of.pop(reservation, None)
            if gen is not None:
                self.earmarks.pop(gen, None)  # the old generation stays: it counts again
                self.pool.trim(self.ceiling - self.effective)

    def take(self, name: str) -> Page:
        gen = self.names.pop(name, None)
        if gen is None:
            raise PageNotFound(f"no page named {name!r}", page=name)
        self.index.publish_page(name, None)
        self.dirty.pop(name, None)  # the mind is in a slot now: the slot's own write-behind keeps it
        page = self.gens[gen].page
        assert page is not None
        return page  # the store's hold passes to the taker, who Releases or Returns it

    def give_back(self, gen: int) -> None:
        g = self.gens.get(gen)
        if g is None or g.page is None:
            return
        name = g.page.name
        if name in self.names:  # a newer page took the name meanwhile: ours is released
            self._unhold(gen)
        else:
            self.names[name] = gen
            self.index.publish_page(name, len(g.page.tokens))
            self.dirty[name] = gen  # whether its file still holds it is not known here

    def release(self, gen: int) -> None:
        if gen in self.gens:
            self._unhold(gen)

    def drop(self, name: str) -> PageInfo:
        info = self.info(name)
        gen = self.names.pop(name)
        self.index.publish_page(name, None)
        self.dirty.pop(name, None)
        self._unhold(gen)
        log.info("page.dropped", page=name, n_bytes=info.n_bytes, still_held=info.holders > 1)
        return info

    def spill_begin(self, name: str) -> Page:
        gen = self.names.get(name)
        if gen is None:
            raise PageNotFound(f"no page named {name!r}", page=name)
        g = self.gens[gen]
        if gen in self.earmarks:
            # A replacement counted these bytes as freed at its commit; holding them longer
            # must fit the ceiling on its own.
            if self.effective + self.earmarks[gen] > self.ceiling:
                self.metrics.page_refused_total.inc()
                log.info("page.spill_refused", page=name, reason="being replaced", n_bytes=g.n_bytes)
                raise PageRamExceeded(f"page {name!r} is being replaced and its bytes cannot be held longer",
                                      page=name, n_bytes=g.n_bytes, charged=self.charged, ceiling=self.ceiling)
            del self.earmarks[gen]
            for r, eg in list(self._earmark_of.items()):
                if eg == gen:
                    del self._earmark_of[r]
            self.pool.trim(self.ceiling - self.effective)
        g.holders += 1
        assert g.page is not None
        return g.page

    def spill_end(self, gen: int, drop: bool) -> bool:
        g = self.gens.get(gen)
        if g is None:
            return False
        dropped = False
        if drop and g.page is not None and self.names.get(g.page.name) == gen:
            del self.names[g.page.name]  # only this generation: a newer one stays
            self.index.publish_page(g.page.name, None)
            self.dirty.pop(g.page.name, None)
            self._unhold(gen)
            dropped = True
        self._unhold(gen)
        return dropped

    def _unhold(self, gen: int) -> None:
        g = self.gens[gen]
        g.holders -= 1
        if g.holders == 0:
            del self.gens[gen]
            self.charged -= g.n_bytes
            self.earmarks.pop(gen, None)
            self.page_index.remove(gen)
            if self.on_base.pop(gen, None) is not None:
                self.bases.remove(gen)
                self.index.publish_base(gen, None)
            base = g.page.base if g.page is not None else None
            if base is not None:
                self.on_base[base.gen] -= 1
                self._unhold(base.gen)
            # Nobody holds the page any more: its state buffer stays warm for the next
            # page_out, if it fits beside the pages under the ceiling.
            buf = buffer_of(g.page.state) if g.page is not None else None
            if buf is not None:
                self.pool.give(buf, self.ceiling - self.effective)

    def spill_victim(self, candidates: list[str]) -> str | None:
        """The placer's victim among `candidates` (oldest first): a page on a base other
        pages share comes last, since its spill frees only its own part."""
        first = None
        for name in candidates:
            gen = self.names.get(name)
            if gen is None:
                continue
            base = self.gens[gen].page.base  # type: ignore[union-attr]
            if base is None or self.on_base.get(base.gen, 0) <= 1:
                return name
            first = first or name
        return first

    # -- views -------------------------------------------------------------------------

    def page_names(self, after: str = "", limit: int = 0) -> list[str]:
        names = sorted(self.names)
        if after:
            from bisect import bisect_right

            names = names[bisect_right(names, after):]
        return names[:limit] if limit else names

    def scoped_names(self, scope: str, after: str = "", limit: int = 0) -> list[tuple[str, str]]:
        """(client name, name) of the pages of `scope`, by client name: those after `after`."""
        mine = sorted((c, n) for n in self.names if (c := client_name(n, scope)) is not None and c > after)
        return mine[:limit] if limit else mine

    def info(self, name: str) -> PageInfo:
        gen = self.names.get(name)
        if gen is None:
            raise PageNotFound(f"no page named {name!r}", page=name)
        g = self.gens[gen]
        assert g.page is not None
        base = g.page.base
        return PageInfo(page=name, gen=gen, n_bytes=g.n_bytes, n_tokens=len(g.page.tokens),
                        n_checkpoints=len(g.page.checkpoints), holders=g.holders, n_base=g.page.n_base,
                        base_pages=self.on_base.get(base.gen, 0) if base is not None else 0,
                        base=base.gen if base is not None else -1, base_bytes=base.n_bytes if base is not None else 0)

    def live_bytes(self) -> int:
        return sum(g.n_bytes for g in self.gens.values()) + sum(n for _, n in self.reserved.values())

    def shared_bytes(self) -> int:
        """What whole pages would have charged beyond what is charged: each base's bytes
        once more for every page standing on it beyond the first."""
        return sum(max(n - 1, 0) * self.gens[b].n_bytes for b, n in self.on_base.items())

    def stats(self) -> PageStoreStats:
        return PageStoreStats(charged=self.charged, ceiling=self.ceiling, pages=len(self.names),
                              generations=len(self.gens), reservations=len(self.reserved),
                              live_bytes=self.live_bytes(), earmarked=self.earmarked, pooled=self.pool.bytes,
                              pool_buffers=len(self.pool), pool_hits=self.pool.hits, pool_misses=self.pool.misses,
                              bases=len(self.on_base), base_bytes=sum(self.gens[b].n_bytes for b in self.on_base),
                              shared_bytes=self.shared_bytes(), unpersisted=len(self.dirty))

    def _publish_metrics(self) -> None:
        self.metrics.page_store_bytes.set(self.charged)
        self.metrics.page_store_pages.set(len(self.names))
        self.metrics.prefix_shared_bytes.set(self.shared_bytes())
