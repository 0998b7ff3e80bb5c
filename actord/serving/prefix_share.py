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

from typing import Any, Sequence

import anyio

from actord.engine import jobs as J
from actord.serving.page_messages import FindBase, Release
from actord.vocabulary.errors import ActordError
from actord.policy.prefix_index import common_prefix
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics

log = get("actord.slot")

MIN_SHARE = 32  # tokens: below this a prefill costs less than the share's bookkeeping


class PrefixShare:
    """A mixin of Slot: share a prefix by cells (see the module docstring)."""

    id: int
    seq: int
    engine: Any
    props: J.ModelProps
    metrics: Metrics
    peers: Sequence[Any]
    genes: tuple[tuple[int, float], ...]
    scope: str
    _kv: list[int]
    kv_epoch: int
    _share_note: tuple[int, int, int] | None
    share_prefixes: bool
    checkpoints: list[Any]
    pages: Any
    cells_batched: bool

    @property
    def lineage(self) -> tuple[tuple[tuple[int, float], ...], str]:
        """The non-token part of its cells' key (vocabulary/kv_identity.py): what a reuse compares."""
        return self.genes, self.scope

    @property
    def kv_tokens(self) -> list[int]:
        return self._kv

    @kv_tokens.setter
    def kv_tokens(self, tokens: list[int]) -> None:
        old = self._kv
        if len(tokens) < len(old) or tokens[:len(old)] != old:
            self.kv_epoch += 1  # a cell lost or replaced: shares of this sequence end here
        self._kv = tokens

    def shares_cells(self) -> bool:
        """Attention memory with every cell kept (a full cache). Not a windowed SWA cache:
        libllama reuses a cell the window has passed only while one sequence holds it, so
        shared cells would stay pinned in its few window-sized cells until a decode finds
        none free (seen: KvCacheFull on the tiny SWA model); those start from checkpoints."""
        p = self.props
        return self.share_prefixes and not (p.recurrent or p.hybrid or p.needs_checkpoints) and bool(p.kv_cells)

    def holds_steady(self) -> bool:
        """Its `kv_tokens` are cells that stay put for now: quiet, or running a request
        (which only adds cells past them)."""
        a = getattr(self, "active", None)
        if a is not None:
            return bool(a.enrolled)
        return bool(self.quiet())  # type: ignore[attr-defined]

    def best_source(self, prompt: list[int], lineage: Any, own: int) -> tuple[Any, int]:
        """The peer slot holding the longest prefix of `prompt` (at most all but its last
        token) under `lineage`, if it beats `own` by MIN_SHARE; else (None, 0)."""
        if not self.shares_cells() or len(prompt) <= MIN_SHARE:
            return None, 0
        limit = len(prompt) - 1
        best, best_n = None, own + MIN_SHARE - 1
        for p in self.peers:
            if p is self or p.lineage != lineage or len(p.kv_tokens) <= best_n or not p.holds_steady():
                continue
            n = min(common_prefix(p.kv_tokens, prompt), limit)
            if n > best_n:
                best, best_n = p, n
        return (best, best_n) if best is not None else (None, 0)

    def shared_point(self, prompt: list[int], lineage: Any) -> int:
        """Where `prompt` parts from the sequences other slots hold (the longest prefix it
        shares with one, under the same lineage): where minds that open alike diverge, so the
        checkpoint a mind that cannot share cells starts from belongs there."""
        if not self.share_prefixes:
            return 0
        limit = len(prompt) - 1
        n = max((common_prefix(p.kv_tokens, prompt) for p in self.peers if p is not self and p.lineage == lineage),
                default=0)
        return min(n, limit) if n >= MIN_SHARE else 0

    def best_checkpoint(self, prompt: list[int], lineage: Any, own: int) -> tuple[Any, Any]:
        """For memory that cannot share cells: the peer checkpoint (a peer slot's, at or
        below where the prompt parts from that peer's sequence) that starts the prompt
        furthest, if it beats `own` by MIN_SHARE; else (None, None)."""
        p = self.props
        if not (self.share_prefixes and p.needs_checkpoints and len(prompt) > MIN_SHARE):
            return None, None
        best, best_ck, best_n = None, None, own + MIN_SHARE - 1
        for peer in self.peers:
            if peer is self or peer.lineage != lineage or not peer.checkpoints or not peer.holds_steady():
                continue
            lcp = min(common_prefix(peer.kv_tokens, prompt), len(prompt) - 1)
            for ck in reversed(peer.checkpoints):
                if best_n < ck.pos <= lcp:
                    best, best_ck, best_n = peer, ck, ck.pos
                    break
        return best, best_ck

    async def share_checkpoint(self, prompt: list[int], lineage: Any, own: int) -> int:
        """Start `prompt` from a peer's checkpoint (its cells below it shared, the rest of
        the state from the checkpoint); the tokens it covers (0: none, nothing changed)."""
        src, ck = self.best_checkpoint(prompt, lineage, own)
        if src is None:
            return 0
        src_epoch, n = src.kv_epoch, ck.pos
        job = self.engine.submit(J.SeqShare(src=src.seq, dst=self.seq, n=n, checkpoint=ck.data))
        if not await self.engine.wait(job):
            log.info("slot.checkpoint_share_refused", slot=self.id, src=src.id, n_tokens=n)
            await self._hold_only(())  # type: ignore[attr-defined]
            return 0
        if self.props.kv_cells:
            self._share_note = (src.id, src_epoch, n)
        await self._hold_only(prompt[:n])  # type: ignore[attr-defined]
        self.genes, self.scope = lineage
        # This sequence holds the shared point's checkpoint too: the next mind may start here.
        await self.on_checkpoint(n, ck.data)  # type: ignore[attr-defined]
        self.metrics.prefix_hit_tokens_total.labels(source="checkpoint").inc(n)
        log.info("slot.prefix_shared", slot=self.id, src=src.id, n_tokens=n, n_prompt=len(prompt), by="checkpoint")
        return n

    async def share_prefix(self, prompt: list[int], lineage: Any, own: int) -> int:
        """Hold the longest prefix of `prompt` a peer holds, by cells (else, for memory
        that cannot share cells, from a peer's checkpoint); the tokens shared (0: none, and
        nothing changed)."""
        src, n = self.best_source(prompt, lineage, own)
        if src is None:
            return await self.share_checkpoint(prompt, lineage, own)
        src_epoch = src.kv_epoch
        # Submitted in the tick that read src's tokens: no job of src's comes between.
        job = self.engine.submit(J.SeqShare(src=src.seq, dst=self.seq, n=n))
        if not await self.engine.wait(job):
            log.info("slot.share_refused", slot=self.id, src=src.id, n_tokens=n)
            return await self.share_checkpoint(prompt, lineage, own)
        self._share_note = (src.id, src_epoch, n)
        await self._hold_only(prompt[:n])  # type: ignore[attr-defined]
        self.genes, self.scope = lineage
        self.metrics.prefix_hit_tokens_total.labels(source="slot").inc(n)
        log.info("slot.prefix_shared", slot=self.id, src=src.id, n_tokens=n, n_prompt=len(prompt))
        return n

    async def shared_cells_from(self, src: Any, n: int, src_epoch: int) -> None:
        """This sequence's first n cells were just taken from `src`'s, as they were in its
        epoch `src_epoch` (a page-in on a base a peer holds): the next cells tell says so."""
        self._share_note = (src.id, src_epoch, n)
        self.metrics.prefix_hit_tokens_total.labels(source="page_on_cells").inc(n)

    def take_share_note(self) -> dict[str, int]:
        note, self._share_note = self._share_note, None
        if note is None:
            return {}
        return {"shared_from": note[0], "shared_epoch": note[1], "shared": note[2]}

    async def from_base(self, req: Any, room: int) -> int:
        """A new mind's start from a base in page RAM (messages.FromBase): the tokens taken.
        One cells tell at the end, whatever happened, carrying the room token back."""
        self.cells_batched = True
        try:
            return await self._take_base(req)
        except ActordError as e:  # the request prefills as any new mind's does
            log.info("slot.base_refused", slot=self.id, error=e.to_dict())
            return 0
        finally:
            self.cells_batched = False
            with anyio.CancelScope(shield=True):
                await self._tell_cells(release=room)  # type: ignore[attr-defined]

    async def _take_base(self, req: Any) -> int:
        prompt = req.prompt
        if self.kv_tokens or not isinstance(prompt, list) or not self.stands_on_bases():  # type: ignore[attr-defined]
            return 0
        lineage = (self.gene_set(req), req.kv_scope())  # type: ignore[attr-defined]
        # The base is taken even where a peer slot's cells hold the prefix now: those may be
        # gone by the time this request begins (the placer that placed this mind may page
        # the peer's out next, or its request may end and be paged out: seen twice in
        # bench/multiturn.py, each a 1,000-token prefill), and a copy costs a memcpy.
        with anyio.CancelScope(shield=True):  # a base found is held for us: Released below
            found = await self.pages.ask(FindBase(name="", tokens=prompt[:-1], genes=lineage[0], scope=lineage[1]))
        base = found.base
        if base is None:
            return await self._take_file_base(prompt, lineage)
        try:
            n = len(base.tokens)
            if n < MIN_SHARE:
                return 0
            await self.engine.run(J.StateSet(seq=self.seq, data=base.state))
            self.kv_tokens = list(base.tokens)
            self.genes, self.scope = lineage
        finally:
            with anyio.CancelScope(shield=True):
                await self.pages.tell(Release(gen=base.gen))
        self.metrics.prefix_hit_tokens_total.labels(source="page_base").inc(n)
        log.info("slot.prefix_shared", slot=self.id, n_tokens=n, n_prompt=len(prompt), by="base")
        return n

    async def _take_file_base(self, prompt: list[int], lineage: Any) -> int:
        """No base in page RAM begins the prompt: a base file of the same identity may
        (storage/bases.py, `page_file_bases`), found in the files' index, read on a worker
        and set into this sequence."""
        from actord.serving.slot_pages import model_fingerprint, state_layout
        from actord.storage import bases as B

        files = self.files  # type: ignore[attr-defined]
        genes, scope = lineage
        if files.find_base(prompt, scope) is None:  # none of this scope at all: no gene list asked
            return 0
        by_id = {g.id: g.digest for g in await self.engine.run(J.GeneList())} if genes else {}
        digests = [[by_id.get(gid, ""), float(sc)] for gid, sc in genes]
        if any(not d for d, _ in digests):
            return 0  # a gene this daemon cannot name by content: no base file may stand for it
        fp = B.fingerprint({**model_fingerprint(self.props), **state_layout(self.props)})
        hit = files.find_base(prompt, scope, fp, sorted(digests))
        if hit is None:
            return 0
        image = await files.read_base(hit[0])
        n = len(image.tokens)
        if n < MIN_SHARE or list(image.tokens) != prompt[:n]:
            return 0
        await self.engine.run(J.StateSet(seq=self.seq, data=image.state))
        self.kv_tokens = list(image.tokens)
        self.genes, self.scope = lineage
        self.metrics.prefix_hit_tokens_total.labels(source="file_base").inc(n)
        log.info("slot.prefix_shared", slot=self.id, n_tokens=n, n_prompt=len(prompt), by="file_base")
        return n
