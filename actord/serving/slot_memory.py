"""What a slot's sequence holds, and how it is cut back, erased and snapshotted.

`SlotMemory` is the one owner of a slot's sequence between requests (serving/slot.py holds
one and gives it to its share and page-move parts): `kv_tokens` is exactly the tokens whose
KV sit in the sequence, under `lineage` (the genes and tenant scope they were computed
under); `cut_to` makes it hold the longest usable prefix of a new prompt (cutting the memory
back where it can be cut, else resuming from the newest context checkpoint at or below the
divergence, else from zero); the checkpoint list is kept in step with the CheckpointBudget's
mirror; KV cells and the device footprint are told to the scheduler and the residency
whenever the sequence changes outside a step; and every change is published to the
sequence index (serving/kv_index.py), which the other slots ask instead of reading
this object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from actord.serving.checkpoint_budget import AdmitCheckpoint, AdmitCheckpoints, Decision, SlotCheckpoints
from actord.serving.gene_residency import SlotFootprint
from actord.serving.messages import Cells
from actord.serving.kv_index import Held
from actord.vocabulary.kv_identity import Lineage
from actord.engine import jobs as J
from actord.vocabulary.errors import ActordError
from actord.vocabulary.log import get
from actord.policy.checkpoint_records import CheckpointSize, SlotCheckpoint
from actord.vocabulary.metrics import Metrics


if TYPE_CHECKING:
    from actord.serving.checkpoint_plan import CheckpointPlan
    from actord.serving.slot_peers import SlotPeers

log = get("actord.slot")


class SlotMemory:
    """One slot's sequence (see the module docstring). Its ports: the engine (jobs on this
    sequence only), the scheduler and the residency (told), the checkpoint budget (asked and
    told) and the sequence index (published to)."""

    def __init__(self, slot_id: int, engine: Any, props: J.ModelProps, metrics: Metrics, ckpt: CheckpointPlan,
                 peers: SlotPeers, *, track_footprint: bool, share_prefixes: bool,
                 swa_window_pages: bool = True) -> None:
        self.id = slot_id
        self.seq = slot_id
        self.engine = engine
        self.props = props
        self.metrics = metrics
        self.ckpt = ckpt  # the mind's divergence history and the checkpoint policy
        self.peers = peers
        self.track_footprint = track_footprint
        self.share_prefixes = share_prefixes  # Config.prefix_sharing
        self.swa_window_pages = swa_window_pages  # Config.page_swa_window
        self._kv: list[int] = []
        self.kv_epoch = 0
        self._genes: tuple[tuple[int, float], ...] = ()
        self._scope = ""
        # Gene ids -> content digests, as told when the genes were granted or a state came in:
        # an id never names another content (engine/genes.py), so a digest stays true after
        # its gene is unloaded.
        self.digests: dict[int, str] = {}
        self._checkpoints: list[SlotCheckpoint] = []
        self.mind: str | None = None
        self.resume_raw_lcp: int | None = None
        self.draft_n = 0  # kv_tokens[:draft_n] are in the draft context's sequence (speculation)
        self._share_note: tuple[int, int, int] | None = None
        self.cells_batched = False  # inside a page move that tells its cells once, at its end
        self.cells_dirty = False
        self.owe_cells = False  # an eviction was refused as busy: tell the cells when the request ends
        self.cells_seq = 0
        # The slot's activity, as it last said (`activity`): what "steady" means to a share.
        self._quiet = True
        self._running: list[int] | None = None
        self._publish()

    # -- what it holds, published on every change ---------------------------------------

    def _publish(self) -> None:
        self.peers.index.publish(Held(slot=self.id, seq=self.seq, tokens=self._kv, lineage=(self._genes, self._scope),
                                epoch=self.kv_epoch, quiet=self._quiet, steady=self._quiet or self._running is not None,
                                running=self._running, checkpoints=tuple(self._checkpoints)))

    def activity(self, *, quiet: bool, running: list[int] | None) -> None:
        """The slot says whether it is quiet (no request, no handler at work) and the prompt
        of the request it has enrolled (None: none): its cells hold steady in either case."""
        if (quiet, running) != (self._quiet, self._running):
            self._quiet, self._running = quiet, running
            self._publish()

    @property
    def kv_tokens(self) -> list[int]:
        return self._kv

    @kv_tokens.setter
    def kv_tokens(self, tokens: list[int]) -> None:
        old = self._kv
        if len(tokens) < len(old) or tokens[:len(old)] != old:
            self.kv_epoch += 1  # a cell lost or replaced: shares of this sequence end here
        self._kv = tokens
        self._publish()

    @property
    def genes(self) -> tuple[tuple[int, float], ...]:
        return self._genes

    @property
    def scope(self) -> str:
        return self._scope

    @property
    def lineage(self) -> Lineage:
        """The non-token part of its cells' key (vocabulary/kv_identity.py): what a reuse compares."""
        return self._genes, self._scope

    @lineage.setter
    def lineage(self, lineage: Lineage) -> None:
        self._genes, self._scope = lineage
        self._publish()

    def learn_digests(self, digests: dict[int, str]) -> None:
        """Gene ids' content digests, kept for the genes in use: those of its cells and of the grant."""
        got = {gid: d for gid, d in digests.items() if d}
        if got:
            held = {gid for gid, _ in self._genes}
            self.digests = {gid: d for gid, d in {**self.digests, **got}.items() if gid in held or gid in got}

    @property
    def checkpoints(self) -> list[SlotCheckpoint]:
        return self._checkpoints

    def _keep(self, ckpts: list[SlotCheckpoint]) -> None:
        """The checkpoint list is now `ckpts` (a new list: a published record holds the old)."""
        self._checkpoints = ckpts
        self._publish()

    def shares_cells(self) -> bool:
        """Attention memory with every cell kept (a full cache). Not a windowed SWA cache:
        libllama reuses a cell the window has passed only while one sequence holds it, so
        shared cells would stay pinned in its few window-sized cells until a decode finds
        none free (seen: KvCacheFull on the tiny SWA model); those start from checkpoints."""
        p = self.props
        return self.share_prefixes and not (p.recurrent or p.hybrid or p.needs_checkpoints) and bool(p.kv_cells)

    def stands_on_bases(self) -> bool:
        """Pages of this model can be split into a base and a rest: where cells can be shared
        (`shares_cells`: no window whose old cells are gone and no recurrent state), and no
        draft sequence, which is not split."""
        return self.shares_cells() and not self.props.spec

    @property
    def drafting(self) -> bool:
        """This system runs a draft context (speculative decoding)."""
        return bool(self.props.spec)

    def kv_sig(self) -> tuple[Any, ...]:
        # The lineage too: the same tokens under other genes or another scope are another state.
        return (self.mind, self._genes, self._scope, len(self._kv), hash(tuple(self._kv)))

    # -- shares and cells ----------------------------------------------------------------

    def note_share(self, src: int, src_epoch: int, n: int, source: str) -> None:
        """This sequence's first n cells were just taken from slot `src`'s, as they were in
        its epoch `src_epoch`: the next cells tell says so, and the scheduler counts them once."""
        self._share_note = (src, src_epoch, n)
        self.metrics.prefix_hit_tokens_total.labels(source=source).inc(n)

    def _take_share_note(self) -> dict[str, int]:
        note, self._share_note = self._share_note, None
        if note is None:
            return {}
        return {"shared_from": note[0], "shared_epoch": note[1], "shared": note[2]}

    async def tell_cells(self, release: int = 0) -> None:
        """The scheduler charges KV cells per slot; tell it after a change outside a step.
        Inside a page move that tells once at its end (`cells_batched`), only that end's
        count is sent, with the move's room token (`release`)."""
        if self.cells_batched and not release:
            self.cells_dirty = True
            return
        self.cells_dirty = False
        self.owe_cells = False
        self.cells_seq += 1
        await self.peers.scheduler.tell(Cells(slot=self.id, n=len(self._kv), seq=self.cells_seq, release=release,
                                        epoch=self.kv_epoch, **self._take_share_note()))

    async def erase(self) -> None:
        await self.engine.run(J.SeqRm(seq=self.seq, p0=-1, p1=-1))
        await self.hold_only(())

    async def hold_only(self, tokens: Any) -> None:
        """The sequence now holds exactly `tokens` and nothing else of before: no draft (the
        draft context catches up from zero), no mind's name, no checkpoints; told upward."""
        self.kv_tokens = list(tokens)
        self.draft_n = 0
        self.resume_raw_lcp = None
        self.mind = None
        self.ckpt.reset()
        await self.sync_budget([])
        self._keep([])
        await self.footprint_changed()
        await self.tell_cells()

    def forget(self) -> None:
        """What a page-out or a restore leaves before the state is in: nothing held, no mind."""
        self.kv_tokens, self.resume_raw_lcp, self.mind, self.draft_n = [], None, None, 0

    async def cut_back_after_failure(self) -> None:
        """A failed step may have left cells past what we know: cut back to kv_tokens. Memory
        that refuses the cut (recurrent or hybrid after a decode that failed part-way) is
        erased, so the token list never claims a state the sequence does not hold."""
        try:
            ok = await self.engine.run(J.SeqRm(seq=self.seq, p0=len(self._kv), p1=-1))
        except ActordError:
            ok = False
        if not ok:
            log.info("slot.cut_back_refused", slot=self.id, n_tokens=len(self._kv))
            await self.erase()

    # -- the device footprint ------------------------------------------------------------

    async def device_bytes(self) -> int:
        """What the sequence holds on the device: its state (the KV cells of its attention
        layers plus, on recurrent/hybrid memory, its fixed recurrent state) and, when libllama
        keeps rollback snapshots (n_rs_seq > 0), n_rs_seq more copies of the recurrent state."""
        if not self._kv:
            return 0
        n = await self.engine.run(J.StateSize(seq=self.seq))
        return n + self.props.n_rs_seq * self.props.recurrent_state_bytes

    async def footprint_changed(self) -> None:
        if self.track_footprint:
            await self.peers.residency.tell(SlotFootprint(slot=self.id, n_bytes=await self.device_bytes()))

    # -- checkpoints ----------------------------------------------------------------------

    def selection_lcp(self) -> int | None:
        """The raw lcp the original C++ server's selection may use; 'oldest' ignores it on purpose."""
        return self.resume_raw_lcp if self.ckpt.policy == "divergence" else None

    async def page_checkpoints(self) -> list[SlotCheckpoint]:
        """What a page or file keeps: the policy's choice (placement: the best subset for
        the mind's forecast; divergence/oldest: the original C++ server's count rule); on a
        full sliding-window cache, the window where the next turn will likely cut back to."""
        if self.windowed():
            return await self._window_checkpoint() if self.swa_window_pages else []
        idx = self.ckpt.keep_indices(self._checkpoints, self.resume_raw_lcp, len(self._kv))
        return [self._checkpoints[i] for i in idx]

    def windowed(self) -> bool:
        """A full sliding-window cache: in place it is cut back anywhere (no checkpoints), but
        a page or file holds only its last window of those layers (libllama writes a state
        without its SWA-masked cells), so once moved, a cut needs the window at that point."""
        p = self.props
        return p.n_swa > 0 and not (p.needs_checkpoints or p.recurrent or p.hybrid)

    async def _window_checkpoint(self) -> list[SlotCheckpoint]:
        """The window at the last prompt's end less one: where a regenerate, or a reply the
        client renders otherwise, cuts back to (each re-prefilled
        the whole history after a page-in: measured on Gemma 3 270M, 1,501 of 1,501 tokens
        for a regenerate). None where the sequence fits in one window (a page holds all of
        it); one a page or file brought and no turn used yet is kept as it is."""
        n, pos = len(self._kv), self.ckpt.prompt_end - 1
        held = list(self._checkpoints)
        if n <= self.props.n_swa or not 0 < pos < n or any(c.pos == pos for c in held):
            return held
        st = await self.engine.run(J.StateGet(seq=self.seq, partial=True, p0=0, p1=pos))
        if not st.n_bytes:  # moved in since, or other sequences took cells of it: its window there is gone
            return held
        return [SlotCheckpoint(pos=pos, data=st.data)]

    def used_moved_checkpoints(self) -> None:
        """A turn began on a moved-in sequence of a full sliding-window cache: what it cut
        back to is in memory now, and the checkpoints the move brought (held outside the
        budget, charged with their page while paged) go."""
        if self.windowed() and self._checkpoints:
            self._keep([])

    async def sync_budget(self, ckpts: list[SlotCheckpoint]) -> None:
        if not self.props.needs_checkpoints:
            return  # a model that never checkpoints: the budget holds nothing of ours to mirror
        history, n, population = self.ckpt.view(len(self._kv))
        await self.peers.ckpt_budget.tell(SlotCheckpoints(
            slot=self.id, metas=[CheckpointSize(pos=c.pos, n_bytes=c.n_bytes) for c in ckpts],
            raw_lcp=self.selection_lcp(), history=history, n_tokens=n, population=population,
        ))

    async def drop_checkpoint(self, pos: int) -> None:
        self._keep([c for c in self._checkpoints if c.pos != pos])
        # Re-send the list: a mirror update of ours may have crossed this drop.
        await self.sync_budget(self._checkpoints)

    async def on_checkpoint(self, pos: int, data: bytearray) -> None:
        self.ckpt.ckpt_bytes = len(data)
        history, n, population = self.ckpt.view(len(self._kv))
        d: Decision = await self.peers.ckpt_budget.ask(AdmitCheckpoint(
            slot=self.id, pos=pos, n_bytes=len(data), raw_lcp=self.selection_lcp(), history=history, n_tokens=n,
            population=population,
        ))
        if d.drop_own:
            self._keep([c for c in self._checkpoints if c.pos not in d.drop_own])
        if d.admit:
            self._keep([*self._checkpoints, SlotCheckpoint(pos=pos, data=data)])

    async def adopt_checkpoints(self, ckpts: list[SlotCheckpoint]) -> None:
        """Checkpoints arriving with a page or file enter the budget one by one, oldest first,
        in one ask (a page_in's actor hops, not one per checkpoint). A full sliding-window
        cache's are kept outside the budget until the next turn begins (`used_moved_checkpoints`)."""
        self._keep([])
        await self.sync_budget([])
        if not ckpts:
            return
        if self.windowed():
            self._keep(list(ckpts))
            return
        items = []
        for ck in ckpts:
            self.ckpt.ckpt_bytes = len(ck.data)
            history, n, population = self.ckpt.view(len(self._kv))
            items.append(AdmitCheckpoint(slot=self.id, pos=ck.pos, n_bytes=len(ck.data), raw_lcp=self.selection_lcp(),
                                         history=history, n_tokens=n, population=population))
        decisions: list[Decision] = await self.peers.ckpt_budget.ask(AdmitCheckpoints(items=items))
        kept = list(self._checkpoints)
        for ck, d in zip(ckpts, decisions):
            if d.drop_own:
                kept = [c for c in kept if c.pos not in d.drop_own]
            if d.admit:
                kept.append(ck)
        self._keep(kept)

    async def release_checkpoints(self) -> None:
        """The list empties (a page-out, a restore, a failed page-in): the budget hears first."""
        await self.sync_budget([])
        self._keep([])

    def checkpoint_positions(self, pos0: int, n_prompt: int, shared_at: int = 0) -> list[int]:
        """Plan where to snapshot the prompt, decoded from pos0 (its divergence was noted
        by `cut_to`): as few pieces as the plan needs, and `shared_at`, where the prompt
        parts from what other minds hold (serving/prefix_share.py: the next mind that opens
        alike starts from there)."""
        self.ckpt.started(n_prompt)
        if not self.props.needs_checkpoints:
            return []
        have = [c.pos for c in self._checkpoints]
        out = self.ckpt.positions(pos0, n_prompt, have)
        if pos0 < shared_at < n_prompt and shared_at not in out and shared_at not in have:
            out = sorted([*out, shared_at])
        if out:
            log.debug("slot.checkpoint_plan", slot=self.id, pos0=pos0, n_prompt=n_prompt, at=out,
                      policy=self.ckpt.policy, history=len(self.ckpt.history))
        return out

    # -- a resume -------------------------------------------------------------------------

    async def cut_to(self, n: int) -> tuple[int, bool]:
        """Make the sequence hold exactly kv_tokens[:m] for the largest usable m <= n.

        Returns (m, resumed_from_checkpoint). Memory that can be cut back at n is cut there.
        Memory that cannot (SWA without a full cache whose window has moved past n,
        recurrent, hybrid) resumes from the newest checkpoint at or below n, else from zero.
        Checkpoints past the resume point are invalidated.
        """
        held = len(self._kv)
        m, from_ckpt = await self._cut(n)
        if any(c.pos > m for c in self._checkpoints):
            self._keep([c for c in self._checkpoints if c.pos <= m])
        self.ckpt.observe(self.resume_raw_lcp or 0)
        await self.sync_budget(self._checkpoints)
        if (m < held and not from_ckpt and self.props.needs_checkpoints
                and self.ckpt.wants_at_resume(m, [c.pos for c in self._checkpoints])):
            # The memory served this divergence; the next one is likely here again.
            st = await self.engine.run(J.StateGet(seq=self.seq, partial=True))
            await self.on_checkpoint(m, st.data)
        return m, from_ckpt

    async def _cut(self, n: int) -> tuple[int, bool]:
        if n >= len(self._kv):
            return len(self._kv), False
        p = self.props
        # Even a full SWA cache is checked, in the cut itself (SeqRm.window): libllama 0.3.36
        # writes a sequence's state without its SWA-masked cells, so after a page-in or
        # restore the SWA layers hold only the last window; and it gives such cells of an
        # idle sequence to other sequences' tokens at any step (state_copy.py `window_whole`).
        if not (p.recurrent or p.hybrid):
            if await self.engine.run(J.SeqRm(seq=self.seq, p0=n, p1=-1, window=p.n_swa > 0)):
                self.kv_tokens = self._kv[:n]
                return n, False
        for ck in reversed(self._checkpoints):
            if ck.pos > n:
                continue
            try:
                await self.engine.run(J.StateSet(seq=self.seq, data=ck.data, partial=True))
                ok = await self.engine.run(J.SeqRm(seq=self.seq, p0=ck.pos, p1=-1))
            except ActordError as e:
                log.warning("slot.checkpoint_restore_failed", slot=self.id, pos=ck.pos, error=e.to_dict())
                break
            if ok:
                self.kv_tokens = self._kv[:ck.pos]
                self.metrics.ctx_checkpoint_restores_total.inc()
                log.info("slot.checkpoint_restored", slot=self.id, pos=ck.pos, raw_lcp=self.resume_raw_lcp)
                return ck.pos, True
            break
        await self.engine.run(J.SeqRm(seq=self.seq, p0=-1, p1=-1))
        self.kv_tokens = []
        return 0, False

    # -- the draft context's sequence (speculation) ---------------------------------------

    def draft_info(self) -> dict[str, Any]:
        """What a page-in or restore answers about the draft: the tokens its state holds
        ("warm") or none ("cold": it catches up at the next request)."""
        if not self.drafting:
            return {}
        return {"draft": "warm" if self.draft_n else "cold", "draft_n_tokens": self.draft_n}

    async def adopt_draft(self, data: Any, n: int, source: str) -> None:
        """The draft context's sequence takes a page's or file's draft state; without one (or
        one libllama refuses) the draft starts cold, which is logged, never an error."""
        self.draft_n = 0
        if not self.drafting:
            return
        if data is not None and 0 < n <= len(self._kv):
            st = await self.engine.run(J.StateSet(seq=self.seq, data=data, draft=True))
            if st.n_bytes:
                self.draft_n = n
                return
            why = "the draft context refused the state"
        else:
            why = "no draft state" if data is None else f"draft state of {n} tokens does not fit {len(self._kv)}"
            await self.engine.run(J.SeqRm(seq=self.seq, p0=-1, p1=-1, draft=True))
        log.info("slot.draft_cold", slot=self.id, source=source, reason=why, n_tokens=len(self._kv))
