"""What a slot does with its whole sequence: page it out and in, save it to and restore it
from a page file, and what a page or file records about the model it came from.

A part of `Slot` (serving/slot.py), kept apart because it is the slot's second job: moving
memory between a sequence, the PageStore and page files. Nothing is ever half-moved: a
refused or failed page_out leaves the sequence intact, a failed page_in leaves the page in
the store, a failed restore leaves the slot empty and usable.

With speculative decoding on, the draft context's sequence for this slot travels with it:
a page carries its state (`Page.draft`, charged against the page RAM ceiling with the rest)
and how many tokens it holds; a page file carries it in the `.dft` sidecar of the same
generation, with the draft model's digest in the main file's meta. A page or file without
one (saved with speculation off, or from another draft model) starts the draft cold: the
draft context catches up on the slot's tokens at its next request (logged, not an error).
The target verifies every draft, so a cold or stale draft costs acceptance, never output.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

from actord.serving.page_bases import PageBases
from actord.serving.page_store import (
    AdmitState, CancelReservation, Commit, Page, PageAdmission, Release, Return, Take,
)
from actord.serving.slot_memory import SlotMemory
from actord.engine import jobs as J
from actord.vocabulary.errors import (
    ActordError, ContextFull, EngineError, ForeignPage, GenesMissing, PageDoesNotFit, SlotBusy, SlotEmpty,
)
from actord.vocabulary.log import get
from actord.policy.checkpoint_placement import Divergence
from actord.policy.checkpoint_records import SlotCheckpoint, StoredCheckpoint
from actord.storage.pagefile import KEPT_META, PageImage, StoredGene
from actord.vocabulary.names import MIND_FILE_SUFFIX, check_mind

if TYPE_CHECKING:
    from actord.serving.slot_peers import SlotPeers

log = get("actord.slot")


def mind_named(name: str) -> str | None:
    """The mind a slot holds after a page or file named `name` moves in: that name where a
    mind may bear it, else none (a slot's state, as a slot-addressed request leaves): a name
    no mind may have (a page's 119-128 characters, a file in a folder) would be a mind whose
    state write-behind and a stop could never write to her file."""
    return name if check_mind(name) is None else None


class SlotPages:
    """Page and file moves of a slot's sequence (see the module docstring): a part of a slot,
    given its memory, its page-base part and its peers (the page store and the page files
    are the ones it asks)."""

    def __init__(self, memory: SlotMemory, bases: PageBases, peers: SlotPeers) -> None:
        self.memory = memory
        self.bases = bases
        self.peers = peers
        self.paged_out_base = 0  # tokens of the base the last page-out stood on (the placer's hint)
        # (file, its version then, mind, n, hash of the tokens) of the sequence last written to
        # or read from a file: write-behind does not write an unchanged mind again while that
        # file is still the generation it wrote or read (storage/files.py `version`).
        self._persisted_sig: tuple[Any, ...] | None = None

    async def _capture(self) -> tuple[J.StateData, list[SlotCheckpoint]]:
        m = self.memory
        if not m.kv_tokens:
            raise SlotEmpty(f"slot {m.id} holds no sequence", slot=m.id)
        ckpts = await m.page_checkpoints()
        return await m.engine.run(J.StateGet(seq=m.seq)), ckpts

    async def page_out(self, name: str, *, keep: bool = False) -> dict[str, Any]:
        """The sequence into page `name`, the slot freed. `keep`: a copy only; the slot keeps
        its sequence without the mind's name (another request on this slot starts from what
        she shares with it, and her state is hers in the store)."""
        m = self.memory
        name = name or m.mind or f"evicted-slot{m.id}"
        if not m.kv_tokens:
            raise SlotEmpty(f"slot {m.id} holds no sequence", slot=m.id)
        t0 = time.perf_counter()
        ckpts = await m.page_checkpoints()
        n_draft, take = 0, False
        sizes = await self._whole_sizes(ckpts)
        digests = await self.gene_digests()
        whole = AdmitState(name=name, n_bytes=sizes[0], n_state=sizes[1])
        on_base = await self.bases.page_out_on_base(name, ckpts, whole, digests)
        if on_base is not None and not isinstance(on_base, PageAdmission):
            info, n_bytes, st = on_base
        else:
            info, n_bytes, st, take, n_draft = await self._page_out_whole(name, ckpts, keep, sizes, on_base, digests)
        n_tokens = len(m.kv_tokens)
        if keep:
            m.mind = None
            m.metrics.page_out_total.inc()
            log.info("page.out", slot=m.id, page=name, n_bytes=n_bytes, n_tokens=n_tokens, kept_in_slot=True,
                     t_ms=round((time.perf_counter() - t0) * 1e3, 3), copy_ms=round(st.t_ms, 3))
            return {"slot": m.id, "page": name, "n_bytes": n_bytes, "n_tokens": n_tokens, "kept": True}
        # The page is whole in the store; only now is the slot freed.
        if not take:
            await m.engine.run(J.SeqRm(seq=m.seq, p0=-1, p1=-1))
        m.forget()
        m.ckpt.reset()
        await m.release_checkpoints()
        t_ms = (time.perf_counter() - t0) * 1e3
        m.metrics.page_out_total.inc()
        await m.footprint_changed()
        await m.tell_cells()
        n_base = self.paged_out_base = info.n_base
        log.info("page.out", slot=m.id, page=name, n_bytes=n_bytes, n_tokens=n_tokens, t_ms=round(t_ms, 3),
                 copy_ms=round(st.t_ms, 3), draft_bytes=n_draft, n_base=n_base)
        return {"slot": m.id, "page": name, "n_bytes": n_bytes, "n_tokens": n_tokens,
                "n_checkpoints": info.n_checkpoints, "t_ms": t_ms, "copy_ms": st.t_ms, "lib_ms": st.lib_ms,
                **({"draft_bytes": n_draft} if m.drafting else {}), **({"n_base": n_base} if n_base else {})}

    async def _whole_sizes(self, ckpts: list[SlotCheckpoint]) -> tuple[int, int, int]:
        """A whole page's charge, its sequence state's bytes and its draft's bytes."""
        m = self.memory
        n_state = await m.engine.run(J.StateSize(seq=m.seq))
        n_draft = await m.engine.run(J.StateSize(seq=m.seq, draft=True)) if m.drafting and m.draft_n else 0
        return n_state + n_draft + 4 * len(m.kv_tokens) + sum(c.n_bytes for c in ckpts), n_state, n_draft

    async def _page_out_whole(self, name: str, ckpts: list[SlotCheckpoint], keep: bool,
                              sizes: tuple[int, int, int], adm: PageAdmission | None, digests: tuple[str, ...]
                              ) -> tuple[Any, int, J.StateData, bool, int]:
        """The sequence as one whole page: (PageInfo, charge, the copy, whether the copy took
        the sequence out, the draft's bytes). `adm`: its admission, if the store made it
        already (FindBase.whole)."""
        m = self.memory
        n_bytes, n_state, n_draft = sizes
        # The store admits the page and hands out the buffer the state goes into (a warm one
        # from its pool when one fits); libllama writes the state there, the one copy.
        if adm is None:
            adm = await self.peers.pages.ask(AdmitState(name=name, n_bytes=n_bytes, n_state=n_state))
        reservation, n_bytes = adm.reservation, adm.n_bytes
        # Without a draft the copy also removes the sequence (one engine round trip less: a
        # round trip to a sleeping engine thread cost 0.2-0.5 ms here, a third of a 4k-token
        # Gemma page_out); if the page cannot be kept, the state is set back from the copy.
        take = n_draft == 0 and not m.drafting and not keep
        taken: J.StateData | None = None
        try:
            with anyio.CancelScope(shield=take):  # a taken state must not be lost to a cancel
                st = await m.engine.run(J.StateGet(seq=m.seq, into=adm.into, capacity=adm.capacity,
                                                      then_erase=take))
            taken = st if take else None
            if st.n_bytes != n_state:
                raise EngineError("sequence state changed size between admission and copy", slot=m.id)
            draft = await m.engine.run(J.StateGet(seq=m.seq, draft=True)) if n_draft else None
            if draft is not None and draft.n_bytes != n_draft:
                raise EngineError("draft state changed size between admission and copy", slot=m.id)
            page = Page(
                gen=reservation, name=name, n_bytes=n_bytes, state=st.data, tokens=list(m.kv_tokens),
                checkpoints=list(ckpts), genes=m.genes, scope=m.scope, gene_digests=digests,
                divergences=list(m.ckpt.history), prompt_end=m.ckpt.prompt_end,
                draft=draft.data if draft is not None else None, draft_n=m.draft_n if draft is not None else 0,
            )
            info = await self.peers.pages.ask(Commit(reservation=reservation, page=page))
        except BaseException:
            with anyio.CancelScope(shield=True):
                if taken is not None:  # before the reservation (and the buffer) goes back
                    await self._put_back(taken.data)
                await self.peers.pages.tell(CancelReservation(reservation=reservation))
            m.metrics.page_failed_total.inc()
            raise
        return info, n_bytes, st, take, n_draft

    async def _put_back(self, data: Any) -> None:
        """A page_out that took the sequence failed: the state goes back from its copy. Should
        libllama refuse it (it has just written it), the slot is erased rather than claim a
        sequence it no longer holds."""
        m = self.memory
        try:
            await m.engine.run(J.StateSet(seq=m.seq, data=data))
        except ActordError as e:
            log.error("page.put_back_failed", slot=m.id, error=str(e))
            await m.erase()

    async def page_in(self, name: str, room_cells: int = -1) -> dict[str, Any]:
        m = self.memory
        if m.kv_tokens:
            raise SlotBusy(f"slot {m.id} holds a sequence: page it out or erase it first", slot=m.id)
        t0 = time.perf_counter()
        page: Page = await self.peers.pages.ask(Take(name=name))
        if 0 <= room_cells < len(page.tokens):
            # Sized by an older page of this name: the cells held for it would not cover it.
            await self.peers.pages.tell(Return(gen=page.gen))
            raise ContextFull(f"page {name!r} holds {len(page.tokens)} tokens, more than the {room_cells} cells "
                              "held for it", page=name, n_tokens=len(page.tokens), held=room_cells)
        genes, scope = m.lineage
        try:
            # The copy runs on the engine thread while the page's checkpoints enter the
            # budget here (an ask of ~0.3 ms for 16 checkpoints, no longer after the copy).
            pending, peer = self.bases.submit_page_state(page)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.peers.pages.tell(Return(gen=page.gen))
            raise
        copied = False
        try:
            try:
                m.kv_tokens = list(page.tokens)
                m.lineage = (page.genes, page.scope)
                m.learn_digests(dict(zip([g for g, _ in page.genes], page.gene_digests)))
                m.resume_raw_lcp = None
                m.mind = mind_named(name)
                m.ckpt.adopt(page.divergences, page.prompt_end, len(page.tokens))
                await m.adopt_checkpoints(list(page.checkpoints))
            finally:
                with anyio.CancelScope(shield=True):
                    st, peer = await self.bases.wait_page_state(page, pending, peer)
                    copied = True
        except BaseException:
            with anyio.CancelScope(shield=True):
                if copied:  # the state is in, the bookkeeping is not: the sequence goes
                    await m.engine.run(J.SeqRm(seq=m.seq, p0=-1, p1=-1))
                m.lineage = (genes, scope)
                m.kv_tokens, m.mind = [], None
                m.ckpt.reset()
                await m.release_checkpoints()
                await self.peers.pages.tell(Return(gen=page.gen))
                await m.tell_cells()
            m.metrics.page_failed_total.inc()
            log.warning("page.in_failed", slot=m.id, page=name)
            raise
        await m.adopt_draft(page.draft, page.draft_n, f"page {name}")
        await self.peers.pages.tell(Release(gen=page.gen))
        t_ms = (time.perf_counter() - t0) * 1e3
        m.metrics.page_in_total.inc()
        await m.footprint_changed()
        on_base = self.bases.after_shared_page_in(page, peer)
        await m.tell_cells()
        moved = st.n_bytes if page.base is not None else page.n_bytes  # a base's cells did not move
        log.info("page.in", slot=m.id, page=name, n_bytes=moved, n_tokens=len(page.tokens),
                 t_ms=round(t_ms, 3), copy_ms=round(st.t_ms, 3), **on_base)
        return {"slot": m.id, "page": name, "n_bytes": moved, "n_tokens": len(page.tokens), **on_base,
                "n_checkpoints": len(m.checkpoints), "t_ms": t_ms, "copy_ms": st.t_ms, "lib_ms": st.lib_ms,
                **m.draft_info()}

    async def gene_digests(self) -> tuple[str, ...]:
        """The slot's genes by content, in order (what a page or file records of them)."""
        m = self.memory
        if not m.genes:
            return ()
        by_id = m.digests
        if any(gid not in by_id for gid, _ in m.genes):  # told none (an old page): asked of the engine
            by_id = {**{g.id: g.digest for g in await m.engine.run(J.GeneList())}, **by_id}
        return tuple(by_id.get(gid, "") for gid, _ in m.genes)

    async def genes_by_content(self, image: PageImage, file: str) -> tuple[tuple[int, float], ...]:
        """A file's genes as this daemon's ids, found by content; GenesMissing when one is
        not loaded here or the file cannot name it (no digest): never restored under
        another adapter that happens to have its old id."""
        if not image.genes:
            return ()
        by_digest: dict[str, int] = {}
        for g in await self.memory.engine.run(J.GeneList()):
            by_digest.setdefault(g.digest, g.id)
        out = []
        for sg in image.genes:
            gid = by_digest.get(sg.digest) if sg.digest else None
            if gid is None:
                why = ("saved before page files named genes by content" if not sg.digest
                       else f"gene {sg.digest} is not loaded here")
                raise GenesMissing(f"{file} holds a state computed under a gene this daemon cannot match: {why}",
                                   file=file, digest=sg.digest, saved_id=sg.id)
            out.append((gid, float(sg.scale)))
        self.memory.learn_digests({gid: sg.digest for (gid, _), sg in zip(out, image.genes)})
        return tuple(sorted(out))

    async def save_mind(self, mind: str, file: str) -> dict[str, Any]:
        """Save the slot's mind to her file, unless the slot holds another or the file
        already holds this very sequence (write-behind asks again and again)."""
        m = self.memory
        if m.mind != mind or not m.kv_tokens:
            return {"slot": m.id, "file": file, "skipped": "the slot holds another mind"}
        sig = self._persisted_sig
        if sig == (file, self.peers.files.version(file), *m.kv_sig()):  # and nobody published the file since
            return {"slot": m.id, "file": file, "skipped": "unchanged"}
        return await self.save(file)

    async def save(self, file: str, *, kept: bool = False) -> dict[str, Any]:
        m = self.memory
        self.peers.files.check(file)
        t0 = time.perf_counter()
        st, ckpts = await self._capture()
        draft = await m.engine.run(J.StateGet(seq=m.seq, draft=True)) if m.drafting and m.draft_n else None
        image = page_image(m.props, st.data, ckpts, m.kv_tokens, m.genes, m.ckpt.history,
                           m.ckpt.prompt_end, draft=draft.data if draft else None, draft_n=m.draft_n,
                           scope=m.scope, gene_digests=await self.gene_digests(), kept=kept)
        stats = await self.peers.files.publish(file, image)
        self._persisted_sig = (file, self.peers.files.version(file), *m.kv_sig())  # no await since: ours
        t_ms = (time.perf_counter() - t0) * 1e3
        log.info("slot.saved", slot=m.id, file=file, n_bytes=stats.n_bytes, t_ms=round(t_ms, 3))
        return {"slot": m.id, "file": file, "n_bytes": stats.n_bytes, "n_tokens": len(m.kv_tokens),
                "n_checkpoints": len(ckpts), "t_ms": t_ms, "copy_ms": st.t_ms}

    async def restore(self, file: str, room_cells: int = -1) -> dict[str, Any]:
        m = self.memory
        t0 = time.perf_counter()
        image = await self.peers.files.read(file)
        version = self.peers.files.version(file)
        if 0 <= room_cells < len(image.tokens):  # written again since the asker sized it
            raise ContextFull(f"file {file!r} holds {len(image.tokens)} tokens, more than the {room_cells} cells "
                              "held for it", file=file, n_tokens=len(image.tokens), held=room_cells)
        check_fingerprint(image, m.props, file)
        genes = await self.genes_by_content(image, file)
        # The slot's old content goes; a failed restore leaves the slot empty and usable.
        m.forget()
        await m.release_checkpoints()
        try:
            if image.base is not None:  # a page spilled on a base: the file holds both parts
                st = await m.engine.run(J.StateSet(seq=m.seq, data=image.state, base=image.base,
                                                      n_base=image.n_base, n_tokens=len(image.tokens)))
            else:
                st = await m.engine.run(J.StateSet(seq=m.seq, data=image.state))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await m.footprint_changed()
                await m.tell_cells()
            raise
        m.kv_tokens = list(image.tokens)
        draft, draft_n = image.draft, int(image.meta.get("draft_n", 0) or 0)
        if draft is not None and image.meta.get("draft_digest") != m.props.draft_digest:
            draft = None  # made by another draft model (or with speculation off here)
        await m.adopt_draft(draft, draft_n, f"file {file}")
        m.lineage = (genes, str(image.meta.get("scope", "") or ""))
        m.mind = mind_named(file[: -len(MIND_FILE_SUFFIX)] if file.endswith(MIND_FILE_SUFFIX) else file)
        m.ckpt.adopt([Divergence(lcp=a, end=b) for a, b in image.divergences], image.prompt_end, len(image.tokens))
        await m.adopt_checkpoints([SlotCheckpoint(pos=c.pos, data=bytearray(c.data)) for c in image.checkpoints])
        await m.footprint_changed()
        await m.tell_cells()
        self._persisted_sig = (file, version, *m.kv_sig())
        t_ms = (time.perf_counter() - t0) * 1e3
        log.info("slot.restored", slot=m.id, file=file, n_tokens=len(m.kv_tokens), t_ms=round(t_ms, 3),
                 draft="warm" if m.draft_n else "cold")
        return {"slot": m.id, "file": file, "n_bytes": st.n_bytes, "n_tokens": len(m.kv_tokens),
                "n_checkpoints": len(m.checkpoints), "t_ms": t_ms, "copy_ms": st.t_ms, **m.draft_info()}


def page_image(props: J.ModelProps, state: Any, ckpts: list[Any], tokens: list[int],
               genes: tuple[tuple[int, float], ...], divergences: list[Divergence] | None = None,
               prompt_end: int = 0, *, draft: Any = None, draft_n: int = 0, base: Any = None,
               n_base: int = 0, scope: str = "", gene_digests: tuple[str, ...] = (), kept: bool = False) -> PageImage:
    """A slot or a page as one page-file generation (the state bytes are not copied). A draft
    state goes to the `.dft` sidecar, with its token count and draft model in the meta; the
    state of a base a page stands on goes into the main file with it (self-contained). A
    client's file by name is marked `kept` (storage/pagefile.py KEPT_META)."""
    meta = model_fingerprint(props)
    if kept:
        meta[KEPT_META] = True
    if draft is not None and draft_n > 0:
        meta.update(draft_n=draft_n, draft_digest=props.draft_digest, draft_model=props.draft_desc)
    else:
        draft = None
    return PageImage(
        tokens=list(tokens), state=state,
        checkpoints=[StoredCheckpoint(pos=c.pos, data=c.data) for c in ckpts],
        genes=[StoredGene(path="", scale=sc, id=g, digest=d)
               for (g, sc), d in zip(genes, tuple(gene_digests) + ("",) * (len(genes) - len(gene_digests)))],
        meta={**meta, **state_layout(props), **({"scope": scope} if scope else {})}, draft=draft,
        divergences=[(d.lcp, d.end) for d in divergences or ()], prompt_end=prompt_end,
        base=base, n_base=n_base if base is not None else 0,
    )


def model_fingerprint(props: J.ModelProps) -> dict[str, Any]:
    """What a page file records about its model: the description and shapes, and the digest
    of its weights (actord/engine/weights.py), without which two models of one architecture
    and shape (two fine-tunes, two seeds) would take each other's pages and decode garbage."""
    return {"model": props.desc, "n_vocab": props.n_vocab, "n_ctx_train": props.n_ctx_train, "n_swa": props.n_swa,
            "weights": props.weights_digest}


def check_fingerprint(image: PageImage, props: J.ModelProps, file: str) -> None:
    """Refuse a file from another model (ForeignPage) before anything changes. A file with
    no weights digest (written before actord recorded one) cannot prove its model: refused."""
    want = model_fingerprint(props)
    got = {k: image.meta.get(k) for k in want}
    if got != want:
        differs = sorted(k for k in want if got[k] != want[k])
        raise ForeignPage(f"{file} was saved from another model ({', '.join(differs)} differ)", file=file,
                          saved=got, model=want, differs=differs)
    check_state_layout(image, props, file)


def state_layout(props: J.ModelProps) -> dict[str, Any]:
    """What a state's bytes need of the context they go into, beyond the model: the V cache's
    layout and the cache's element types. libllama refuses a state whose V transposition
    differs ("incompatible V transposition"); it is transposed only where flash attention is
    off outright. A state's cells are in the types it was taken with (--cache-type-k / -v)."""
    return {"v_trans": props.device.v_trans, "cache_type_k": props.device.cache_type_k,
            "cache_type_v": props.device.cache_type_v}


def check_state_layout(image: PageImage, props: J.ModelProps, file: str) -> None:
    # A file from before the cache types were recorded was written in f16, the only type there was.
    saved_types = (image.meta.get("cache_type_k", "f16"), image.meta.get("cache_type_v", "f16"))
    types = (props.device.cache_type_k, props.device.cache_type_v)
    if saved_types != types:
        raise PageDoesNotFit(
            f"{file} holds a state whose KV cache is {saved_types[0]}/{saved_types[1]} (K/V), and this daemon's is "
            f"{types[0]}/{types[1]}: restore it under --cache-type-k {saved_types[0]} --cache-type-v {saved_types[1]}",
            file=file, saved_cache_types=list(saved_types), cache_types=list(types))
    # A file from before the layout was recorded was written with flash attention "auto",
    # the only setting there was: V not transposed.
    saved = bool(image.meta.get("v_trans", False))
    if saved != props.device.v_trans:
        def fa(v: bool) -> str:
            return "off" if v else "auto or on"

        raise PageDoesNotFit(
            f"{file} holds a state taken with flash attention {fa(saved)}, and this daemon runs with "
            f"--flash-attn {props.device.flash_attn}: its V cache layout differs; restore it under "
            f"--flash-attn {'off' if saved else 'auto'}",
            file=file, saved_v_trans=saved, v_trans=props.device.v_trans)
