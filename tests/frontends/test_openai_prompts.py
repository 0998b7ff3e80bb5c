"""OpenAI completions with a list of prompts (issue 27.5), with the official `openai` client
against `actord serve --http` (its own process, 4 slots, --max-n 4): each prompt served as
its own request in one answer, prompt p's choice i at index p x n + i (whole and streamed),
usage summed, token lists as prompts, and prompts x n over --max-n a 400 naming `prompt`."""

from __future__ import annotations

import openai
import pytest

from tests.frontends.test_openai_http import front_on_tiny, openai_client

PROMPTS = ["Once upon a time", "The weather today is"]
GREEDY = dict(model="m", max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    yield from front_on_tiny(tmp_path_factory, "--slots", "4", "--max-n", "4", chat=False)


@pytest.fixture
def client(front) -> openai.OpenAI:
    return openai_client(front[1], timeout=120)


@pytest.fixture
def singles(client) -> list[openai.types.Completion]:
    return [client.completions.create(prompt=p, **GREEDY) for p in PROMPTS]


def test_two_prompts_are_two_choices_each_the_prompts_own_answer(client, singles):
    r = client.completions.create(prompt=PROMPTS, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_with_n_prompt_p_choice_i_is_index_p_times_n_plus_i(client, singles):
    r = client.completions.create(prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # Greedy: each choice is its prompt's answer, so the index says which prompt it is.
    assert [c.text for c in r.choices] == [singles[p].choices[0].text for p in (0, 0, 1, 1)]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)  # each prompt once
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)


def test_streamed_chunks_carry_the_same_indexes_and_one_usage_chunk(client, singles):
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for ch in client.completions.create(prompt=PROMPTS, n=2, stream=True, stream_options={"include_usage": True},
                                        **GREEDY):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == sorted(finish) == [0, 1, 2, 3]
    assert [texts[i] for i in range(4)] == [singles[p].choices[0].text for p in (0, 0, 1, 1)]
    assert usage is not None and usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)


def test_a_list_of_token_lists_is_several_prompts_and_a_flat_list_of_ints_is_one(client):
    assert [c.index for c in client.completions.create(prompt=[[5, 6, 7], [8]], **GREEDY).choices] == [0, 1]
    one = client.completions.create(prompt=[5, 6, 7], **GREEDY)
    assert len(one.choices) == 1 and one.usage.prompt_tokens == 3
    assert len(client.completions.create(prompt=["just one"], **GREEDY).choices) == 1


def test_prompts_times_n_over_max_n_is_a_400_naming_prompt(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=["a", "b", "c"], n=2, **GREEDY)
    assert e.value.param == "prompt" and "--max-n" in e.value.message and "6" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=["a", {"x": 1}], **GREEDY)  # type: ignore[list-item]
    assert e.value.param == "prompt"


def test_one_bad_prompt_fails_the_whole_request_and_the_daemon_serves_on(client, singles):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=["fine", [10 ** 9]], **GREEDY)  # a token past the vocabulary
    assert e.value.status_code == 400, e.value.message
    assert "out of range" in e.value.message
    r = client.completions.create(prompt=PROMPTS, **GREEDY)
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
