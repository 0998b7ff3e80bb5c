"""A Slot actor: one llama sequence id, the owner of its memory between turns.

The slot owns `kv_tokens` (exactly the tokens whose KV sit in its sequence, in order),
`resume_raw_lcp` (the raw longest common prefix its current request found, before any
fallback; reset per request, on page-in/restore and on erase), its context checkpoints and
its gene lease. It never touches libllama: it sends jobs to the engine.

A request's life here: tokenize and check the prompt, acquire its genes (a tell to the
residency, answered by `GenesGranted`), plan the resume (`cut_to`: the longest usable
prefix) and where to snapshot, then hand the request to the Scheduler (`Enroll`, with the
client's reply channel and stream sink in the envelope). From then on the per-token path
is the scheduler's pure core: the slot hears nothing per token, only `CheckpointTaken` when
the engine snapshotted its sequence and, once, `Ended` with the tokens its KV now holds.
The scheduler answers the client itself.

A request for a busy slot is deferred (kept in order, counted) and started when the slot is
idle again; so are page and file operations, which need a quiet sequence.

Its place in the ask order (serving/kernel/): below the placer and the scheduler, above the
page store, the checkpoint budget and the gene residency. A slot waiting for its genes is
busy: it defers page moves and requests, refuses evictions and handles a cancel at once.

The slot holds three parts, each an object with its own state: its memory
(`slot_memory.py`: the sequence, its cut-backs, checkpoints and cells, published to the
sequence index), its prefix share (`prefix_share.py`: a start from what other slots, bases
and base files hold, asked of the index, never of another slot) and its page moves
(`slot_pages.py` with `page_bases.py`: page out/in, save/restore). The slot keeps the
request's lifecycle, evictions and forks, which use more than one part.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import anyio

from actord.serving.kernel import Actor, Dispatcher, Envelope, Reply
from actord.serving.checkpoint_plan import CheckpointPlan
from actord.serving.gene_residency import Acquire as GeneAcquire, EvictDone, Finish as GeneFinish
from actord.serving.messages import (
    Abort, CancelRequest, CheckpointTaken, Complete, DropCheckpoint, Ended, Enroll, Erase, Evict, Fork, FromBase,
    GenesGranted, GenesRefused, Info, PageInSlot, PageOutSlot, RestoreSlot, SaveSlot, SlotInbox,
)
from actord.serving.placer import Misplaced, SlotState
from actord.serving.page_bases import PageBases
from actord.policy.prefix_index import common_prefix
from actord.policy.yielding import yieldable
from actord.serving.prefix_share import PrefixShare
from actord.serving.kv_index import Held
from actord.serving.slot_peers import SlotPeers
from actord.serving.slot_memory import SlotMemory
from actord.serving.slot_pages import SlotPages, check_fingerprint, model_fingerprint, page_image
from actord.vocabulary.types import CompletionRequest, CompletionResult, GeneRef, SlotInfo, Timings
from actord.engine import jobs as J
from actord.vocabulary.errors import (
    ActordError, Cancelled, InvalidParams, PageRamExceeded, PromptTooLong, SlotBusy, SlotEmpty, from_dict,
)
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics

log = get("actord.slot")

__all__ = ["Slot", "gene_set", "page_image", "model_fingerprint", "check_fingerprint"]


@dataclass
class _Active:
    rid: int
    req: CompletionRequest
    prompt: list[int]
    reply: Reply | None  # until enrolled: then the scheduler answers
    stream: Callable[[Any], Any] | None
    t_start: float
    cancelled: bool = False
    genes: tuple[tuple[int, float], ...] = ()
    ticket: int = 0  # the gene acquisition this request waits for (0: none)
    running: bool = False  # past gene acquisition
    continued: bool = False  # the rest of a request that gave its slot up (Complete.yielded)
    engine_s: float = 0.0  # Complete.engine_s
    enrolled: bool = False  # handed to the scheduler: it ends with `Ended`


def sampling_params(req: CompletionRequest, seed: int, n_ctx: int) -> J.SamplingParams:
    """A request's sampler chain (its `grammar` is GBNF by now: check() converts a schema)."""
    last_n = n_ctx if req.repeat_last_n < 0 else req.repeat_last_n
    return J.SamplingParams(
        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed, grammar=req.grammar,
        logit_bias=req.bias_pairs(), penalty_last_n=last_n, repeat_penalty=req.repeat_penalty,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty, min_p=req.min_p,
        top_logprobs=req.top_logprobs if req.logprobs else -1, post_sampling=req.post_sampling_probs,
        grammar_triggers=tuple((t.text, t.at_start) for t in req.grammar_triggers), preserve=tuple(req.preserve),
        end_on_eog=not req.ignore_eos, end_tokens=tuple(req.stop_tokens),
    )


class Slot(Actor[SlotInbox]):
    """One slot: its requests' lifecycle and its page and file moves, over three parts it
    holds: its memory (the sequence, the one owner of what it holds), its prefix share (a
    start from what others hold) and its page moves (with their page-base part)."""

    rank = 30

    def __init__(
        self, dispatcher: Dispatcher, slot_id: int, engine: Any, props: J.ModelProps, metrics: Metrics,
        peers: SlotPeers, ckpt: CheckpointPlan, *, default_seed: int = 0, capacity: int = 64,
        track_footprint: bool = False, default_genes: Sequence[int] = (), share_prefixes: bool = True,
        swa_window_pages: bool = True,
    ) -> None:
        super().__init__(dispatcher, f"slot{slot_id}", capacity)
        self.id = slot_id
        self.seq = slot_id
        self.engine = engine
        self.props = props
        self.metrics = metrics
        self.default_seed = default_seed
        self.peers = peers  # the placer is told SlotState when what it places by changes
        self.memory = SlotMemory(slot_id, engine, props, metrics, ckpt, peers, track_footprint=track_footprint,
                                 share_prefixes=share_prefixes, swa_window_pages=swa_window_pages)
        self.share = PrefixShare(self.memory, peers)
        self.moves = SlotPages(self.memory, PageBases(self.memory, peers), peers)
        self.default_genes = default_genes  # the system's, loaded at start (a shared list)
        self._acquired = False  # a gene lease is held: `finish_genes` lets it go
        self._active: _Active | None = None
        self.deferred: collections.deque[Envelope[SlotInbox]] = collections.deque()
        self._tickets = 0
        self._handling = 0  # handlers at work (nested: deferred messages run inside one)
        # What the placer knows of this slot (busy, mind): told when it changes, except where
        # the placer made the change itself (its forwards, its page-ins' answers).
        self._told: tuple[bool, str | None] = (False, None)
        self._placed = 0  # the placer's forwards this slot took (a SlotState says how many)

    # -- what its memory holds, read by the system's introspection and the simulation ------

    @property
    def kv_tokens(self) -> list[int]:
        return self.memory.kv_tokens

    @property
    def mind(self) -> str | None:
        return self.memory.mind

    @property
    def checkpoints(self) -> list[Any]:
        return self.memory.checkpoints

    @property
    def genes(self) -> tuple[tuple[int, float], ...]:
        return self.memory.genes

    @property
    def lineage(self) -> tuple[tuple[tuple[int, float], ...], str]:
        return self.memory.lineage

    @property
    def resume_raw_lcp(self) -> int | None:
        return self.memory.resume_raw_lcp

    @property
    def kv_epoch(self) -> int:
        return self.memory.kv_epoch

    @property
    def ckpt(self) -> CheckpointPlan:
        return self.memory.ckpt

    # -- its activity, which says whether its cells hold steady (serving/kv_index.py) --

    def _say_activity(self) -> None:
        a = self._active
        self.memory.activity(quiet=a is None and self._handling == 0,
                             running=a.prompt if a is not None and a.enrolled else None)

    @property
    def active(self) -> _Active | None:
        return self._active

    @active.setter
    def active(self, a: _Active | None) -> None:
        self._active = a
        self._say_activity()

    @property
    def handling(self) -> int:
        return self._handling

    @handling.setter
    def handling(self, n: int) -> None:
        self._handling = n
        self._say_activity()

    # -- dispatch ----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.active is not None

    async def handle(self, msg: SlotInbox, env: Envelope[SlotInbox]) -> None:
        self.handling += 1
        try:
            if isinstance(msg, Complete) and msg.req.mind is not None:
                self._placed += 1  # the placer counts it busy until a state says it is done
                self._told = (True, msg.req.mind)
            await self._handle(msg, env)
        finally:
            self.handling -= 1
            if self.handling == 0:
                self._tell_state()

    def _tell_state(self) -> None:
        """Tell the placer what changed in (busy, mind) since it last knew: the placer's table
        is the truth it places by (no Info ask per placement)."""
        now = (self.busy or bool(self.deferred), self.mind)
        if now == self._told:
            return
        self._told = now
        try:  # a placement may be parked for want of an idle slot (serving/placer.py)
            self.peers.placer.tell_nowait(SlotState(slot=self.id, busy=now[0], mind=now[1], placed=self._placed))
        except ActordError:
            pass  # the placer is stopping or failed

    async def _handle(self, msg: SlotInbox, env: Envelope[SlotInbox]) -> None:
        match msg:
            case Ended():
                try:
                    await self._on_ended(msg)
                finally:  # the scheduler's answer to the client, handed on once
                    if env.reply is not None:
                        if isinstance(env.answer, BaseException):
                            env.reply.fail(env.answer)
                        else:
                            env.reply.send(env.answer)
                if self.props.device.backend_sampling:
                    # An attached chain runs in every decode's graph, its sequence in the
                    # batch or not (engine/backend_sampling.py): it goes with its request,
                    # once the answer is out (behind the steps already queued).
                    try:
                        await self.engine.run(J.FreeSampler(seq=self.seq))
                    except ActordError as e:
                        log.warning("slot.free_sampler_failed", slot=self.id, error=e.to_dict())
                await self._drain_deferred()
            case CheckpointTaken(rid=rid, pos=pos, data=data):
                a = self.active
                if a is not None and a.rid == rid:
                    await self.memory.on_checkpoint(pos, data)
            case Info(scope=scope):
                env.reply.send(self.info(scope))  # type: ignore[union-attr]
            case CancelRequest(rid=rid):
                a = self.active
                if a is not None and a.rid == rid:
                    a.cancelled = True
                    if a.enrolled:
                        self.peers.scheduler.tell_nowait(Abort(rid=rid))
                    elif not a.running:  # still waiting for genes: end it now
                        await self._answer_here("cancelled")
                        await self._drain_deferred()
                self._drop_deferred(rid)
            case DropCheckpoint(pos=pos):
                await self.memory.drop_checkpoint(pos)
            case GenesGranted(ticket=ticket, digests=digests):
                self.memory.learn_digests(digests)
                await self._on_genes_granted(ticket)
                if self.active is None:
                    await self._drain_deferred()
            case GenesRefused(ticket=ticket):
                a = self.active
                if a is not None and a.ticket == ticket and not a.running:
                    self._acquired = False  # the residency already let go of this acquisition
                    await self._abort(from_dict({"type": msg.error_type, "message": msg.message}))
                    await self._drain_deferred()
            case Evict(reason=reason):
                await self._on_evict(reason, env)
            case Complete(fresh=True) if self.busy:
                # A fresh start moved nothing here: it need not wait behind a request the
                # placer did not place (a slot-addressed one that came together with it).
                self._placed -= 1  # not taken: the placer takes its forward back
                self.peers.placer.put_nowait(Envelope(Misplaced(slot=self.id, complete=msg, busy=True), env.reply, env.stream))
            case _ if self.busy:
                self.deferred.append(env)
                self.metrics.requests_deferred_total.inc()
                log.debug("slot.deferred", slot=self.id, msg=type(msg).__name__, queued=len(self.deferred))
            case Complete(resident=True) if self.mind != msg.req.mind:
                # Placed here as the mind's slot, but she left meanwhile (evicted, moved):
                # the placer places her again (it has heard of the move by now).
                self._placed -= 1  # not taken: the placer takes its forward back
                self.peers.placer.put_nowait(Envelope(Misplaced(slot=self.id, complete=msg), env.reply, env.stream))
            case Complete():
                await self._start(msg, env)
            case Fork(src=src, tokens=tokens):
                if self.peers.index.of(src) is None:
                    raise InvalidParams(f"no slot {src} to fork from", slot=src)
                env.reply.send(await self.fork_from(src, tokens))  # type: ignore[union-attr]
            case Erase(scope=scope):
                if not self._foreign(scope):
                    await self.memory.erase()
                env.reply.send({"slot": self.id, "erased": True})  # type: ignore[union-attr]
            case PageOutSlot() | PageInSlot() | SaveSlot() | RestoreSlot():
                await self._handle_page_op(msg, env)
            case FromBase():
                lineage = (self.gene_set(msg.req), msg.req.kv_scope())
                env.reply.send(await self.share.from_base(msg.req.prompt, lineage, msg.room))  # type: ignore[union-attr]
            case _:
                raise InvalidParams(f"slot cannot handle {type(msg).__name__}")

    async def _drain_deferred(self) -> None:
        while self.deferred and not self.busy:
            env = self.deferred.popleft()
            try:
                await self.handle(env.msg, env)
            except ActordError as e:
                if env.reply is not None:
                    env.reply.fail(e)

    def _drop_deferred(self, rid: int) -> None:
        for env in list(self.deferred):
            if isinstance(env.msg, Complete) and env.msg.rid == rid:
                self.deferred.remove(env)
                self.metrics.requests_total.labels(outcome="cancelled").inc()
                if env.reply is not None:
                    env.reply.fail(Cancelled("request cancelled before it started", rid=rid))

    def deferred_count(self) -> int:
        return len(self.deferred)

    def on_crash(self, error: BaseException) -> None:
        if self.active is not None and self.active.reply is not None:
            self.active.reply.fail(error)
        for env in self.deferred:
            if env.reply is not None:
                env.reply.fail(error)
        self.deferred.clear()
        # An enrolled request is the scheduler's to answer: the system tells it `SlotLost`.

    def _foreign(self, scope: str | None) -> bool:
        """Whether the sequence held is another scope's than a client of `scope` asking."""
        return scope is not None and bool(self.memory.kv_tokens) and self.memory.scope != scope

    def info(self, scope: str | None = None) -> SlotInfo:
        if self._foreign(scope):
            return SlotInfo(id=self.id, state="processing" if self.busy else "idle", n_tokens=0, resume_raw_lcp=None,
                            n_checkpoints=0, checkpoint_bytes=0, genes=[], deferred=len(self.deferred))
        return SlotInfo(
            id=self.id, state="processing" if self.busy else "idle", n_tokens=len(self.kv_tokens),
            resume_raw_lcp=self.resume_raw_lcp, n_checkpoints=len(self.checkpoints),
            checkpoint_bytes=sum(c.n_bytes for c in self.checkpoints),
            genes=[GeneRef(id=g, scale=s) for g, s in self.genes], deferred=len(self.deferred),
            mind=self.mind, checkpoint_positions=[c.pos for c in self.checkpoints], checkpoint_plan=list(self.ckpt.last),
        )

    # -- a request ---------------------------------------------------------------------

    async def _tokens_of(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return await self.engine.run(J.Tokenize(text=req.prompt))
        n_vocab = self.props.n_vocab
        bad = [t for t in req.prompt if not 0 <= t < n_vocab]
        if bad:
            raise InvalidParams(f"token ids out of range [0, {n_vocab})", bad=bad[:8])
        return list(req.prompt)

    async def _start(self, msg: Complete, env: Envelope[SlotInbox]) -> None:
        req = msg.req
        t_start = time.perf_counter()
        if msg.fresh and self.kv_tokens:
            await self.evict("placer")  # a new mind's fresh start: the slot makes way first
        prompt = await self._tokens_of(req)
        n_vocab = self.props.n_vocab
        for param, toks in (("logit_bias", [t for t, _ in req.bias_pairs()]),
                            ("thought_budget", req.thought_budget.tokens if req.thought_budget else [])):
            bad = [t for t in toks if t >= n_vocab]
            if bad:
                raise InvalidParams(f"{param} names token ids outside the vocab [0, {n_vocab})", param=param,
                                    bad=bad[:8])
        # Only attention layers take a cell per token: a pure recurrent model (kv_cells 0)
        # runs sequences past n_ctx (libllama 0.3.36: its memory is one state per sequence).
        cells = self.props.kv_cells
        if cells and len(prompt) + 1 > cells:
            raise PromptTooLong(
                f"prompt of {len(prompt)} tokens does not fit n_ctx {cells}",
                n_prompt_tokens=len(prompt), n_ctx=cells,
            )
        genes = self.gene_set(req)
        self.active = _Active(rid=msg.rid, req=req, prompt=prompt, reply=env.reply, stream=env.stream,
                              t_start=t_start, genes=genes, continued=msg.yielded, engine_s=msg.engine_s)
        self.metrics.requests_in_flight.inc()
        if genes or self.genes or self.memory.track_footprint:
            # An empty set is announced too when it replaces a non-empty one (it unpins) and
            # under a device budget (the residency must know which slots run).
            self._tickets += 1
            self.active.ticket = self._tickets
            self._acquired = True
            try:
                await self.peers.residency.tell(GeneAcquire(slot=self.id, genes=genes, ticket=self._tickets))
            except ActordError as e:  # the residency is gone: this request ends, the slot stays usable
                self._acquired = False
                await self._abort(e)
            return  # continued by GenesGranted / GenesRefused
        await self._run_active()

    async def _on_genes_granted(self, ticket: int) -> None:
        a = self.active
        if a is None or a.ticket != ticket or a.running:
            return  # a grant for a request that already ended (cancelled): its Finish went out
        if a.cancelled:
            await self._answer_here("cancelled")
            return
        await self._run_active()

    async def _run_active(self) -> None:
        a = self.active
        assert a is not None
        a.running = True
        try:
            # A slot evicted while its request waited for genes starts that request from what
            # it holds now (nothing): it does not page the mind back in by itself, because
            # cells that appear outside the scheduler's plan over-commit the shared cache
            # (the scheduler alone admits cells; seed 8 x 60 steps charged 258 of 256). The
            # mind's page stays in the store for the placer.
            await self._begin(a)
        except ActordError as e:
            await self._abort(e)

    async def _abort(self, error: ActordError) -> None:
        """The active request ends with `error` before it was enrolled; the slot stays consistent."""
        a = self.active
        if a is None:
            return
        self.active = None
        self.metrics.requests_in_flight.dec()
        self.metrics.requests_total.labels(outcome="error").inc()
        try:
            with anyio.CancelScope(shield=True):
                await self.finish_genes()
                await self.memory.tell_cells()
        except ActordError as e:  # a peer that is gone does not keep the slot busy
            log.warning("slot.end_failed", slot=self.id, rid=a.rid, error=e.to_dict())
        finally:
            if a.reply is not None:
                a.reply.fail(error)

    async def _begin(self, a: _Active) -> None:
        req, prompt, genes, m = a.req, a.prompt, a.genes, self.memory
        # The sampler first: a grammar libllama cannot parse fails here, before the
        # sequence is cut back, so a refused request changes nothing.
        seed = req.seed if req.seed is not None else self.default_seed
        await self.engine.run(J.SetSampler(seq=self.seq, params=sampling_params(req, seed, self.props.n_ctx)))
        scope = req.kv_scope()
        if m.mind is not None and req.mind is None and m.kv_tokens and (req.slot is None or scope != m.scope):
            # An unnamed request placed on her slot: not her turn, and nobody asked for her
            # state to go. (A request addressed to the slot is the client's own say over it,
            # as llama-server's slot verbs are: it continues or replaces what the slot holds;
            # but only within its scope: another tenant's say never reaches her state.)
            await self._keep_mind()
        # Its own cells count only under the request's whole lineage: cells computed under
        # other genes, or held for another scope, are another state (vocabulary/kv_identity.py).
        lineage = (genes, scope)
        raw = common_prefix(m.kv_tokens, prompt) if m.lineage == lineage else 0
        if raw == 0 and m.kv_tokens and m.lineage != lineage:
            log.info("slot.lineage_changed", slot=self.id, n_tokens=len(m.kv_tokens),
                     genes_changed=m.genes != genes, scope_changed=m.scope != lineage[1])
        raw = await self.share.share_prefix(prompt, lineage, raw) or raw
        m.resume_raw_lcp = raw
        # The whole prompt held: its last cell stays, and the first token is sampled from the
        # logits the engine kept with it (a repeat answers as the first time: StepEntry.memo).
        # Otherwise the last token is decoded again, for its logits.
        keep_last = (self.props.prompt_logits and raw >= len(prompt) and req.n_predict > 0
                     and await self.engine.run(J.MemoHeld(seq=self.seq, pos=len(prompt) - 1, token=prompt[-1])))
        held = len(m.kv_tokens)
        usable, from_ckpt = await m.cut_to(min(raw, len(prompt) if keep_last else len(prompt) - 1))
        m.used_moved_checkpoints()
        if usable == 0 and raw > 0:
            usable = await self.share.base_after_cut(prompt, lineage, held)
        m.draft_n = min(m.draft_n, usable)  # every cut of the sequence cuts the draft's too
        memo = 0 if not self.props.prompt_logits else J.MEMO_REUSE if usable == len(prompt) else J.MEMO_KEEP
        pos0 = usable - 1 if memo == J.MEMO_REUSE else usable
        if usable == 0 and raw > 0:
            self.metrics.full_reprefills_total.inc()
            log.info("slot.full_reprefill", slot=self.id, raw_lcp=raw, n_prompt=len(prompt))
        m.lineage = lineage
        m.mind = req.mind
        if not a.continued:  # a continuation's prompt is its request's, counted with its first part
            self.metrics.prompt_tokens_total.inc(len(prompt))
        nothing_to_decode = req.n_predict == 0 and usable == len(prompt)
        if nothing_to_decode or a.cancelled:
            # It ends here, never enrolled: the scheduler, which counts the rest, never sees it.
            self.metrics.prompt_tokens_processed_total.inc(len(prompt) - usable)
            if not a.continued:
                self.metrics.prompt_tokens_cached_total.inc(usable)
            await self._answer_here("length" if nothing_to_decode else "cancelled", n_cached=usable)
            return
        enroll = Enroll(
            rid=a.rid, slot=self.id, seq=self.seq, prompt=prompt, pos0=pos0, n_predict=req.n_predict,
            genes=m.genes, stop=list(req.stop),
            checkpoint_at=m.checkpoint_positions(
                pos0, len(prompt), self.share.shared_point(prompt, lineage) if self.props.needs_checkpoints else 0),
            stop_tokens=list(req.stop_tokens), ignore_eos=req.ignore_eos, stream=a.stream is not None,
            resumed_from_checkpoint=from_ckpt, t_start=a.t_start, logprobs=req.logprobs,
            spec=self.props.spec_n_max if self.props.spec else 0, draft_pos0=m.draft_n, epoch=m.kv_epoch,
            progress=req.return_progress, timings=req.timings_per_token, thought_budget=req.thought_budget,
            scope=m.scope, twin=usable == 0 and m.shares_cells() and not m.drafting, memo=memo,
            yieldable=yieldable(req), continued=a.continued, engine_s=a.engine_s,
        )
        self.peers.scheduler.put_nowait(Envelope(enroll, a.reply, a.stream))
        a.reply, a.enrolled = None, True  # the scheduler answers from here on
        self._say_activity()  # its cells hold steady now: peers may share them

    async def _keep_mind(self) -> None:
        """An unnamed request runs on her slot: her state goes to her page first, as a copy
        (the sequence stays, so the request still starts from what it shares with her), else
        to her page file. Where neither can hold it, the request is refused, typed, and she
        keeps her slot: nothing of a named mind is ever written over."""
        mind = self.memory.mind
        assert mind is not None
        try:
            await self.moves.page_out(mind, keep=True)
            how = "page"
        except PageRamExceeded:
            from actord.serving.placer import mind_file

            await self.moves.save(mind_file(mind))  # a failure here refuses the request: she stays
            self.memory.mind = None
            how = "file"
        self.metrics.minds_kept_total.labels(to=how).inc()
        log.info("slot.mind_kept", slot=self.id, mind=mind, to=how, n_tokens=len(self.kv_tokens))

    async def _on_ended(self, msg: Ended) -> None:
        a = self.active
        if a is None or a.rid != msg.rid:
            return
        m = self.memory
        m.kv_tokens = list(msg.kv_tokens)
        m.draft_n = min(msg.draft_n, len(m.kv_tokens))
        self.active = None
        try:
            if msg.cut_back:
                await m.cut_back_after_failure()
                await m.tell_cells()
            elif m.owe_cells:  # an eviction refused meanwhile: its asker waits to hear
                await m.tell_cells()
            # Otherwise the scheduler counted the cells as it ended the request (kv_tokens):
            # nothing new to tell it.
            await self.finish_genes()
        except ActordError as e:  # the slot is idle whatever a peer said
            log.warning("slot.end_failed", slot=self.id, rid=msg.rid, error=e.to_dict())

    async def _answer_here(self, reason: str, n_cached: int = 0) -> None:
        """A request that ends before the scheduler had it (cancelled, nothing to decode)."""
        a = self.active
        assert a is not None
        self.active = None
        self.metrics.requests_in_flight.dec()
        self.metrics.requests_total.labels(outcome=reason).inc()
        result = CompletionResult(
            content="", tokens=[], n_prompt_tokens=len(a.prompt), n_prompt_processed=len(a.prompt) - n_cached,
            n_cached=n_cached, slot=self.id, stop_reason=reason, resumed_from_checkpoint=False,
            timings=Timings(prompt_ms=(time.perf_counter() - a.t_start) * 1e3, predicted_ms=0.0,
                            prompt_per_second=0.0, predicted_per_second=0.0),
        )
        try:
            await self.finish_genes()
            await self.memory.tell_cells()
        except ActordError as e:
            log.warning("slot.end_failed", slot=self.id, rid=a.rid, error=e.to_dict())
        finally:
            if a.reply is not None:
                a.reply.send(result)

    # -- its genes' lease and footprint ------------------------------------------------

    async def finish_genes(self) -> None:
        track = self.memory.track_footprint  # the device budget's: it counts slot states
        if not (self._acquired or track):
            return
        self._acquired = False
        n = await self.memory.device_bytes() if track else 0
        await self.peers.residency.tell(GeneFinish(slot=self.id, n_bytes=n))

    # -- page and file moves, evictions, forks --------------------------------------------

    async def _handle_page_op(self, msg: SlotInbox, env: Envelope[SlotInbox]) -> None:
        moves = self.moves
        if isinstance(msg, PageInSlot) and (msg.evict_first or msg.room):
            out = await self._placer_page_in(msg)
        else:
            try:
                if self._foreign(getattr(msg, "scope", None)):
                    raise SlotEmpty(f"slot {self.id} holds no sequence", slot=self.id)  # none of the caller's
                match msg:
                    case PageOutSlot(page=name):
                        out = await moves.page_out(name)
                    case PageInSlot(page=name, room_cells=room_cells):
                        out = await moves.page_in(name, room_cells=room_cells)
                    case SaveSlot(file=file, mind=mind) if mind is not None:
                        out = await moves.save_mind(mind, file)
                    case SaveSlot(file=file, kept=kept):
                        out = await moves.save(file, kept=kept)
                    case RestoreSlot(file=file, room_cells=room_cells):
                        out = await moves.restore(file, room_cells=room_cells)
                    case _:
                        raise InvalidParams(f"not a page operation: {type(msg).__name__}")
            except BaseException:
                # Whoever asked may have had cells held for this slot (MakeRoom before a page-in
                # or restore): a refused or failed move tells what the sequence really holds, so
                # no false count is left to evict other clients' caches.
                with anyio.CancelScope(shield=True):
                    await self.memory.tell_cells()
                raise
        if env.reply is not None:
            env.reply.send(out)

    async def _placer_page_in(self, msg: PageInSlot) -> dict[str, Any]:
        """The placer's page-in: make way (evict_first), then take the page; one Cells tell
        at the end, whatever happened, carrying the room token back (`msg.room`)."""
        m = self.memory
        m.cells_batched = True
        evicted: dict[str, Any] = {}
        try:
            if msg.evict_first and m.kv_tokens:
                mind, n = m.mind, len(m.kv_tokens)
                self.moves.paged_out_base = 0
                await self.evict("placer", ram_only=True)
                if mind is not None:
                    # n_base: her page stands on a base (maybe just made): a new mind placed
                    # here may start from it, which the page store could not say before.
                    evicted = {"evicted": {"mind": mind, "n_tokens": n, "n_base": self.moves.paged_out_base}}
            out = await self.moves.page_in(msg.page, room_cells=msg.room_cells) if msg.page else {"slot": self.id}
            # The placer knows what the slot holds now from this answer: no state to tell.
            self._told = (self.busy or bool(self.deferred), m.mind)
            return {**out, **evicted}
        except ActordError as e:
            if evicted:  # the placer learns where the mind it displaced went, even on a refusal
                e.data.setdefault("evicted", evicted["evicted"])
            raise
        finally:
            m.cells_batched = False
            with anyio.CancelScope(shield=True):
                if msg.room or m.cells_dirty:
                    await m.tell_cells(release=msg.room)

    async def _on_evict(self, reason: str, env: Envelope[SlotInbox]) -> None:
        try:
            freed = await self.evict(reason)
        except ActordError as e:
            if reason == "device":
                await self.peers.residency.tell(EvictDone(slot=self.id, freed=False, kept=not isinstance(e, SlotBusy)))
            if env.reply is not None:
                env.reply.fail(e)
            return
        if reason == "device":
            await self.peers.residency.tell(EvictDone(slot=self.id, freed=True))
        if env.reply is not None:
            env.reply.send((freed, self.memory.cells_seq))

    async def evict(self, reason: str, *, ram_only: bool = False) -> int:
        """Give up an idle sequence: to the mind's page, else its file; a sequence without a
        mind (a slot-addressed cache) is dropped.

        Returns the cells freed. A mind's state goes only once a copy of it is whole in the
        page store or durable in its page file: when the page RAM refuses and the file cannot
        be written (a full or read-only page folder, EIO), the eviction is refused with that
        error and the sequence stays as it was. A slot with a running request refuses too:
        eviction never touches work in flight. A request still waiting for its genes has a
        quiet sequence, which may go too (the request then decodes its prompt from zero).
        """
        m = self.memory
        a = self.active
        if a is not None and a.running:
            # Whoever asked may wait for this slot (the scheduler parks): it hears from us
            # when the request ends, even where the end changes no count.
            m.owe_cells = True
            raise SlotBusy(f"slot {self.id} has work in flight", slot=self.id)
        n = len(m.kv_tokens)
        if n == 0:
            await m.footprint_changed()  # whoever asked may hold a stale size: correct it
            return 0
        how = "dropped"
        mind = m.mind
        if mind is not None:
            try:
                await self.moves.page_out(mind)
                how = "paged_out"
            except PageRamExceeded as e:
                if ram_only:  # the asker spills by its own order and asks again; nothing moved
                    raise PageRamExceeded(e.message, **{**e.data, "mind": mind}) from None
                from actord.serving.placer import mind_file

                try:
                    await self.moves.save(mind_file(mind))
                except ActordError as e:
                    self.metrics.slot_evictions_refused_total.labels(reason=reason).inc()
                    log.warning("slot.evict_refused", slot=self.id, mind=mind, reason=reason, n_tokens=n,
                                why="no room in page RAM and its page file cannot be written", error=e.to_dict())
                    raise
                how = "spilled"
        if how != "paged_out":
            await m.erase()
        self.metrics.slot_evictions_total.labels(reason=reason, how=how).inc()
        log.info("slot.evicted", slot=self.id, mind=mind, reason=reason, how=how, n_tokens=n)
        return n

    async def fork_from(self, src: int, tokens: list[int]) -> bool:
        """Hold a copy of slot `src`'s sequence (messages.Fork), which must be quiet and hold
        exactly `tokens` by its record in the index; False, and nothing changed (but a mind this
        slot held paged out), when it does not. The check and the copy's submission happen in
        one tick of the loop, so no job of src's can come between them (the engine runs
        between-steps jobs in order)."""
        def source() -> Held | None:
            return self.peers.index.quiet_with(src, tokens) if src != self.id else None

        if source() is None:
            return False
        m = self.memory
        if m.mind is not None and m.kv_tokens:
            await self.evict("fork")  # the mind keeps its history: to its page, else its file
        held = source()
        if held is None:
            return False
        job = self.engine.submit(J.SeqCopy(src=held.seq, dst=self.seq))
        try:
            await self.engine.wait(job)
        except ActordError:
            await m.erase()  # what the sequence holds is unknown: nothing
            raise
        m.lineage = held.lineage
        await m.hold_only(tokens)  # (the draft context's copy was cleared)
        return True

    def gene_set(self, req: CompletionRequest) -> tuple[tuple[int, float], ...]:
        return gene_set(self.default_genes, req)


def gene_set(default_genes: Sequence[int], req: CompletionRequest) -> tuple[tuple[int, float], ...]:
    """Default genes at scale 1 unless the request names them, plus the request's genes."""
    scales = {gid: 1.0 for gid in default_genes}
    scales.update({g.id: float(g.scale) for g in req.genes})
    return tuple(sorted(scales.items()))
