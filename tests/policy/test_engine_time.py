"""A step's engine time split between its requests, and the budget past which one ends
(actord/policy/engine_time.py)."""

from __future__ import annotations

import pytest

from actord.policy.engine_time import past_budget, step_shares


def test_decoding_is_shared_by_tokens_fed_and_sampling_between_the_samplers():
    # A 30-token prompt piece beside two decodes: decoding by tokens, sampling by samplers.
    shares = step_shares(3.2, 0.2, [30, 1, 1], [False, True, True])
    assert shares == pytest.approx([3.0, 0.2, 0.2])
    assert sum(shares) == pytest.approx(3.4)  # the whole step is charged, no more


def test_a_step_that_fed_or_sampled_nothing_is_shared_equally():
    assert step_shares(1.0, 0.5, [0, 0], [False, False]) == pytest.approx([0.75, 0.75])
    assert step_shares(1.0, 0.0, [], []) == []


def test_a_request_is_past_its_budget_only_beyond_it_and_never_without_one():
    assert not past_budget(10.0, 10.0) and past_budget(10.01, 10.0)
    assert not past_budget(1e9, 0.0)  # 0: no budget
