"""A slot's pages on shared prefixes: page-out of only the part a base does not hold, and
page-in of that part onto a base (a peer slot's cells, else the base's bytes).

Why: minds of an agent platform begin with the same system prompt and tools; a whole page
per mind copies that prefix into every page (issue 25). The page store keeps a prefix's
state once as a *base* (serving/page_store.py); a page on it holds only the positions from
the base's end on, and a page-in moves only that part when a peer slot's sequence already
holds the base's tokens (its cells are shared in the unified KV, nothing is copied).

Which page-outs stand on a base: one whose tokens (all but the last: a base leaves a rest)
begin with a base's whole tokens, of at least one block (policy/prefix_index.py); else,
when at least a block's worth of tokens is shared with another page or a peer slot's
sequence, the slot makes the base from its own sequence first, ending exactly where the
two part (mid-block too: a page on it then holds only what is its own). The parts' sizes are known only once copied
(libllama has no size query for part of a sequence), so each part is copied, then admitted
at its exact size; a refusal drops the copy and, for the base, leaves a whole page. The
sequence stays in the slot until the page is committed, so a refused, failed or cancelled
page-out on a base leaves it intact and no reservation or hold behind.

Memory that cannot share cells (recurrent, hybrid: one state at the end of a sequence, not
one per cell; models that need checkpoints; a draft context, whose sequence is not split)
keeps whole pages, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from actord.serving.page_store import (
    Admit, AdmitBase, AdmitState, BaseFound, CancelReservation, Commit, FindBase, Page, PageAdmission, Release,
)
from actord.engine import jobs as J
from actord.vocabulary.errors import PageDoesNotFit, PageRamExceeded
from actord.vocabulary.log import get
from actord.policy.checkpoint_records import SlotCheckpoint
from actord.policy.prefix_index import BLOCK
from actord.serving.kv_index import Held
from actord.serving.slot_memory import SlotMemory

if TYPE_CHECKING:
    from actord.serving.slot_peers import SlotPeers

log = get("actord.slot")


class PageBases:
    """Page moves on a base (see the module docstring): a part of a slot's page moves, given
    the slot's memory and its peers (the sequence index and the page store are the ones it asks)."""

    def __init__(self, memory: SlotMemory, peers: SlotPeers) -> None:
        self.memory = memory
        self.peers = peers

    def _peer_shared(self, tokens: list[int]) -> int:
        """Tokens a peer slot's sequence shares with `tokens` (or the prompt of the request it
        runs: serving/kv_index.py): a base ends where the two part, mid-block or not, so
        a page on it holds only its own."""
        m = self.memory
        return self.peers.index.peer_shared(m.id, tokens, m.lineage)

    async def _base_for_page_out(self, name: str, whole: AdmitState | None) -> Page | PageAdmission | None:
        """The base this slot's page can stand on, held for it (Commit or Release it); else,
        when nothing is shared and `whole` was given, the whole page's admission (made by the
        same ask); None when there is no base worth having or the ceiling refused one."""
        m = self.memory
        tokens = m.kv_tokens[:-1]  # a base must leave a rest
        peer = self._peer_shared(tokens)
        # The asks that hand this slot a hold are shielded: a hold whose answer a cancel lost
        # would keep a base (and its bytes) forever.
        with anyio.CancelScope(shield=True):
            found: BaseFound = await self.peers.pages.ask(FindBase(name=name, tokens=tokens, genes=m.genes, scope=m.scope,
                                                             whole=whole if peer < BLOCK else None))
        if found.base is not None:
            return found.base
        if found.admission is not None:
            return found.admission
        n = max(found.shared, peer)
        if n < BLOCK:
            return None
        st = await m.engine.run(J.StateGet(seq=m.seq, p1=n))
        if not st.n_bytes:  # its sliding window at n is not whole (state_copy.py state_get_range): no base
            log.info("page.base_window_lost", slot=m.id, n_base=n)
            return None
        n_bytes = st.n_bytes + 4 * n
        try:
            adm: PageAdmission = await self.peers.pages.ask(AdmitBase(n_bytes=n_bytes, n_state=st.n_bytes))
        except PageRamExceeded:
            log.info("page.base_refused", slot=m.id, n_base=n, n_bytes=n_bytes)
            return None
        base = Page(gen=adm.reservation, name="", n_bytes=adm.n_bytes, state=st.data,
                    tokens=list(m.kv_tokens[:n]), genes=m.genes, scope=m.scope)
        with anyio.CancelScope(shield=True):
            try:
                return await self.peers.pages.ask(Commit(reservation=adm.reservation, page=base))
            except BaseException:
                await self.peers.pages.tell(CancelReservation(reservation=adm.reservation))
                raise

    async def page_out_on_base(self, name: str, ckpts: list[SlotCheckpoint], whole: AdmitState | None = None,
                               digests: tuple[str, ...] = ()) -> tuple[Any, int, J.StateData] | PageAdmission | None:
        """Commit page `name` as a base and the rest, the sequence left in the slot (the
        caller frees it): (the store's PageInfo, the page's charge, the rest's copy). When no
        base applies: `whole`'s admission if the store made it, else None (the caller stores
        the page whole)."""
        m = self.memory
        if not m.stands_on_bases() or len(m.kv_tokens) <= BLOCK:
            return None
        base = await self._base_for_page_out(name, whole)
        if base is None or isinstance(base, PageAdmission):
            return base
        reservation = None
        try:
            n_base = len(base.tokens)
            rest = await m.engine.run(J.StateGet(seq=m.seq, p0=n_base))
            n_bytes = rest.n_bytes + 4 * len(m.kv_tokens) + sum(c.n_bytes for c in ckpts)
            reservation = await self.peers.pages.ask(Admit(name=name, n_bytes=n_bytes))
            page = Page(
                gen=reservation, name=name, n_bytes=n_bytes, state=rest.data, tokens=list(m.kv_tokens),
                checkpoints=list(ckpts), genes=m.genes, scope=m.scope, gene_digests=digests,
                divergences=list(m.ckpt.history),
                prompt_end=m.ckpt.prompt_end, base=base, n_base=n_base,
            )
            with anyio.CancelScope(shield=True):  # once committed, the hold is the page's
                info = await self.peers.pages.ask(Commit(reservation=reservation, page=page))
        except BaseException as e:
            if not isinstance(e, PageRamExceeded):
                m.metrics.page_failed_total.inc()
            with anyio.CancelScope(shield=True):
                if reservation is not None:
                    await self.peers.pages.tell(CancelReservation(reservation=reservation))
                await self.peers.pages.tell(Release(gen=base.gen))  # the page never took the hold over
            raise
        return info, n_bytes, rest

    def _peer_holding(self, page: Page) -> Held | None:
        """A peer slot whose sequence begins with the page's base, under the same lineage, and
        whose cells below it do not change: quiet, or running an enrolled request."""
        assert page.base is not None
        return self.peers.index.holding(self.memory.id, page.tokens, page.n_base, (page.genes, page.scope))

    def submit_page_state(self, page: Page) -> tuple[Any, Any]:
        """Submit the job that sets the page's state into this slot's sequence: the whole
        state, or its base (a peer's cells, else the base's bytes) and the rest. Returns the
        pending job and the peer whose cells it shares (None: no peer)."""
        m = self.memory
        if page.base is None:
            return m.engine.submit(J.StateSet(seq=m.seq, data=page.state)), None
        peer = self._peer_holding(page)
        if peer is not None:
            # Its record as the job is submitted, in this tick: the share is of these cells (its epoch).
            job = J.StateSet(seq=m.seq, data=page.state, base_seq=peer.seq, n_base=page.n_base,
                             n_tokens=len(page.tokens))
        else:
            job = J.StateSet(seq=m.seq, data=page.state, base=page.base.state, n_base=page.n_base,
                             n_tokens=len(page.tokens))
        return m.engine.submit(job), peer

    async def wait_page_state(self, page: Page, pending: Any, peer: Any) -> tuple[J.StateData, Any]:
        """The submitted job's result; a peer that no longer holds the base's cells (refused:
        PageDoesNotFit) falls back to the base's bytes. Returns the copy and the peer used."""
        m = self.memory
        try:
            return await m.engine.wait(pending), peer
        except PageDoesNotFit:
            if peer is None or page.base is None:
                raise
        log.info("page.peer_base_refused", slot=m.id, peer=peer.slot, n_base=page.n_base)
        st = await m.engine.run(J.StateSet(seq=m.seq, data=page.state, base=page.base.state,
                                              n_base=page.n_base, n_tokens=len(page.tokens)))
        return st, None

    def after_shared_page_in(self, page: Page, peer: Held | None) -> dict[str, Any]:
        """Note who shares cells now (the next cells tell carries it to the scheduler); what a
        page-in on a base answers beyond a whole page's."""
        if page.base is None:
            return {}
        if peer is not None:
            self.memory.note_share(peer.slot, peer.epoch, page.n_base, "page_on_cells")
        return {"n_base": page.n_base, "base_from": "cells" if peer is not None else "bytes",
                **({"base_slot": peer.slot} if peer is not None else {})}

