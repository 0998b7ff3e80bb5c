"""The pure scheduling core, driven by hand-built step outputs and no model.

What these pin: decodes go first and prompts are tiled; checkpoint cuts; gene groups take
turns; the overlap (step k+1 planned before step k's sample is known, fed by the engine);
the end of a request one step late frees its slot with exactly the tokens the KV holds;
KV cells; the context's end; cancel between steps; a failing or skipped step; and one
request whose output cannot be handled ending alone.
"""

from __future__ import annotations

import pytest

from actord.serving.steps.core import SchedulerCore
from actord.serving.steps.records import Delta, Finished, Request, StepCheckpoint
from actord.serving.steps.text import TextState
from actord.engine import jobs as J


def req(rid: int, slot: int, prompt: int = 4, n_predict: int = 3, pos0: int = 0, genes=(), stop=(), stream=False,
        **kw) -> Request:
    return Request(rid=rid, slot=slot, seq=slot, tokens=list(range(100, 100 + prompt)), n_prompt=prompt,
                   n_done=pos0, n_predict=n_predict, genes=genes, text=TextState(list(stop), stream), **kw)


def out_for(plan, tokens: dict[int, int] | None = None, eog: set[int] = frozenset(), pieces=None, ckpt=None):
    """A StepOut for `plan`: seq s samples tokens[s] (default 7 + seq)."""
    tokens = tokens or {}
    pieces = pieces or {}
    entries = []
    for e in plan.step.entries:
        if e.sample:
            t = tokens.get(e.seq, 7 + e.seq)
            entries.append(J.EntryOut(seq=e.seq, token=t, piece=pieces.get(e.seq, b"x"), eog=e.seq in eog,
                                      checkpoint=ckpt if e.checkpoint else None,
                                      checkpoint_pos=e.pos0 + len(e.tokens) if e.checkpoint else 0))
        else:
            entries.append(J.EntryOut(seq=e.seq, checkpoint=ckpt if e.checkpoint else None,
                                      checkpoint_pos=e.pos0 + len(e.tokens) if e.checkpoint else 0))
    return J.StepOut(step=0, entries=entries, n_tokens=sum(len(e.tokens) + e.feed_last for e in plan.step.entries),
                     t_decode_ms=0.0, t_sample_ms=0.0)


def finished(events) -> list[Finished]:
    return [e for e in events if isinstance(e, Finished)]


def run_to_end(core: SchedulerCore, **kw) -> list:
    events: list = []
    while core.reqs:
        while core.schedule() is not None:
            pass
        plan = core.inflight[0]
        events += core.update(plan, out_for(plan, **kw))
    return events


def test_decodes_go_first_then_prompts_in_enrolment_order_within_the_batch():
    core = SchedulerCore(n_batch=8, depth=1)
    core.add(req(1, 0, prompt=3))
    plan = core.schedule()
    core.update(plan, out_for(plan))
    core.add(req(2, 1, prompt=20))
    plan = core.schedule()
    kinds = [(e.seq, len(e.tokens), e.sample) for e in plan.step.entries]
    assert kinds == [(0, 1, True), (1, 7, False)]  # one decode, then the prompt fills the batch


def test_a_prompt_piece_ends_at_a_checkpoint_and_the_checkpoint_event_names_its_slot():
    core = SchedulerCore(n_batch=64, depth=1)
    core.add(req(1, 0, prompt=40, checkpoint_at=[16, 32]))
    ends, cps = [], []
    while core.reqs[1].n_done < 40:
        plan = core.schedule()
        [e] = plan.step.entries
        ends.append(e.pos0 + len(e.tokens))
        cps += [ev for ev in core.update(plan, out_for(plan, ckpt=bytearray(b"ck"))) if isinstance(ev, StepCheckpoint)]
    assert ends == [16, 32, 40]
    assert [(c.slot, c.pos) for c in cps] == [(0, 16), (0, 32)]


def test_gene_groups_take_turns_and_a_step_holds_one_group():
    core = SchedulerCore(n_batch=64, group_quantum=2, depth=1)
    core.add(req(1, 0, prompt=2, n_predict=50, genes=((1, 1.0),)))
    core.add(req(2, 1, prompt=2, n_predict=50, genes=((2, 1.0),)))
    seen = []
    for _ in range(8):
        plan = core.schedule()
        assert len({core.reqs[r].genes for r in plan.rids}) == 1
        seen.append(plan.step.genes)
        core.update(plan, out_for(plan))
    assert seen == [((1, 1.0),)] * 2 + [((2, 1.0),)] * 2 + [((1, 1.0),)] * 2 + [((2, 1.0),)] * 2
    assert core.group_switches == 3


def test_step_k_plus_1_is_planned_before_step_k_samples_and_the_engine_feeds_the_sample():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=4, n_predict=5))
    k = core.schedule()
    k1 = core.schedule()  # planned while k runs
    assert k.step.entries[0].sample and not k.step.entries[0].feed_last
    [e] = k1.step.entries
    assert e.feed_last and e.tokens == [] and e.pos0 == 4  # the token k samples, at position 4
    assert core.schedule() is None  # at most `depth` in flight
    core.update(k, out_for(k, {0: 55}))
    assert core.reqs[1].tokens[4] == 55 and core.reqs[1].out == [55]
    k2 = core.schedule()  # k+1's sample is the newest in flight: fed by the engine again
    assert k2.step.entries[0].feed_last and k2.step.entries[0].pos0 == 5


def test_a_request_ended_by_its_sample_is_answered_when_its_speculative_step_drains():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=4, n_predict=10))
    k = core.schedule()
    k1 = core.schedule()
    assert finished(core.update(k, out_for(k, {0: 9}, eog={0}))) == []  # k+1 still feeds it
    assert core.schedule() is None  # nothing more for an ended request
    [f] = finished(core.update(k1, out_for(k1)))
    assert f.req.reason == "eos" and f.req.out == []
    assert f.kv_tokens == [100, 101, 102, 103, 9]  # the end-of-generation token was fed by k+1
    assert core.held(0) == 5 and 1 not in core.reqs


def test_at_depth_3_an_ended_request_keeps_the_sample_a_step_in_flight_fed():
    core = SchedulerCore(n_batch=64, depth=3)
    core.add(req(1, 0, prompt=4, n_predict=10))
    k, k1, k2 = core.schedule(), core.schedule(), core.schedule()
    assert k1.step.entries[0].feed_last and k2.step.entries[0].feed_last  # each feeds the one before's sample
    assert finished(core.update(k, out_for(k, {0: 9}, eog={0}))) == []
    assert finished(core.update(k1, out_for(k1, {0: 11}))) == []  # sampled after the end: k+2 feeds it
    [f] = finished(core.update(k2, out_for(k2, {0: 12})))
    assert f.req.reason == "eos" and f.req.out == []
    assert f.kv_tokens == [100, 101, 102, 103, 9, 11]  # what the KV holds: the eog token and the fed sample
    assert core.held(0) == len(f.kv_tokens)


def test_at_depth_3_a_feed_the_engine_skipped_after_an_eog_leaves_the_kv_at_the_eog():
    core = SchedulerCore(n_batch=64, depth=3)
    core.add(req(1, 0, prompt=4, n_predict=10))
    k, k1, k2 = core.schedule(), core.schedule(), core.schedule()
    core.update(k, out_for(k, {0: 9}, eog={0}))
    core.update(k1, out_for(k1, {0: 11}))  # k+1 fed the eog token; what it sampled is never fed
    skipped = J.StepOut(step=0, entries=[J.EntryOut(seq=0, skipped=True)], n_tokens=0, t_decode_ms=0.0,
                        t_sample_ms=0.0)
    [f] = finished(core.update(k2, skipped))
    assert f.kv_tokens == [100, 101, 102, 103, 9] and core.held(0) == 5  # as at depth 2


def test_a_skipped_entry_of_a_request_that_had_not_ended_ends_it_alone_with_a_typed_error():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=4, n_predict=10))
    core.add(req(2, 1, prompt=4, n_predict=3))
    k = core.schedule()
    core.update(k, out_for(k))
    k1 = core.schedule()
    entries = [J.EntryOut(seq=0, skipped=True), J.EntryOut(seq=1, token=8, piece=b"x")]
    events = core.update(k1, J.StepOut(step=0, entries=entries, n_tokens=1, t_decode_ms=0.0, t_sample_ms=0.0))
    [f] = finished(events)
    assert f.req.rid == 1 and f.req.reason == "error" and "skipped" in str(f.req.error)
    assert f.kv_tokens == [100, 101, 102, 103]  # the skipped feed is not in the KV
    assert core.reqs[2].out == [8, 8] and core.reqs[2].reason is None  # the other goes on


def test_the_last_sample_by_n_predict_is_never_fed():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=4, n_predict=1))
    k = core.schedule()
    assert core.schedule() is None  # its only sample is its last: no speculative feed
    [f] = finished(core.update(k, out_for(k, {0: 42})))
    assert f.req.reason == "length" and f.req.out == [42] and f.kv_tokens == [100, 101, 102, 103]


def test_n_predict_zero_decodes_the_prompt_and_samples_nothing():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=4, n_predict=0))
    k = core.schedule()
    assert not k.step.entries[0].sample
    [f] = finished(core.update(k, out_for(k)))
    assert f.req.reason == "length" and f.req.out == [] and len(f.kv_tokens) == 4


def test_a_stop_string_cuts_the_text_and_streams_only_what_precedes_it():
    core = SchedulerCore(n_batch=64, depth=1)
    r = req(1, 0, prompt=2, n_predict=20, stop=["END"], stream=True)
    core.add(r)
    pieces = [b"he", b"llo E", b"N", b"D more"]
    events = []
    for p in pieces:
        plan = core.schedule()
        if plan is None:
            break
        events += core.update(plan, out_for(plan, pieces={0: p}))
    [f] = finished(events)
    streamed = "".join(e.text for e in events if isinstance(e, Delta))
    assert f.req.reason == "stop" and f.req.text.text == "hello "
    assert streamed + f.req.tail == "hello "


def test_cells_count_in_flight_tokens_and_a_plan_fits_the_free_cells():
    core = SchedulerCore(n_batch=64, n_ctx=40, depth=2)
    core.set_cells(1, 10)  # an idle slot's cache
    core.add(req(1, 0, prompt=50, n_predict=1))
    plan = core.schedule()
    assert sum(plan.fed) == 30 and core.free_cells == 0
    assert core.schedule() is None
    core.update(plan, out_for(plan))
    assert core.held(0) == 30 and core.held(1) == 10


def test_generation_at_the_end_of_the_context_stops_with_context():
    core = SchedulerCore(n_batch=64, n_ctx=8, depth=2)
    core.add(req(1, 0, prompt=5, n_predict=50))
    events = run_to_end(core)
    [f] = finished(events)
    assert f.req.reason == "context" and len(f.kv_tokens) <= 7


def test_abort_between_steps_is_idempotent_and_waits_for_the_step_in_flight():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=4, n_predict=10))
    k = core.schedule()
    assert core.abort(1) == [] and core.abort(1) == []  # its step is in flight: answered when it drains
    assert core.schedule() is None
    [f] = finished(core.update(k, out_for(k)))
    assert f.req.reason == "cancelled" and f.req.out == []
    assert core.abort(1) == [] and core.abort(99) == []


def test_a_failed_step_ends_its_requests_and_a_skipped_one_is_replanned():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=4, n_predict=10))
    k = core.schedule()
    core.add(req(2, 1, prompt=3, n_predict=2))
    k1 = core.schedule()  # holds request 1's speculative decode and request 2's prompt

    class Boom(Exception):
        data = {"epoch": 1}

    assert finished(core.fail(k, Boom())) == []  # request 1 still has k+1 in flight
    assert core.schedule() is None  # k+1 belongs to the ended epoch: wait for it
    events = core.skipped(k1, 1)
    [f] = finished(events)
    assert f.req.rid == 1 and f.req.reason == "error" and f.kv_tokens == []
    assert core.reqs[2].n_sched == 0 and core.reqs[2].n_done == 0
    again = core.schedule()
    assert again.rids == [2] and again.step.epoch == 1 and again.step.entries[0].pos0 == 0


def test_one_request_whose_output_cannot_be_handled_ends_alone():
    core = SchedulerCore(n_batch=64, depth=1)
    core.add(req(1, 0, prompt=2, n_predict=5))
    core.add(req(2, 1, prompt=2, n_predict=5))
    plan = core.schedule()
    core.reqs[1].text = None  # a broken text state: handling its sample raises
    events = core.update(plan, out_for(plan))
    [f] = finished(events)
    assert f.req.rid == 1 and f.req.reason == "error"
    assert core.reqs[2].out == [8] and not core.reqs[2].ended


def test_results_must_come_back_in_submission_order():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0))
    k = core.schedule()
    k1 = core.schedule()
    with pytest.raises(ValueError):
        core.update(k1, out_for(k1))
    core.update(k, out_for(k))


def test_the_youngest_runnable_request_is_the_one_to_give_way():
    core = SchedulerCore(n_batch=64)
    core.add(req(1, 0))
    core.add(req(2, 1))
    assert core.youngest().rid == 2
    core.abort(2)
    assert core.youngest().rid == 1


def test_cells_held_for_a_page_move_are_their_own_record_released_by_whoever_made_them():
    """A reservation (MakeRoom) is not the slot's count: a slot telling its cells meanwhile
    does not erase it, and releasing it leaves exactly what the slot told (issue 19.8: a
    refused page.in left a false count that evicted other clients' caches)."""
    from actord.serving.steps.core import SchedulerCore

    core = SchedulerCore(n_batch=32, n_ctx=100)
    core.set_cells(0, 10)
    t = core.reserve(0, 60)
    assert core.held(0) == 60 and core.free_cells == 40
    core.set_cells(0, 0)  # the page-in was refused: the slot tells what it holds
    assert core.held(0) == 60  # still held until the mover is done
    core.release(t)
    assert core.held(0) == 0 and core.free_cells == 100
    t1, t2 = core.reserve(1, 30), core.reserve(1, 50)  # two movers racing for one slot
    core.set_cells(1, 30)  # the first landed
    core.release(t1)
    assert core.held(1) == 50
    core.release(t2)
    assert core.held(1) == 30 and core.free_cells == 70


def test_progress_events_report_each_prompt_piece_before_its_token_and_only_when_asked():
    from actord.serving.steps.records import Progress

    core = SchedulerCore(n_batch=8, depth=1)
    core.add(req(1, 0, prompt=20, n_predict=2, stream=True, progress=True))
    core.add(req(2, 1, prompt=20, n_predict=2))  # did not ask
    seen: list = []
    while core.reqs:
        plan = core.schedule()
        seen += [(type(e).__name__, e.req.n_done if isinstance(e, Progress) else e.rid) for e in
                 core.update(plan, out_for(plan)) if isinstance(e, (Progress, Delta))]
    # request 1's prompt in pieces (request 2's share the batch), each reported once, the last
    # before the token it sampled; decode steps and request 2 report nothing.
    assert [x for x in seen if x[0] == "Progress"] == [("Progress", 8), ("Progress", 16), ("Progress", 20)]
    assert seen.index(("Progress", 20)) < seen.index(("Delta", 1))
    assert core._n_progress == 0  # drained: no per-step look any more


# -- twins: requests that arrive together with one prefix prefill it once --------------


def twin_req(rid: int, slot: int, prompt: list[int], lineage=((), ""), **kw) -> Request:
    return Request(rid=rid, slot=slot, seq=slot, tokens=list(prompt), n_prompt=len(prompt), n_done=0, n_predict=2,
                   text=TextState([], False), lineage=lineage, **kw)


SHARED = list(range(200, 264))  # 64 tokens both prompts open with


def test_a_request_arriving_beside_its_twin_waits_and_takes_the_shared_prefix_once():
    core = SchedulerCore(n_batch=512, depth=1)
    core.add(twin_req(1, 0, SHARED + [1, 2, 3]))
    core.add(twin_req(2, 1, SHARED + [4, 5]))
    assert core.reqs[2].twin == (1, 64)
    plan = core.schedule()
    assert [e.seq for e in plan.step.entries] == [0]  # the twin prefills; the other waits
    assert core.twins_ready() == []  # nothing is in the KV yet
    core.update(plan, out_for(plan))
    [(r, src, n)] = core.twins_ready()
    assert (r.rid, src, n) == (2, 0, 64)
    assert core.twin_shared(r, ok=True) == 64
    assert (r.n_done, r.n_cached) == (64, 64)
    plan = core.schedule()
    entry = next(e for e in plan.step.entries if e.seq == 1)
    assert entry.pos0 == 64 and entry.tokens == [4, 5]  # only its own tokens are prefilled
    assert core.shared_cells() == 64  # the shared cells are charged once


def test_a_refused_share_or_a_twin_that_ended_leaves_the_request_to_prefill_it_all():
    core = SchedulerCore(n_batch=512, depth=1)
    core.add(twin_req(1, 0, SHARED + [1]))
    core.add(twin_req(2, 1, SHARED + [2]))
    core.update(p := core.schedule(), out_for(p))
    [(r, _, _)] = core.twins_ready()
    assert core.twin_shared(r, ok=False) == 0 and r.twin is None and r.n_done == 0
    assert next(e for e in core.schedule().step.entries if e.seq == 1).pos0 == 0

    core = SchedulerCore(n_batch=512, depth=1)
    core.add(twin_req(1, 0, SHARED + [1]))
    core.add(twin_req(2, 1, SHARED + [2]))
    core.abort(1)
    assert core.twins_ready() == [] and core.reqs[2].twin is None
    assert core.schedule().step.entries[0].seq == 1


def test_no_twin_across_lineages_or_below_the_minimum_or_for_a_request_that_holds_cells():
    core = SchedulerCore(n_batch=512, depth=1)
    core.add(twin_req(1, 0, SHARED + [1]))
    core.add(twin_req(2, 1, SHARED + [2], lineage=((), "another-scope")))
    core.add(twin_req(3, 2, SHARED + [3], lineage=(((1, 1.0),), "")))
    core.add(twin_req(4, 3, SHARED[:20] + [4] * 30))
    core.add(twin_req(5, 4, SHARED + [5], lineage=None))
    assert [core.reqs[i].twin for i in (2, 3, 4, 5)] == [None] * 4
    r = twin_req(6, 5, SHARED + [6])
    r.n_done = 10  # its own cells: a share would replace them under another request's links
    core.add(r)
    assert r.twin is None


def test_a_page_move_waiting_behind_a_slots_request_holds_its_room_while_the_request_runs():
    """A restore asked of a slot that runs a request waits behind it (the slot defers it);
    its room counts from the ask, so no other request takes those cells meanwhile and the
    move never over-commits the cache when it lands (simulation seed 181)."""
    core = SchedulerCore(n_batch=32, n_ctx=100)
    core.add(req(1, 0, prompt=20))
    running = core.held(0)
    t = core.reserve(0, 70)  # the move's room, held as the request runs
    assert core.held(0) == 70 and core.free_cells == 30
    core.reserve(1, 30)
    assert core.free_cells == 0  # a second mover gets only what is left beside it
    core.release(t)
    assert core.held(0) == running


def test_a_repeat_holds_its_kept_last_prompt_cell_until_its_step_runs_and_reports_it_if_aborted():
    # MEMO_REUSE (StepEntry.memo): the slot kept the prompt's last cell, the KV holds all 4
    core = SchedulerCore(n_batch=8, n_ctx=64, depth=1)
    core.add(req(1, 0, prompt=4, pos0=3, memo=J.MEMO_REUSE))
    assert core.held(0) == 4 and core.free_cells == 60
    ended = finished(core.abort(1))
    assert [e.kv_tokens for e in ended] == [[100, 101, 102, 103]]  # the kept cell is reported, not lost
    assert core.held(0) == 4


def test_a_repeats_entry_is_its_kept_cell_marked_for_reuse_and_then_it_runs_as_any():
    core = SchedulerCore(n_batch=8, n_ctx=64, depth=1)
    core.add(req(1, 0, prompt=4, pos0=3, n_predict=2, memo=J.MEMO_REUSE))
    plan = core.schedule()
    e = plan.step.entries[0]
    assert (e.tokens, e.pos0, e.sample, e.memo) == ([103], 3, True, J.MEMO_REUSE)
    assert core.held(0) == 4
    ended = finished(core.update(plan, out_for(plan)) + run_to_end(core))
    assert ended[0].kv_tokens[:4] == [100, 101, 102, 103] and len(ended[0].kv_tokens) == 5


def test_a_page_move_into_a_slot_may_fill_only_the_cells_that_slot_alone_holds():
    # slot 1's first 40 cells are slot 2's (a share): replacing slot 1's sequence frees 5
    core = SchedulerCore(n_batch=32, n_ctx=256)
    core.set_cells(0, 51)
    core.set_cells(1, 45)
    core.set_cells(2, 130)
    core.link(1, 2, 0, 0, 40)
    assert core.free_cells == 256 - 51 - 45 - 130 + 40
    assert core.room_for(1) == 256 - 51 - 130  # not free + 45: the 40 shared would be counted twice
    assert core.room_for(0) == core.free_cells + 51


def test_a_page_moves_room_stays_held_while_a_request_that_took_the_slot_first_runs():
    # The room was granted, then a request addressed to the slot took it before the move
    # arrived: the move waits behind the request, its room held beyond the request's cells.
    core = SchedulerCore(n_batch=32, n_ctx=200)
    t = core.reserve(0, 116)
    core.add(req(1, 0, prompt=58, n_predict=2))
    assert core.free_cells == 200 - 116 and core.room_for(1) == 200 - 116
    run_to_end(core)
    assert core.held(0) == 116  # the move still to come
    core.release(t)
    assert core.held(0) == 59  # the prompt and the one sample fed (the last is never fed)


# ---- giving a slot up (policy/yielding.py) ---------------------------------------------


def test_a_request_giving_way_writes_what_its_steps_in_flight_sampled_and_its_kv_holds_all_but_the_last():
    core = SchedulerCore(n_batch=8, depth=3)
    core.add(req(1, 0, prompt=4, n_predict=50, stream=True, yieldable=True))
    for _ in range(4):  # the prompt, then decodes three deep
        while core.schedule() is not None:
            pass
        plan = core.inflight[0]
        core.update(plan, out_for(plan))
    in_flight = len(core.inflight)
    assert in_flight and core.reqs[1].out
    events = core.give_way(1)
    assert not finished(events) and core.schedule() is None  # nothing past the steps in flight
    for _ in range(in_flight):
        plan = core.inflight[0]
        events += core.update(plan, out_for(plan))
    [f] = finished(events)
    r = f.req
    assert r.reason == "yield" and f.kv_tokens == r.tokens[:r.n_prompt] + r.out[:-1]


def test_a_request_giving_way_steps_on_one_token_at_a_time_until_its_text_ends_whole():
    core = SchedulerCore(n_batch=8, depth=1)
    core.add(req(1, 0, prompt=4, n_predict=50, stream=True, yieldable=True))
    euro = "€".encode()
    plan = core.schedule()
    core.update(plan, out_for(plan, pieces={0: euro[:1]}))  # the first token is a character's first byte
    assert not finished(core.give_way(1))
    plan = core.schedule()
    events = core.update(plan, out_for(plan, pieces={0: euro[1:]}))
    [f] = finished(events)
    assert f.req.reason == "yield" and "".join(e.text for e in events if isinstance(e, Delta)) == "€"
