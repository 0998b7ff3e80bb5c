"""A new request starts from the longest prefix of its prompt that any slot's sequence holds.

Why: most sessions open with the same system prompt and tools. A request whose own slot
holds little of its prompt (a new mind, an unnamed request, a mind placed in a slot another
mind just left) takes the shared prefix from whichever slot holds most of it, by cells:
`SeqShare` adds this sequence to those cells of the unified KV cache, so nothing is copied
and only the rest of the prompt is prefilled. The source may be idle or running a request:
the job runs between steps and cells below what a running slot held at its start never
change while it runs (steps only add cells; its cut-backs move its epoch on).

Charged once: the tell that follows names the source, its epoch and the cells shared; the
scheduler's core counts them once for as long as neither sequence has lost or replaced a
cell since (`SchedulerCore.links`, serving/steps/core.py). A sequence's epoch moves on at
every change of `kv_tokens` that is not an extension: the slot's tells and enrolments carry
it, so the scheduler knows when a share has ended.

Who shares cells: attention memory with a full cache, under the same gene set (a prefix
computed under other genes is another state), where it saves at least `MIN_SHARE` tokens
over what the slot itself holds. With a full SWA cache the engine checks that the source
still holds the window position `n` attends to (a page-in brings the last window only), and
refuses otherwise.

Memory that cannot share cells (recurrent and hybrid models hold one state at the end of a
sequence, not one per cell; a windowed SWA cache, whose shared cells libllama could not
reuse once the window passed them; a share the engine refused) starts from a
peer's checkpoint instead: its attention cells below the checkpoint are shared and the
checkpoint's partial state set over them. Every request plans a checkpoint at its shared
point (where its prompt parts from what other slots hold: `shared_point`), and a sequence
started from one keeps a copy, so the next mind that opens alike finds it. Where neither
applies, nothing changes: the request prefills as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from actord.engine import jobs as J
from actord.serving.page_messages import FindBase, Release
from actord.vocabulary.errors import ActordError
from actord.serving.kv_index import MIN_SHARE
from actord.serving.start_plan import Start, plan_start
from actord.vocabulary.kv_identity import Lineage
from actord.serving.slot_memory import SlotMemory
from actord.vocabulary.log import get

if TYPE_CHECKING:
    from actord.serving.slot_peers import SlotPeers

log = get("actord.slot")


class PrefixShare:
    """A slot's part that starts its sequence from what others hold (see the module
    docstring): given the slot's memory and its peers (the sequence index, the page store
    and the files are the ones it asks)."""

    def __init__(self, memory: SlotMemory, peers: SlotPeers) -> None:
        self.memory = memory
        self.peers = peers

    def plan(self, prompt: list[int], lineage: Lineage, own: int, *, cells: bool = True) -> Start:
        """Where the request starts (start_plan.plan_start), as this slot's memory allows:
        cells only where they can be shared (`shares_cells`; `cells` False after a refused
        share), checkpoints only where the memory keeps them."""
        m = self.memory
        return plan_start(self.peers.index, m.id, prompt, lineage, own, cells=cells and m.shares_cells(),
                          checkpoints=m.share_prefixes and m.props.needs_checkpoints)

    def shared_point(self, prompt: list[int], lineage: Lineage) -> int:
        """Where `prompt` parts from the sequences other slots hold (the longest prefix it
        shares with one, under the same lineage): where minds that open alike diverge, so the
        checkpoint a mind that cannot share cells starts from belongs there."""
        return self.peers.index.shared_point(self.memory.id, prompt, lineage) if self.memory.share_prefixes else 0

    async def share_prefix(self, prompt: list[int], lineage: Lineage, own: int) -> int:
        """Carry out the plan: hold the longest prefix of `prompt` a peer holds, by cells
        (else, for memory that cannot share cells or where the engine refused the share, from
        a peer's checkpoint); the tokens shared (0: none, and nothing changed)."""
        plan = self.plan(prompt, lineage, own)
        if plan.how == "cells":
            if await self._share_cells(plan, prompt, lineage):
                return plan.n
            plan = self.plan(prompt, lineage, own, cells=False)  # read again: the wait let others run
        if plan.how == "checkpoint":
            return await self._share_checkpoint(plan, prompt, lineage)
        return 0

    async def _share_cells(self, plan: Start, prompt: list[int], lineage: Lineage) -> bool:
        m, src, n = self.memory, plan.src, plan.n
        assert src is not None
        # Submitted in the tick that read src's record: no job of src's comes between.
        job = m.engine.submit(J.SeqShare(src=src.seq, dst=m.seq, n=n))
        if not await m.engine.wait(job):
            log.info("slot.share_refused", slot=m.id, src=src.slot, n_tokens=n)
            return False
        m.note_share(src.slot, src.epoch, n, "slot")
        await m.hold_only(prompt[:n])
        m.lineage = lineage
        log.info("slot.prefix_shared", slot=m.id, src=src.slot, n_tokens=n, n_prompt=len(prompt))
        return True

    async def _share_checkpoint(self, plan: Start, prompt: list[int], lineage: Lineage) -> int:
        """Start `prompt` from a peer's checkpoint (its cells below it shared, the rest of
        the state from the checkpoint); the tokens it covers (0: none, nothing changed)."""
        m, src, ck = self.memory, plan.src, plan.checkpoint
        assert src is not None and ck is not None
        n = ck.pos
        job = m.engine.submit(J.SeqShare(src=src.seq, dst=m.seq, n=n, checkpoint=ck.data))
        if not await m.engine.wait(job):
            log.info("slot.checkpoint_share_refused", slot=m.id, src=src.slot, n_tokens=n)
            await m.hold_only(())
            return 0
        if m.props.kv_cells:
            m.note_share(src.slot, src.epoch, n, "checkpoint")
        else:
            m.metrics.prefix_hit_tokens_total.labels(source="checkpoint").inc(n)
        await m.hold_only(prompt[:n])
        m.lineage = lineage
        # This sequence holds the shared point's checkpoint too: the next mind may start here.
        await m.on_checkpoint(n, ck.data)
        log.info("slot.prefix_shared", slot=m.id, src=src.slot, n_tokens=n, n_prompt=len(prompt), by="checkpoint")
        return n

    async def from_base(self, prompt: Any, lineage: Lineage, room: int) -> int:
        """A new mind's start from a base in page RAM or a base file (messages.FromBase): the
        tokens taken. One cells tell at the end, whatever happened, carrying the room token back."""
        m = self.memory
        m.cells_batched = True
        try:
            return await self._take_base(prompt, lineage)
        except ActordError as e:  # the request prefills as any new mind's does
            log.info("slot.base_refused", slot=m.id, error=e.to_dict())
            return 0
        finally:
            m.cells_batched = False
            with anyio.CancelScope(shield=True):
                await m.tell_cells(release=room)

    async def base_after_cut(self, prompt: list[int], lineage: Lineage, most: int) -> int:
        """A request whose slot could not cut its own cells back (a moved-in sliding window:
        libllama keeps only its last window) starts from the longest base of its prompt
        instead of from nothing, where the base is at most `most` tokens (what the slot held,
        which the scheduler still counts for it: no cell appears outside its plan). The
        tokens taken (0: none)."""
        try:
            return await self._take_base(prompt, lineage, most)
        except ActordError as e:  # the request prefills whole, as before
            log.info("slot.base_refused", slot=self.memory.id, error=e.to_dict())
            return 0

    async def _take_base(self, prompt: Any, lineage: Lineage, most: int | None = None) -> int:
        m = self.memory
        if m.kv_tokens or not isinstance(prompt, list) or not m.stands_on_bases():
            return 0
        # The base is taken even where a peer slot's cells hold the prefix now: those may be
        # gone by the time this request begins (the placer that placed this mind may page
        # the peer's out next, or its request may end and be paged out: seen twice in
        # bench/multiturn.py, each a 1,000-token prefill), and a copy costs a memcpy.
        with anyio.CancelScope(shield=True):  # a base found is held for us: Released below
            found = await self.peers.pages.ask(FindBase(name="", tokens=prompt[:-1], genes=lineage[0], scope=lineage[1]))
        base = found.base
        if base is None:
            return await self._take_file_base(prompt, lineage, most)
        try:
            n = len(base.tokens)
            if n < MIN_SHARE or (most is not None and n > most):
                return 0
            await m.engine.run(J.StateSet(seq=m.seq, data=base.state))
            m.kv_tokens = list(base.tokens)
            m.lineage = lineage
        finally:
            with anyio.CancelScope(shield=True):
                await self.peers.pages.tell(Release(gen=base.gen))
        m.metrics.prefix_hit_tokens_total.labels(source="page_base").inc(n)
        log.info("slot.prefix_shared", slot=m.id, n_tokens=n, n_prompt=len(prompt), by="base")
        return n

    async def _take_file_base(self, prompt: list[int], lineage: Lineage, most: int | None = None) -> int:
        """No base in page RAM begins the prompt: a base file of the same identity may
        (storage/bases.py, `page_file_bases`), found in the index (serving/kv_index.py), read
        on a worker and set into this sequence."""
        from actord.serving.slot_pages import model_fingerprint, state_layout
        from actord.storage import bases as B

        m, files, index = self.memory, self.peers.files, self.peers.index
        genes, scope = lineage
        if index.base_file_for(prompt, scope) is None:  # none of this scope at all: no gene list asked
            return 0
        by_id = {g.id: g.digest for g in await m.engine.run(J.GeneList())} if genes else {}
        digests = [[by_id.get(gid, ""), float(sc)] for gid, sc in genes]
        if any(not d for d, _ in digests):
            return 0  # a gene this daemon cannot name by content: no base file may stand for it
        fp = B.fingerprint({**model_fingerprint(m.props), **state_layout(m.props)})
        hit = index.base_file_for(prompt, scope, fp, sorted(digests))
        if hit is None:
            return 0
        image = await files.read_base(hit[0])
        n = len(image.tokens)
        if n < MIN_SHARE or (most is not None and n > most) or list(image.tokens) != prompt[:n]:
            return 0
        await m.engine.run(J.StateSet(seq=m.seq, data=image.state))
        m.kv_tokens = list(image.tokens)
        m.lineage = lineage
        m.metrics.prefix_hit_tokens_total.labels(source="file_base").inc(n)
        log.info("slot.prefix_shared", slot=m.id, n_tokens=n, n_prompt=len(prompt), by="file_base")
        return n
