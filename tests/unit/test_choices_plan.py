"""The pure parts of n choices (actord/choices.py): which choice runs where, the seeds,
the usage arithmetic, the bound on n, and the HTTP merge of n results into one answer."""

from __future__ import annotations

import pytest

from actord.api import CompletionResult, Timings
from actord.choices import check_n, choice_seed, merge_usage, plan, with_index
from actord.errors import InvalidParams


def result(n_out: int, slot: int = 0, n_prompt: int = 40, cached: int = 0, stop: str = "length") -> CompletionResult:
    return CompletionResult(content="x" * n_out, tokens=list(range(n_out)), n_prompt_tokens=n_prompt,
                            n_prompt_processed=1, n_cached=cached, slot=slot, stop_reason=stop,
                            timings=Timings(prompt_ms=0, predicted_ms=0, prompt_per_second=0, predicted_per_second=0))


def test_each_choice_gets_a_fork_then_the_rest_queue_round_robin_with_choice_0_last():
    assert plan(1, 2, []) == {2: [0]}
    assert plan(3, 0, [1, 2]) == {0: [0], 1: [1], 2: [2]}
    assert plan(3, 1, []) == {1: [1, 2, 0]}
    assert plan(5, 0, [3]) == {0: [2, 4, 0], 3: [1, 3]}
    every = plan(8, 0, [1, 2])
    assert sorted(i for ids in every.values() for i in ids) == list(range(8)) and every[0][-1] == 0


def test_choice_i_samples_with_seed_plus_i_modulo_2_32():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(0xFFFFFFFF, 1) == 0 and choice_seed(-1, 1) == 0


def test_usage_counts_the_prompt_once_and_sums_the_completions():
    u = merge_usage([result(5, cached=39), result(7), result(0)])
    assert u == {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52, "cached_tokens": 39}


@pytest.mark.parametrize("n", [0, -1, 9, True, 2.5, "3", None])
def test_n_outside_one_to_the_bound_is_a_400_naming_n(n):
    with pytest.raises(InvalidParams) as e:
        check_n(n, 8)
    assert e.value.data["param"] == "n" and e.value.http_status == 400


def test_a_choices_chunks_carry_its_index():
    got: list[dict] = []
    sink = with_index(got.append, 2)
    sink({"content": "a"})
    assert got == [{"content": "a", "index": 2}] and with_index(None, 1) is None
