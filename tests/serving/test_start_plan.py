"""The placer's start plan (serving/start_plan.py plan_mind_step): a pure function over what
the page store, the files' index and the moves tried so far said about a mind."""

from hypothesis import given, strategies as st

from actord.serving.kv_index import MIN_SHARE
from actord.serving.start_plan import MindFound, plan_mind_step


def test_her_own_page_comes_before_a_file_or_a_base():
    step = plan_mind_step(MindFound(page=500, file=True, base=400))
    assert (step.how, step.n) == ("page_in", 500)


def test_her_file_comes_before_a_base_once_the_slot_made_way():
    assert plan_mind_step(MindFound(file=True, base=400)).how == "make_way"
    assert plan_mind_step(MindFound(file=True, base=400, made_way=True)).how == "restore"


def test_a_base_is_taken_only_where_it_saves_min_share_tokens():
    assert (plan_mind_step(MindFound(base=MIN_SHARE, made_way=True)).how,
            plan_mind_step(MindFound(base=MIN_SHARE, made_way=True)).n) == ("base", MIN_SHARE)
    step = plan_mind_step(MindFound(base=MIN_SHARE - 1, made_way=True))
    assert (step.how, step.slot_clears) == ("fresh", False)


def test_an_empty_slot_with_nothing_to_bring_takes_the_request_with_no_move_first():
    step = plan_mind_step(MindFound(slot_mind=False))
    assert (step.how, step.slot_clears) == ("fresh", True)
    # A base or a file to bring needs the slot empty first: it may hold an unnamed sequence.
    assert plan_mind_step(MindFound(slot_mind=False, base=MIN_SHARE)).how == "make_way"
    assert plan_mind_step(MindFound(slot_mind=False, file=True)).how == "make_way"


def test_a_slot_holding_a_mind_makes_way_before_a_fresh_start():
    assert plan_mind_step(MindFound()).how == "make_way"
    assert plan_mind_step(MindFound(made_way=True)).how == "fresh"


@given(page=st.none() | st.integers(0, 10_000), file=st.booleans(), base=st.integers(0, 10_000),
       slot_mind=st.booleans())
def test_the_plan_always_starts_her_within_two_steps_as_the_moves_succeed(page, file, base, slot_mind):
    """Carried out with every move succeeding, the plan starts her (page in, restore, base or
    fresh) after at most one make-way, and never restores or starts from a base before the
    slot is empty."""
    found = MindFound(page=page, file=file, base=base, slot_mind=slot_mind)
    step = plan_mind_step(found)
    if step.how == "make_way":
        step = plan_mind_step(MindFound(page=page, file=file, base=base, slot_mind=slot_mind, made_way=True))
        assert step.how in {"restore", "base", "fresh"} and not step.slot_clears
    assert step.how in {"page_in", "restore", "base", "fresh"}
    if step.how == "fresh" and step.slot_clears:
        assert not slot_mind and not file and base < MIN_SHARE and page is None
