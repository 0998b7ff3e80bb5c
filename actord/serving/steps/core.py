"""The per-token path as a pure, synchronous scheduling core (vLLM v1's shape).

Why this exists: a generated token used to cross an actor round trip, slot by slot, and
step k+1 waited until every slot had answered step k. Here one record per running request
holds everything a step needs (THE token list, how much of it the KV holds, what is in
flight, sampling limits, stop conditions, the incremental text, checkpoint positions, the
gene group), and the Scheduler actor drives three calls:

    plan = core.schedule(free_cells)   # the next engine step, or None
    events = core.update(plan, out, now)   # what step `plan` produced
    events = core.abort(rid)           # idempotent

No anyio, no threads, no libllama here (the layering test checks it): the tests drive it with
hand-built `StepOut`s and no model.

Overlap (SGLang's): `schedule` may plan step k+1 while step k runs. A request whose step-k
entry samples is planned in k+1 with `feed_last`: the engine decodes the token it sampled
for that sequence in step k, so the engine goes from step to step without waiting for
Python. If step k then ends the request (end of generation, a stop string, a cancel), its
k+1 entry has fed one more token: that token is in the KV and in `kv_tokens`, and the k+1
sample is dropped. The request is answered, and its slot released, when nothing of it is in
flight any more (one step later). At most `depth` steps are in flight.

Accounting is vLLM's: `n_done` tokens are in the KV (confirmed by step outputs), `n_sched`
more are in steps in flight; a failed or skipped step gives its tokens back (`unschedule`).
KV cells: an enrolled slot holds `n_done + n_sched` cells (`n_held`: and a repeat's kept
last prompt cell, StepEntry.memo, until its step runs); idle slots hold what they last
told (`set_cells`), or more while a page-in or restore has cells reserved for them
(`reserve` / `release`: the most of what they told and their reservations). A reservation
is its own record, released by whoever made it once the move is over, however it ended: a
slot's count never carries it, so none is left behind by a move that failed.

Speculative decoding (policy/speculation.py): a request with `spec` = k_max > 0 drafts. Its entry
carries what the draft context must catch up on and how many tokens to draft; `update`
advances `n_done` by the tokens the target accepted plus its own (the engine has cut the
rest in the same step job), and records how far the draft context reaches. Such a request
steps at depth 1 (its next entry needs what this one accepts), and while one of its
sampling entries is in flight no further step is planned: every request then steps once
per engine step, instead of a speculating request joining only every other step. The
others keep `feed_last` otherwise.

A reasoning budget (steps/thought.py): the output token that uses a thought's budget up makes
the forced tokens known ones, fed together by the next entry; `feed_until` keeps a sample from
being planned blind past it. The records it works on (`Request`, `Plan`, the events) are in `records.py`.
"""

from __future__ import annotations

from typing import Any

from actord.policy.yielding import YIELD
from actord.engine import jobs as J
from actord.policy import speculation as S
from actord.policy.prefix_index import common_prefix
from actord.vocabulary.errors import InternalError, InvalidParams
from actord.vocabulary.types import TokenLogprob, TopLogprob
from actord.serving.steps.records import Delta, Event, Finished, GeneKey, Plan, Progress, Request, StepCheckpoint


def _token_logprob(tok: int, res: J.EntryOut | J.Sampled) -> TokenLogprob:
    """The engine's raw (logprob, top) for a sampled token, as the answer carries it."""
    return TokenLogprob(
        token=tok, text=res.piece.decode(errors="replace"), bytes=list(res.piece),
        logprob=res.logprob if res.logprob is not None else 0.0,
        top=[TopLogprob(token=t, text=p.decode(errors="replace"), bytes=list(p), logprob=lp) for t, lp, p in res.top],
    )


TWIN_MIN = 32  # tokens (prefix_share.MIN_SHARE): below this a prefill costs less than the wait


class SchedulerCore:
    def __init__(self, n_batch: int, n_ctx: int = 0, piece_tile: int = 1, group_quantum: int = 4,
                 depth: int = 2) -> None:
        self.n_batch = n_batch
        self.n_ctx = n_ctx  # 0: cells are not charged (an engine without a KV cache)
        self.piece_tile = max(1, piece_tile)
        self.group_quantum = group_quantum
        self.depth = depth
        self.reqs: dict[int, Request] = {}  # rid -> record, enrolled until drained
        self.by_slot: dict[int, int] = {}  # slot -> rid
        self.cells: dict[int, int] = {}  # idle slots' cells, as they told
        self.reserved: dict[int, dict[int, int]] = {}  # slot -> {token: cells held for a page move}
        # Cells held by two sequences are charged once (serving/prefix_share.py): dst's first
        # n cells are src's, while both sequences are still in the epoch they were in then
        # (a sequence's epoch moves on whenever it loses or replaces a cell; within one it
        # only grows, so cells below n stay shared). Epochs as last told (Cells, Enroll).
        self.epochs: dict[int, int] = {}
        self.links: dict[int, tuple[int, int, int, int]] = {}  # dst -> (src, src epoch, dst epoch, n)
        self._tokens = 0
        self.inflight: list[Plan] = []  # submitted, oldest first
        self.epoch = 0
        self.steps = 0
        self.group_switches = 0
        self.last_use: dict[int, int] = {}
        self._enrolled = 0
        self._n_spec = 0  # enrolled speculating requests (the hold below costs nothing without)
        self._n_progress = 0  # enrolled requests that asked for prompt progress (none: no per-step look)
        self._current: GeneKey | None = None
        self._run_length = 0
        self._last_served: dict[GeneKey, int] = {}
        self._waiting: set[int] = set()  # rids waiting for a twin (`add`)

    # -- enrolment and cells -------------------------------------------------------------

    def add(self, r: Request) -> None:
        if r.slot in self.by_slot:
            raise ValueError(f"slot {r.slot} already has request {self.by_slot[r.slot]} enrolled")
        self._enrolled += 1
        if r.think is not None:  # a forced end of a thought would cut an accepted draft: no speculation
            r.spec = 0
        r.feed_until = r.n_predict if r.think is None else min(r.n_predict, r.think.limit(len(r.out)))
        self._n_spec += r.spec > 0
        self._n_progress += r.progress
        r.order = self._enrolled
        r.checkpoint_at = sorted(p for p in r.checkpoint_at if p > r.n_done)
        if r.lineage is not None and r.n_done == 0 and not r.spec:
            r.twin = self._twin_of(r)
            if r.twin is not None:
                self._waiting.add(r.rid)
        self.reqs[r.rid] = r
        self.by_slot[r.slot] = r.rid
        self.cells.pop(r.slot, None)
        # A page move's room held for this slot stays until its mover releases it: a request
        # addressed to the slot may take it between the room's grant and the move, which
        # then waits behind the request (`_waiting_moves`). Dropped here, the deferred move
        # filled cells nobody held (seed 1802 x 60 steps charged 296 of 256).

    # -- twins: requests that arrive together with one prefix prefill it once ----------

    def _twin_of(self, r: Request) -> tuple[int, int] | None:
        """The running request under r's lineage whose prompt shares the most with r's (at
        most all of r's prompt but its last token), if at least TWIN_MIN tokens: r waits for
        its KV to hold them and takes them by cells (serving/prefix_share.py's share, made
        at the moment its twin has decoded them, instead of a second prefill)."""
        best: tuple[int, int] | None = None
        limit = r.n_prompt - 1
        for a in self.reqs.values():
            if a.lineage != r.lineage or a.ended or a.slot == r.slot:
                continue
            n = min(common_prefix(a.tokens[:a.n_prompt], r.tokens[:limit]), limit)
            if n >= TWIN_MIN and (best is None or n > best[1]):
                best = (a.rid, n)
        return best

    def twins_ready(self) -> list[tuple[Request, int, int]]:
        """(request, its twin's sequence, tokens) for every waiting request whose twin's KV
        now holds what both share; a twin that ended first is forgotten (the request prefills
        as any other): an ended request's sequence is its slot's again, to cut back, page
        out or erase, so only a live one's cells are taken."""
        out = []
        for rid in list(self._waiting):
            r = self.reqs[rid]
            assert r.twin is not None
            a = self.reqs.get(r.twin[0])
            n = r.twin[1]
            if a is None or a.ended:
                r.twin = None
                self._waiting.discard(rid)
            elif a.n_done >= n:
                out.append((r, a.seq, n))
        return out

    def twin_shared(self, r: Request, ok: bool) -> int:
        """A waiting request's share was made (ok: its first n cells are its twin's now) or
        refused; the tokens it took."""
        assert r.twin is not None
        rid, n = r.twin
        r.twin = None
        self._waiting.discard(r.rid)
        if not ok:
            return 0
        r.n_done = r.n_cached = n  # its sequence holds them now, whatever became of the twin
        r.checkpoint_at = [c for c in r.checkpoint_at if c > n]
        a = self.reqs.get(rid)
        if a is not None and not a.ended:  # else charged twice: safe, and only until r ends
            self.link(r.slot, a.slot, self.epochs.get(a.slot, 0), self.epochs.get(r.slot, 0), n)
        return n

    def set_cells(self, slot: int, n: int) -> None:
        if slot not in self.by_slot:  # while enrolled, the record is the count
            self.cells[slot] = n

    def set_epoch(self, slot: int, epoch: int) -> None:
        if epoch > self.epochs.get(slot, 0):
            self.epochs[slot] = epoch
            if self.links:  # a link whose ends moved on shares nothing any more
                self.links = {d: ln for d, ln in self.links.items()
                              if self.epochs.get(ln[0], 0) <= ln[1] and self.epochs.get(d, 0) <= ln[2]}

    def link(self, dst: int, src: int, src_epoch: int, dst_epoch: int, n: int) -> None:
        """dst's first n cells are src's (a share by cells): charged once from now on."""
        if dst != src and n > 0 and self.epochs.get(src, 0) <= src_epoch and self.epochs.get(dst, 0) <= dst_epoch:
            self.links[dst] = (src, src_epoch, dst_epoch, n)

    def shared_of(self, slot: int) -> int:
        """Cells of `slot` that another sequence also holds (what evicting it does not free)."""
        return sum(self._shared(d, ln) for d, ln in self.links.items() if slot == d or slot == ln[0])

    def _shared(self, dst: int, ln: tuple[int, int, int, int]) -> int:
        src, src_epoch, dst_epoch, n = ln
        if self.epochs.get(src, 0) != src_epoch or self.epochs.get(dst, 0) != dst_epoch:
            return 0  # not yet heard of (an end's tell is on its way): charged twice meanwhile
        return min(n, self.held(src), self.held(dst))

    def room_for(self, slot: int) -> int:
        """Cells a page move into `slot` may fill: those free, and the slot's own (the move
        replaces its cells; those it shares with another sequence stay that one's)."""
        return self.free_cells + self.held(slot) - self.shared_of(slot)

    def shared_cells(self) -> int:
        return sum(self._shared(d, ln) for d, ln in self.links.items()) if self.links else 0

    def reserve(self, slot: int, n: int) -> int:
        """Hold `n` cells for a page move into `slot` (idle, or after its request); the token
        to `release`."""
        self._tokens += 1
        self.reserved.setdefault(slot, {})[self._tokens] = n
        return self._tokens

    def release(self, token: int) -> None:
        for slot, held in list(self.reserved.items()):
            if held.pop(token, None) is not None and not held:
                del self.reserved[slot]

    def _idle_held(self, slot: int) -> int:
        return max(self.cells.get(slot, 0), self._reserved_for(slot))

    def held(self, slot: int) -> int:
        rid = self.by_slot.get(slot)
        if rid is None:
            return self._idle_held(slot)
        r = self.reqs[rid]
        return max(r.n_held, self._reserved_for(slot))

    def _reserved_for(self, slot: int) -> int:
        held = self.reserved.get(slot)
        return max(held.values()) if held else 0

    def _waiting_moves(self) -> int:
        """Cells held for page moves into slots that run a request: a move waits behind the
        request (the slot defers it), so its room counts beyond the request's own cells."""
        out = 0
        for slot in self.reserved:
            rid = self.by_slot.get(slot)
            if rid is not None:
                r = self.reqs[rid]
                out += max(0, self._reserved_for(slot) - r.n_held)
        return out

    @property
    def free_cells(self) -> int:
        if not self.n_ctx:
            return 1 << 30
        idle = set(self.cells) | set(self.reserved)
        return (self.n_ctx - sum(self._idle_held(s) for s in idle if s not in self.by_slot)
                - sum(r.n_held for r in self.reqs.values())
                - (self._waiting_moves() if self.reserved else 0) + self.shared_cells())

    def runnable(self) -> list[Request]:
        return [r for r in self.reqs.values() if not r.ended]

    def waiting_for_twins(self) -> bool:
        return bool(self._waiting)

    def wanted(self) -> int:
        """Cells the next step of the group that would run wants (for making room)."""
        group = self.choose_group()
        if group is None:
            return 0
        return min(self.n_batch, sum(self._want(r) for r in self.runnable() if r.genes == group and r.twin is None))

    def _want(self, r: Request) -> int:
        p = r.n_done + r.n_sched
        return r.n_prompt - p if p < r.n_prompt else max(1, len(r.tokens) - p)

    # -- planning ------------------------------------------------------------------------

    def choose_group(self) -> GeneKey | None:
        live = {r.genes for r in self.reqs.values() if r.reason is None}
        if len(live) <= 1:  # none, or one group (the common case): it runs, whoever ran last
            return next(iter(live), None)
        groups = sorted(live)
        if self._current in groups and (self._run_length < self.group_quantum or len(groups) == 1):
            return self._current
        # The group served longest ago goes next; never-served groups first, in key order.
        groups.sort(key=lambda g: (self._last_served.get(g, -1), g))
        return groups[0]

    def schedule(self, free: int | None = None) -> Plan | None:
        """The next step within n_batch tokens and `free` KV cells (default: the free
        cells), decodes first; None when nothing can run now."""
        if len(self.inflight) >= self.depth:
            return None
        if self.inflight and self.inflight[-1].step.epoch != self.epoch:
            return None  # a step of an ended epoch is still out: its tokens are not in the KV
        if self._n_spec and self.inflight and any(r.spec and r.samples and not r.ended for r in self.reqs.values()):
            return None  # a speculating request waits for its acceptance: depth 1 (see above)
        group = self.choose_group()
        if group is None:
            return None
        budget = self.n_batch if free is None and not self.n_ctx else min(
            self.n_batch, self.free_cells if free is None else free)
        last = set(self.inflight[-1].rids) if self.inflight else ()
        # Decodes first, then prompts, each in enrolment order: `reqs` holds the requests in
        # that order (`add` numbers and inserts them together), so one pass partitions them
        # as sorting by (prompt left, order) would, without a key call per request.
        members: list[Request] = []
        prompts: list[Request] = []
        for r in self.reqs.values():
            if r.reason is None and r.genes == group and r.twin is None and not (r.yielding and r.n_sched):
                (members if r.n_done + r.n_sched >= r.n_prompt else prompts).append(r)
        if prompts:
            members += prompts
        entries: list[J.StepEntry] = []
        rids: list[int] = []
        fed: list[int] = []
        draft_budget = self.n_batch  # the draft context's batch: what it catches up on
        for r in members:
            if budget <= 0:
                break
            e = self._entry(r, budget, last)
            if e is None:
                continue
            if r.spec:
                e = self._speculate(r, e, budget, draft_budget)
                draft_budget -= len(e.draft_tokens)
            n = len(e.tokens) + e.feed_last + e.draft
            r.n_sched += n
            r.samples += e.sample
            entries.append(e)
            rids.append(r.rid)
            fed.append(n)
            budget -= n
        if not entries:
            return None
        if group != self._current:
            if self._current is not None:
                self.group_switches += 1
            self._current, self._run_length = group, 0
        self._run_length += 1
        self.steps += 1
        self._last_served[group] = self.steps
        plan = Plan(step=J.Step(entries=entries, genes=group, epoch=self.epoch), rids=rids, fed=fed)
        self.inflight.append(plan)
        return plan

    def _entry(self, r: Request, budget: int, last: Any) -> J.StepEntry | None:
        if r.spec and r.n_sched:
            return None  # a speculating request steps at depth 1 (its draft needs what the KV holds)
        p = r.n_done + r.n_sched
        if p < r.n_prompt:
            n = min(r.n_prompt - p, budget)
            ckpt = False
            for c in r.checkpoint_at:
                if p < c <= p + n:
                    n, ckpt = c - p, True
                    break
            if not ckpt and self.piece_tile <= n < r.n_prompt - p:
                # A piece cut short by the budget ends on a tile boundary, so the pieces
                # after it (and grid checkpoints) are whole tiles, decoded at full speed.
                aligned = (p + n) // self.piece_tile * self.piece_tile - p
                if aligned > 0:
                    n = aligned
            finishes = p + n == r.n_prompt
            # A MEMO_REUSE request's first entry is its kept last cell: always marked, so the
            # engine never decodes a second cell at that position.
            memo = r.memo if finishes and (r.n_predict > 0 or r.memo == J.MEMO_REUSE) else 0
            return J.StepEntry(seq=r.seq, tokens=r.tokens[p:p + n], pos0=p,
                               sample=finishes and r.n_predict > 0, checkpoint=ckpt, memo=memo)
        if self.n_ctx and p + 1 >= self.n_ctx:
            return None  # update() ends it with "context" when its sample arrives
        if p < len(r.tokens):  # the token to feed is known
            if p + 1 == len(r.tokens):
                return J.StepEntry(r.seq, [r.tokens[p]], p, True)
            n = min(len(r.tokens) - p, budget)  # a forced end of a thought: fed together, sampled after
            return J.StepEntry(r.seq, r.tokens[p:p + n], p, p + n == len(r.tokens))
        # The token to feed is being sampled by the newest step in flight: the engine feeds
        # it, unless that sample is the request's last (n_predict) or may be one that forces
        # a thought's end (`feed_until`: the forced tokens go in before the next sample).
        if not r.samples or r.rid not in last or len(r.out) + r.samples >= r.feed_until:
            return None
        return J.StepEntry(r.seq, [], p, True, False, True)  # sample, no checkpoint, feed_last

    def _speculate(self, r: Request, e: J.StepEntry, budget: int, draft_budget: int) -> J.StepEntry:
        """A speculating request's entry: the draft catches up on what the target will hold
        after the entry's tokens, and drafts after a generation token when it is caught up."""
        if e.feed_last:  # never planned for a speculating request (depth 1); no draft
            return e
        if r.spec_pause > 0:  # the draft keeps missing: neither draft nor catch up for now
            r.spec_pause -= 1
            return e
        end = e.pos0 + len(e.tokens)
        start, stop = S.catch_up(r.draft_done, end, draft_budget)
        k = 0
        if stop == end and e.sample and not e.checkpoint:
            k = S.draft_len(r.spec, len(r.out), r.n_predict, end, self.n_ctx, budget - len(e.tokens))
        if stop == start and not k:
            return e
        return J.StepEntry(seq=e.seq, tokens=e.tokens, pos0=e.pos0, sample=e.sample, checkpoint=e.checkpoint,
                           draft_tokens=r.tokens[start:stop], draft_pos0=start, draft=k)

    # -- results -------------------------------------------------------------------------

    def _pop(self, plan: Plan) -> None:
        if not self.inflight or self.inflight[0] is not plan:
            raise ValueError("step results arrive in the order the steps were submitted")
        self.inflight.pop(0)

    def update(self, plan: Plan, out: J.StepOut, now: float = 0.0) -> list[Event]:
        """Step `plan` ran; advance its requests. A request whose output cannot be handled
        ends with an error (`fail_request`); the others go on."""
        self._pop(plan)
        events: list[Event] = []
        reqs, last_use, steps = self.reqs, self.last_use, self.steps
        for rid, n, entry, res in zip(plan.rids, plan.fed, plan.step.entries, out.entries):
            r = reqs[rid]
            r.n_sched -= n
            if entry.draft:  # a speculating entry fed n = 1 + k tokens; its KV keeps 1 + the accepted ones
                r.n_done += n - entry.draft + len(res.more)
            elif res.skipped:  # a feed_last the engine did not decode: the request ended at an eog or stop token
                r.n_done += n - 1
            else:
                r.n_done += n
            if res.draft_n >= 0:
                r.draft_done = res.draft_n
            if res.drafted:
                r.n_drafted += res.drafted
                r.n_accepted += len(res.more)
                r.n_spec_steps += 1
                r.spec_misses = 0 if res.more else r.spec_misses + 1
                r.spec_pause = S.pause_after(r.spec_misses)
            last_use[r.slot] = steps
            if r.checkpoint_at and r.checkpoint_at[0] <= r.n_done:
                r.checkpoint_at = [c for c in r.checkpoint_at if c > r.n_done]
            if res.checkpoint is not None:
                events.append(StepCheckpoint(rid=rid, slot=r.slot, pos=res.checkpoint_pos, data=res.checkpoint))
            if entry.sample:
                r.samples -= 1
                if res.skipped:
                    if r.reason is None:  # the engine saw an end this record did not: never the step
                        self._end(r, "error", events, error=InternalError(
                            f"the engine skipped sequence {r.seq}'s entry, a request that had not ended",
                            slot=r.slot))
                elif r.reason is None:
                    try:
                        if res.more or res.refused:
                            self._sampled(r, res, now, events)
                        else:  # one usable token: the common case (`_sampled`'s short path)
                            r.tokens.append(res.token)
                            self._emit(r, res, now, events)
                    except Exception as e:  # one request's output, never the step
                        self._end(r, "error", events, error=e)
                elif r.n_sched and not res.more:
                    # Ended, but a step planned before anyone knew feeds this sample (depth
                    # >= 3): it goes into the KV, so the record of what the KV holds keeps it.
                    r.tokens.append(res.token)
            elif r.n_predict == 0 and r.n_done >= r.n_prompt:
                self._end(r, "length", events)  # a prompt decoded for its KV only
            if r.yielding:
                self._settle_yield(r, events)
            if r.reason is not None and r.n_sched == 0:
                self._maybe_drained(r, events)
        if self._n_progress:
            # Before this step's tokens: the prompt's last piece is reported done before
            # the token it sampled (llama-server's order).
            events[:0] = [Progress(req=reqs[rid]) for rid, e in zip(plan.rids, plan.step.entries)
                          if rid in reqs and reqs[rid].progress and e.tokens and e.pos0 < reqs[rid].n_prompt]
        return events

    def _sampled(self, r: Request, res: J.EntryOut, now: float, events: list[Event]) -> None:
        # A speculating entry sampled several tokens: every one is in the KV or fed next,
        # output or not; the first that ends the request ends its output.
        if not res.more:  # one token: the common case
            r.tokens.append(res.token)  # the KV may take it (a step in flight feeds it), output or not
            if res.refused:
                raise InvalidParams(res.refused, param="grammar")
            self._emit(r, res, now, events)
            return
        refused = ""
        for x in (res, *res.more):
            r.tokens.append(x.token)  # the KV may take it (a step in flight feeds it), output or not
            if r.ended or refused:
                continue
            if x.refused:
                refused = x.refused
                continue
            self._emit(r, x, now, events)
        if refused:
            raise InvalidParams(refused, param="grammar")

    def _emit(self, r: Request, x: J.EntryOut | J.Sampled, now: float, events: list[Event]) -> None:
        tok, eog, piece = x.token, x.eog, x.piece
        out = r.out
        if not out and not r.t_first:
            r.t_first = now
        if (eog and not r.ignore_eos) or tok in r.stop_tokens:
            self._end(r, "eos" if eog else "stop", events)
            return
        out.append(tok)
        if r.logprobs is not None:
            r.logprobs.append(_token_logprob(tok, x))
        assert r.text is not None
        delta, stopped = r.text.push(piece)
        if stopped:
            self._end(r, "stop", events)
            return
        if delta:
            events.append(Delta(rid=r.rid, text=delta, token=tok, logprobs=r.unsent_logprobs()))
        if len(out) >= r.n_predict:
            self._end(r, "length", events)
        elif self.n_ctx and len(r.tokens) >= self.n_ctx:
            self._end(r, "context", events)
        elif r.think is not None:
            self._think(r, tok, piece, events)

    def _think(self, r: Request, tok: int, piece: bytes, events: list[Event]) -> None:
        """A budgeted thought's watch: a forced end goes out as far as n_predict and n_ctx allow."""
        think = r.think
        assert think is not None
        if think.step(tok, piece):
            room = r.n_predict - len(r.out)
            delta, stopped = think.force(r, min(room, self.n_ctx - len(r.tokens)) if self.n_ctx else room)
            if delta:
                events.append(Delta(rid=r.rid, text=delta, token=r.out[-1], logprobs=r.unsent_logprobs()))
            if stopped:
                return self._end(r, "stop", events)
            if len(r.out) >= r.n_predict:
                return self._end(r, "length", events)
            if self.n_ctx and len(r.tokens) >= self.n_ctx:
                return self._end(r, "context", events)
        r.feed_until = min(r.n_predict, think.limit(len(r.out)))

    def _end(self, r: Request, reason: str, events: list[Event], error: Any = None) -> None:
        if r.ended:
            return
        r.reason, r.error = reason, error
        r.tail = r.text.finish() if r.text is not None and reason != "error" else ""

    def _maybe_drained(self, r: Request, events: list[Event]) -> None:
        if r.ended and r.n_sched == 0:
            self._waiting.discard(r.rid)
            del self.reqs[r.rid]
            del self.by_slot[r.slot]
            self._n_spec -= r.spec > 0
            self._n_progress -= r.progress
            n = r.n_kv
            self.cells[r.slot] = n
            events.append(Finished(req=r, kv_tokens=r.tokens[:n], draft_n=min(r.draft_done, r.n_done)))

    def unschedule(self, plan: Plan) -> list[Event]:
        """Step `plan` did not run (skipped, or no KV cells): its tokens go back."""
        self._pop(plan)
        events: list[Event] = []
        for rid, n, entry in zip(plan.rids, plan.fed, plan.step.entries):
            r = self.reqs[rid]
            r.n_sched -= n
            r.samples -= entry.sample
            if r.yielding:
                self._settle_yield(r, events)
            self._maybe_drained(r, events)
        return events

    def fail(self, plan: Plan, error: Any) -> list[Event]:
        """Step `plan` failed: its requests end with `error` (their KV past n_done is
        unknown: the slot cuts it back); later steps were skipped by the engine."""
        self._pop(plan)
        self.epoch = int(getattr(error, "data", {}).get("epoch", self.epoch + 1))
        events: list[Event] = []
        for rid, n, entry in zip(plan.rids, plan.fed, plan.step.entries):
            r = self.reqs[rid]
            r.n_sched -= n
            r.samples -= entry.sample
            self._end(r, "error", events, error=error)
            self._maybe_drained(r, events)
        return events

    def skipped(self, plan: Plan, epoch: int) -> list[Event]:
        self.epoch = epoch
        return self.unschedule(plan)

    def abort(self, rid: int, reason: str = "cancelled", error: Any = None) -> list[Event]:
        """End a request (idempotent: an ended or unknown rid changes nothing)."""
        r = self.reqs.get(rid)
        events: list[Event] = []
        if r is None or r.ended:
            return events
        self._end(r, reason, events, error=error)
        self._maybe_drained(r, events)
        return events

    def give_way(self, rid: int) -> list[Event]:
        """Request `rid` gives its slot up (policy/yielding.py): no step is planned for it
        past those in flight, whose tokens it still writes; then, at a token that ends its
        text whole (stepping one token at a time until one does), it ends with YIELD. Its
        KV then holds every token it wrote but the last, which its continuation feeds: no
        cut back, so memory that cannot be cut (recurrent, sliding-window) loses nothing."""
        r = self.reqs.get(rid)
        events: list[Event] = []
        if r is not None and not r.ended:
            r.yielding = True
            self._settle_yield(r, events)
            self._maybe_drained(r, events)
        return events

    def _settle_yield(self, r: Request, events: list[Event]) -> None:
        """A yielding request with nothing in flight ends here if its text ends whole (its
        caller drains it)."""
        if r.reason is None and r.n_sched == 0 and r.text is not None and r.text.at_boundary():
            self._end(r, YIELD, events)

    def fail_request(self, rid: int, error: Any) -> list[Event]:
        return self.abort(rid, "error", error)

    def youngest(self) -> Request | None:
        live = self.runnable()
        return max(live, key=lambda r: r.order) if live else None
