"""A reasoning budget in the pure scheduling core (actord/serving/steps/thought.py), driven by
hand-built step outputs and no model.

What these pin: a thought is forced closed after exactly its budget of tokens, the forced
tokens fed together before the next sample and sampling going on after them; no sample is
planned blind past the one that forces (the overlap stays honest at any depth); a thought
opens at the start marker's tokens and ends at the end marker's (a new one gets a new
budget); a character is never cut; n_predict and stop strings bound the forced tokens too;
and a request without a budget plans exactly as before.
"""

from __future__ import annotations

import pytest

from actord.engine import jobs as J
from actord.vocabulary.types import ThoughtBudget
from actord.serving.steps.core import SchedulerCore
from actord.serving.steps.records import Delta, Finished
from actord.serving.steps.text import ends_whole
from actord.serving.steps.thought import Thought, _advance
from tests.serving.test_sched_core import req

START, END, MSG = [50, 51], [60, 61], [70]
FORCED = MSG + END
PIECES = [b" ok", b"</", b"think>"]


def budget(n: int, opened: bool = True, start=START) -> Thought:
    return Thought(ThoughtBudget(budget=n, start=start, end=END, forced=FORCED, pieces=PIECES, opened=opened))


def drive(core: SchedulerCore, script: list[int], pieces: dict[int, bytes] | None = None):
    """Run to the end, each sampling entry sampling the script's next token (then 9s); the
    plans' entries and the events."""
    pieces = pieces or {}
    it = iter(script)
    plans, events = [], []
    while core.reqs:
        while (plan := core.schedule()) is not None:
            plans.append([(e.pos0, list(e.tokens), e.sample, e.feed_last) for e in plan.step.entries])
        plan = core.inflight[0]
        outs = []
        for e in plan.step.entries:
            t = next(it, 9) if e.sample else 0
            outs.append(J.EntryOut(seq=e.seq, token=t, piece=pieces.get(t, b"x")) if e.sample
                        else J.EntryOut(seq=e.seq))
        events += core.update(plan, J.StepOut(step=0, entries=outs, n_tokens=1, t_decode_ms=0.0, t_sample_ms=0.0))
    return plans, events


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_a_thought_is_closed_after_exactly_its_budget_and_sampling_goes_on(depth):
    core = SchedulerCore(n_batch=64, depth=depth)
    r = req(1, 0, prompt=4, n_predict=9, think=budget(3))
    core.add(r)
    plans, events = drive(core, [1, 2, 3, 4, 5, 6])
    [fin] = [e for e in events if isinstance(e, Finished)]
    assert fin.req.out == [1, 2, 3, *FORCED, 4, 5, 6] and fin.req.reason == "length"
    assert fin.req.text.text == "xxx ok</think>xxx"
    # The third thought token and the forced ones go in together, and the next sample follows them.
    assert [(4 + 2, [3, *FORCED], True, False)] in plans
    assert all(not (fl and pos0 == 4 + 3) for p in plans for pos0, _, _, fl in p)  # nothing sampled blind after 3
    assert fin.kv_tokens == r.tokens[:fin.req.n_done]


def test_the_overlap_never_plans_a_sample_past_the_one_that_forces():
    core = SchedulerCore(n_batch=64, depth=4)
    r = req(1, 0, prompt=2, n_predict=50, think=budget(5))
    core.add(r)
    for _ in range(12):
        while core.schedule() is not None:
            pass
        # Output so far + samples in flight never goes past the forcing point unforced.
        assert FORCED[0] in r.out or len(r.out) + r.samples <= 5
        plan = core.inflight[0]
        core.update(plan, J.StepOut(step=0, entries=[J.EntryOut(seq=0, token=1, piece=b"x") if e.sample else
                                                     J.EntryOut(seq=0) for e in plan.step.entries],
                                    n_tokens=1, t_decode_ms=0.0, t_sample_ms=0.0))
    assert r.out[:5 + len(FORCED)] == [1] * 5 + FORCED


def test_a_thought_opens_at_the_start_marker_and_a_natural_end_rearms_the_budget():
    core = SchedulerCore(n_batch=64, depth=2)
    # before; <start> 2 tokens </end> (the end's first token counts, as llama.cpp counts it);
    # text; <start> 4 tokens -> forced
    script = [1, *START, 2, 3, *END, 4, *START, 5, 6, 7, 8]
    core.add(req(1, 0, prompt=3, n_predict=len(script) + len(FORCED), think=budget(4, opened=False)))
    _, events = drive(core, script)
    [fin] = [e for e in events if isinstance(e, Finished)]
    assert fin.req.out == [*script, *FORCED]


def test_a_counted_out_token_that_leaves_a_character_unfinished_is_let_finish():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=3, n_predict=12, think=budget(2)))
    _, events = drive(core, [1, 2, 3, 4], pieces={1: b"a", 2: "é".encode()[:1], 3: "é".encode()[1:]})
    [fin] = [e for e in events if isinstance(e, Finished)]
    assert fin.req.out[:3 + len(FORCED)] == [1, 2, 3, *FORCED]
    assert fin.req.text.text.startswith("aé ok</think>")


def test_n_predict_bounds_the_forced_tokens_too():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=3, n_predict=4, think=budget(2)))
    _, events = drive(core, [1, 2])
    [fin] = [e for e in events if isinstance(e, Finished)]
    assert fin.req.out == [1, 2, *FORCED[:2]] and fin.req.reason == "length"


def test_a_stop_string_in_the_forced_text_ends_the_request_as_a_sampled_one_would():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=3, n_predict=20, think=budget(2), stop=["ok<"], stream=True))
    _, events = drive(core, [1, 2])
    [fin] = [e for e in events if isinstance(e, Finished)]
    assert fin.req.reason == "stop" and fin.req.text.text == "xx "
    streamed = "".join(e.text for e in events if isinstance(e, Delta)) + fin.req.tail
    assert streamed == "xx "


def test_forced_tokens_stream_as_one_delta_with_certain_logprobs():
    core = SchedulerCore(n_batch=64, depth=2)
    core.add(req(1, 0, prompt=3, n_predict=5, think=budget(1), stream=True, logprobs=[]))
    _, events = drive(core, [1, 2])
    deltas = [e for e in events if isinstance(e, Delta)]
    assert [d.text for d in deltas] == ["x", " ok</think>", "x"]
    assert [lp.logprob for lp in deltas[1].logprobs] == [0.0] * len(FORCED)
    [fin] = [e for e in events if isinstance(e, Finished)]
    assert [lp.token for lp in fin.req.logprobs] == fin.req.out


def test_a_request_without_a_budget_plans_as_before_and_a_budgeted_one_does_not_speculate():
    core = SchedulerCore(n_batch=64, depth=2)
    plain = req(1, 0, prompt=3, n_predict=5)
    core.add(plain)
    assert plain.think is None and plain.feed_until == 5
    spec = req(2, 1, prompt=3, n_predict=5, spec=4, think=budget(3))
    core.add(spec)
    assert spec.spec == 0 and core._n_spec == 0


def test_the_marker_watch_follows_overlapping_starts():
    seq = [1, 1, 2]
    m = 0
    for t in [1, 1, 1, 2]:
        m = _advance(seq, m, t)
    assert m == 3
    assert _advance([1, 2, 1, 3], 3, 2) == 2  # "1 2 1" + 2 -> "1 2"
    assert ends_whole(b"a") and not ends_whole("€".encode()[:2]) and ends_whole("€".encode())
