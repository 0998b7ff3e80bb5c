"""Speculative decoding in the pure core, with hand-built step outputs and no model.

What these pin: acceptance is the longest prefix where the target's samples equal the
draft, plus the target's own token, and stops at an end token; a speculating request's
entry carries the draft's catch-up and k tokens, bounded by n_predict, the context and the
batch; `update` advances n_done by what was accepted and takes the draft's extent from the
engine; a request ending on an accepted token hands back exactly the tokens its KV holds; a
speculating request steps at depth 1 and holds the pipeline while its acceptance is due;
the draft catches up on a long gap in pieces within the draft's batch.
"""

from __future__ import annotations

from actord.policy import speculation as S
from actord.serving.steps.core import SchedulerCore
from actord.serving.steps.records import Delta, Finished, Request
from actord.serving.steps.text import TextState
from actord.engine import jobs as J


def req(rid: int, slot: int, prompt: int = 4, n_predict: int = 8, spec: int = 3, **kw) -> Request:
    return Request(rid=rid, slot=slot, seq=slot, tokens=list(range(100, 100 + prompt)), n_prompt=prompt,
                   n_done=kw.pop("pos0", 0), n_predict=n_predict, text=TextState([], True), spec=spec, **kw)


def sampled(e: J.StepEntry, toks: list[int], eog: int | None = None, draft_n: int | None = None) -> J.EntryOut:
    """What the engine answers for a drafted entry whose target sampled `toks`."""
    end = e.draft_pos0 + len(e.draft_tokens)
    a = len(toks) - 1
    dn = draft_n if draft_n is not None else (min(end + e.draft - 1, e.pos0 + len(e.tokens) + a) if e.draft else end)
    return J.EntryOut(seq=e.seq, token=toks[0], piece=b"a", eog=toks[0] == eog, draft_n=dn,
                      drafted=e.draft, more=[J.Sampled(token=t, piece=b"b", eog=t == eog) for t in toks[1:]])


def out(plan, per_entry) -> J.StepOut:
    return J.StepOut(step=0, entries=per_entry, n_tokens=sum(plan.fed), t_decode_ms=0.0, t_sample_ms=0.0)


def test_accept_is_the_longest_matching_prefix_plus_the_targets_own_token():
    seen = []

    def sample(i: int) -> int:
        seen.append(i)
        return [5, 6, 9, 8][i]

    assert S.accept([5, 6, 7], sample, lambda t: False) == [5, 6, 9]
    assert seen == [0, 1, 2]  # nothing sampled past the first mismatch: the chain's state is the plain one
    assert S.accept([5, 6, 9], lambda i: [5, 6, 9, 8][i], lambda t: False) == [5, 6, 9, 8]
    assert S.accept([4], lambda i: 5, lambda t: False) == [5]
    assert S.accept([5, 6], lambda i: [5, 6, 7][i], lambda t: t == 5) == [5]  # an end token ends it


def test_draft_length_bounds():
    assert S.draft_len(4, n_out=0, n_predict=100, end=11, n_ctx=0, room=64) == 4
    assert S.draft_len(4, n_out=7, n_predict=10, end=11, n_ctx=0, room=64) == 2  # a+1 tokens at most 3 left
    assert S.draft_len(4, n_out=0, n_predict=100, end=11, n_ctx=14, room=64) == 2  # 11+k+1 <= 14
    assert S.draft_len(4, n_out=0, n_predict=100, end=11, n_ctx=0, room=3) == 3
    assert S.draft_len(4, n_out=9, n_predict=10, end=11, n_ctx=0, room=64) == 0
    assert S.catch_up(3, 10, 4) == (3, 7) and S.catch_up(3, 10, 64) == (3, 10)


def test_a_speculating_request_drafts_after_its_sampled_token_and_advances_by_what_was_accepted():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=4, n_predict=8, spec=3))
    plan = core.schedule()
    [e] = plan.step.entries
    assert e.tokens == [100, 101, 102, 103] and e.draft_tokens == e.tokens and e.draft_pos0 == 0
    assert e.draft == 3  # drafts after the prompt's last token too
    assert plan.fed == [7]
    assert core.schedule() is None  # depth 1 while its acceptance is due
    ev = core.update(plan, out(plan, [sampled(e, [7, 8])]))  # one of three accepted, then 8
    r = core.reqs[1]
    assert r.n_done == 4 + 1 and r.tokens[4:] == [7, 8] and r.out == [7, 8]
    assert r.draft_done == 5  # the draft decoded the prompt and d1, d1 accepted
    assert [d.token for d in ev if isinstance(d, Delta)] == [7, 8]
    plan = core.schedule()
    [e] = plan.step.entries
    assert (e.tokens, e.pos0, e.draft_tokens, e.draft_pos0, e.draft) == ([8], 5, [8], 5, 3)
    assert r.n_drafted == 3 and r.n_accepted == 1 and r.n_spec_steps == 1


def test_draft_length_never_passes_n_predict_or_the_context():
    core = SchedulerCore(n_batch=64, n_ctx=12, depth=1)
    core.add(req(1, 0, prompt=4, n_predict=5, spec=4))
    plan = core.schedule()
    assert plan.step.entries[0].draft == 4
    core.update(plan, out(plan, [sampled(plan.step.entries[0], [7, 8, 9])]))  # 3 out, 2 to go
    plan = core.schedule()
    [e] = plan.step.entries
    assert e.draft == 1  # a+1 <= 2 tokens
    ev = core.update(plan, out(plan, [sampled(e, [10, 11])]))
    [f] = [x for x in ev if isinstance(x, Finished)]
    assert f.req.reason == "length" and f.req.out == [7, 8, 9, 10, 11]
    core = SchedulerCore(n_batch=64, n_ctx=12, depth=1)
    core.add(req(2, 1, prompt=8, n_predict=50, spec=4))
    plan = core.schedule()
    assert plan.step.entries[0].draft == 3  # 8 + 3 + 1 <= n_ctx 12


def test_a_request_ending_on_an_accepted_token_hands_back_every_token_its_kv_holds():
    core = SchedulerCore(n_batch=64, depth=1)
    core.add(req(1, 0, prompt=4, n_predict=20, spec=3, pos0=3))
    plan = core.schedule()
    [e] = plan.step.entries
    assert e.draft == 3
    ev = core.update(plan, out(plan, [sampled(e, [7, 2, 9], eog=2)]))  # 7, then EOS accepted, then 9
    [f] = [x for x in ev if isinstance(x, Finished)]
    assert f.req.reason == "eos" and f.req.out == [7]
    # The KV holds the prompt's last token and the two accepted drafts (7, EOS).
    assert f.kv_tokens == [100, 101, 102, 103, 7, 2] and core.cells[0] == 6
    assert f.draft_n <= len(f.kv_tokens)


def test_speculation_holds_the_pipeline_and_the_others_step_with_it():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=2, n_predict=10, spec=0))
    core.add(req(2, 1, prompt=2, n_predict=10, spec=2))
    p1 = core.schedule()
    assert [e.seq for e in p1.step.entries] == [0, 1]
    assert core.schedule() is None  # seq 1's acceptance is due: no step k+1 (seq 0 would feed_last)
    core.update(p1, out(p1, [J.EntryOut(seq=0, token=5, piece=b"x"), sampled(p1.step.entries[1], [6])]))
    p2 = core.schedule()
    assert [(e.seq, e.feed_last, e.draft) for e in p2.step.entries] == [(0, False, 0), (1, False, 2)]


def test_a_cold_draft_catches_up_in_pieces_within_the_drafts_batch():
    core = SchedulerCore(n_batch=16, depth=1)
    core.add(req(1, 0, prompt=40, n_predict=4, spec=2, pos0=39))  # the target holds 39, the draft nothing
    plan = core.schedule()
    [e] = plan.step.entries
    assert (e.tokens, e.draft_pos0, len(e.draft_tokens), e.draft) == ([139], 0, 16, 0)  # no draft until caught up
    core.update(plan, out(plan, [J.EntryOut(seq=0, token=7, piece=b"x", draft_n=16)]))
    r = core.reqs[1]
    assert r.n_done == 40 and r.draft_done == 16
    plan = core.schedule()
    [e] = plan.step.entries
    assert (e.draft_pos0, len(e.draft_tokens), e.draft) == (16, 16, 0)
    core.update(plan, out(plan, [J.EntryOut(seq=0, token=8, piece=b"x", draft_n=32)]))
    plan = core.schedule()
    [e] = plan.step.entries
    assert (e.draft_pos0, e.draft_tokens, e.draft) == (32, r.tokens[32:42], 1)  # caught up: it drafts


def test_the_engines_extent_corrects_the_cores_count():
    core = SchedulerCore(n_batch=64, depth=1)
    core.add(req(1, 0, prompt=4, n_predict=8, spec=3, pos0=3, draft_done=3))
    plan = core.schedule()
    [e] = plan.step.entries
    core.update(plan, out(plan, [sampled(e, [7], draft_n=0)]))  # the draft had lost its state
    assert core.reqs[1].draft_done == 0
    plan = core.schedule()
    [e] = plan.step.entries
    assert (e.draft_pos0, e.draft_tokens, e.draft) == (0, core.reqs[1].tokens[:5], 3)


def test_a_skipped_speculating_step_gives_its_cells_back():
    core = SchedulerCore(n_batch=64, n_ctx=100, depth=1)
    core.add(req(1, 0, prompt=4, n_predict=8, spec=3))
    plan = core.schedule()
    assert core.free_cells == 100 - 7
    core.unschedule(plan)
    assert core.free_cells == 100 and core.reqs[1].draft_done == 0


def test_a_draft_that_keeps_missing_pauses_then_probes_and_one_hit_ends_the_pause():
    assert [S.pause_after(m) for m in range(10)] == [0, 0, 0, 0, 2, 4, 8, 16, 32, 32]
    core = SchedulerCore(n_batch=64, depth=1)
    core.add(req(1, 0, prompt=4, n_predict=100, spec=2, pos0=3, draft_done=3))
    drafted = []
    for i in range(14):
        plan = core.schedule()
        [e] = plan.step.entries
        drafted.append(e.draft)
        hit = i == 6
        core.update(plan, out(plan, [sampled(e, [7, 8] if hit and e.draft else [9]) if e.draft or e.draft_tokens
                                     else J.EntryOut(seq=0, token=9, piece=b"x")]))
    # four misses (pause 2), two plain steps (nothing caught up), a probe that hits, then
    # four misses and a pause again
    assert drafted == [2, 2, 2, 2, 0, 0, 2, 2, 2, 2, 2, 0, 0, 2]
    r = core.reqs[1]
    assert r.spec_misses == 5 and r.spec_pause == 4 and r.n_accepted == 1
