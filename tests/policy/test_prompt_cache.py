"""The prompt cache's choice (policy/prompt_cache.py): a request runs as the mind whose last
prompt its own begins with, or parts from only in its last few tokens one turn on (the
deepest, then the exact, then the most recently used), never one busy with another turn,
never across gene sets or scopes; past the bound the oldest is found no more."""

from __future__ import annotations

import pytest

from actord.policy.prompt_cache import PromptCache
from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams
from actord.vocabulary.names import is_cache_mind

P = list(range(1, 97))  # three full blocks
G: tuple[tuple[int, float], ...] = ()


def ran(cache: PromptCache, prompt: list[int], genes=G, scope: str = "", n_bytes: int = 10) -> tuple[str, bool]:
    mind, found = cache.take(prompt, genes, scope)
    cache.done(mind, prompt, genes, scope)
    cache.minds.touch(mind, n_bytes)
    return mind, found


def test_the_next_turn_of_a_conversation_runs_as_the_mind_of_its_last_prompt():
    c = PromptCache(8, 1 << 30)
    a, found = ran(c, P)
    assert not found and is_cache_mind(a)
    b, found = ran(c, P[:40] + [500] * 60)  # parts from P inside its second block: another conversation
    assert b != a and not found
    assert c.take(P + [7, 8, 9], G, "") == (a, True)  # one turn on
    c.done(a, P + [7, 8, 9], G, "")
    assert c.take(P + [7, 8, 9], G, "") == (a, True)  # the same prompt again
    c.done(a, P + [7, 8, 9], G, "")
    assert c.take(P, G, "")[1] is False  # shorter than her last prompt: not hers


def test_a_last_prompt_that_parts_from_the_request_past_its_last_full_block_is_not_found():
    c = PromptCache(8, 1 << 30)
    a, _ = ran(c, P + [1, 2, 3])  # three blocks and three tokens the index does not key
    assert c.take(P + [1, 2, 4, 5], G, "")[0] != a


def test_a_next_turn_whose_template_renders_the_end_of_her_last_prompt_otherwise_finds_her():
    """DeepSeek R1's generation prompt ends `<think>\n`; the reply as history renders it does
    not begin so. The next turn parts from her last prompt in its final tokens, one turn on."""
    c = PromptCache(8, 1 << 30)
    think = [900, 901]
    a, _ = ran(c, P + [5, 6, 7] + think)
    reply, turn = [40, 41, 42], [902, 50, 51, 52, 53, 903, 904]
    assert c.take(P + [5, 6, 7] + reply + turn, G, "") == (a, True)
    c.done(a, P + [5, 6, 7] + reply + turn + think, G, "")
    b, found = c.take(P + [5, 6, 7] + [60, 61], G, "")  # parts in her end, but no longer: a sibling
    assert b != a and not found
    c.failed(b)
    x, _ = ran(c, P + list(range(200, 216)))
    far = P + list(range(200, 204)) + list(range(300, 340))  # parts 12 tokens from her end: not her turn
    assert c.take(far, G, "")[0] != x


def test_where_memory_cannot_be_cut_back_only_a_whole_last_prompt_finds_her():
    c = PromptCache(8, 1 << 30)
    a, _ = ran(c, P + [5, 6, 7, 900, 901])
    tail_parted = P + [5, 6, 7] + list(range(40, 60))
    assert c.take(tail_parted, G, "", parted=False)[1] is False
    b, _ = ran(c, P + [1])
    branched = P + [1] + list(range(600, 680))
    c.done(b, branched, G, "")
    assert c.take(branched[:-10] + [5] * 20, G, "", parted=False)[1] is False
    assert c.take(P + [5, 6, 7, 900, 901, 3], G, "", parted=False) == (a, True)


def test_at_equal_depth_an_exact_find_wins_over_one_that_parts_in_her_end():
    c = PromptCache(8, 1 << 30)
    exact, _ = ran(c, P + [5, 6, 7])
    parted, _ = ran(c, P + [5, 6, 7, 8, 9])  # taken last, and one turn on parts from it after P + [5, 6, 7]
    assert c.take(P + [5, 6, 7] + list(range(400, 420)), G, "") == (exact, True)


def test_a_conversation_branched_at_a_later_turn_runs_as_her_mind_and_a_sibling_never_does():
    c = PromptCache(8, 1 << 30)
    first = P + [5, 6, 7]
    a, _ = ran(c, first)
    reply1, reply2 = list(range(600, 680)), list(range(700, 740))
    second = first + reply1 + [8, 9]
    assert c.take(second, G, "") == (a, True)
    c.done(a, second, G, "")
    edited = first + reply1 + [10, 11, 12]  # her second message edited: parts inside her last prompt
    assert c.take(edited, G, "") == (a, True)
    c.done(a, edited, G, "")
    assert c.take(second + reply2 + [1], G, "") == (a, True)  # the other branch again: hers still
    c.done(a, second + reply2 + [1], G, "")
    sibling = first + [900] * 80  # her first prompt, then not her reply: another conversation
    b, found = c.take(sibling, G, "")
    assert b != a and not found
    c.failed(b)
    busy, _ = c.take(edited, G, "")
    assert busy == a
    assert c.take(first + reply1 + [13], G, "")[0] != a  # she is busy: never shared


def test_the_deepest_last_prompt_wins_then_the_most_recently_used():
    c = PromptCache(8, 1 << 30)
    ran(c, P[:64])
    deep, _ = ran(c, P)
    assert c.take(P + [1], G, "")[0] == deep
    c2 = PromptCache(8, 1 << 30)
    x, _ = ran(c2, P)
    y, found = c2.take(P + [2], G, "")  # the mind that ran P
    assert (y, found) == (x, True)
    z, found = c2.take(P + [3], G, "")  # x is busy: a new mind
    assert z != x and not found
    c2.done(x, P, G, "")
    c2.done(z, P, G, "")
    assert c2.take(P + [4], G, "")[0] == z  # both ran P: the one taken last


def test_a_mind_is_never_found_under_another_gene_set_or_scope():
    c = PromptCache(8, 1 << 30)
    a, _ = ran(c, P, genes=((1, 1.0),), scope="k:alice")
    assert c.take(P + [1], ((1, 1.0),), "k:eve")[0] != a
    assert c.take(P + [1], ((1, 0.5),), "k:alice")[0] != a
    assert c.take(P + [1], (), "k:alice")[0] != a
    assert c.take(P + [1], ((1, 1.0),), "k:alice") == (a, True)


def test_past_the_bound_the_oldest_is_forgotten_and_found_no_more():
    c = PromptCache(2, 1 << 30)
    minds = [ran(c, [k] + P)[0] for k in (1000, 1001)]
    mind, _ = c.take([1002] + P, G, "")
    c.done(mind, [1002] + P, G, "")
    assert c.minds.touch(mind, 10) == [minds[0]]
    assert c.take([1000] + P + [5], G, "")[1] is False
    assert c.take([1001] + P + [5], G, "") == (minds[1], True)
    c2 = PromptCache(8, 25)
    big = [ran(c2, [k] + P, n_bytes=10)[0] for k in (1, 2)]
    mind, _ = c2.take([3] + P, G, "")
    c2.done(mind, [3] + P, G, "")
    assert c2.minds.touch(mind, 10) == [big[0]]  # by bytes: 30 > 25


def test_a_failed_turn_leaves_a_found_mind_found_and_a_new_one_first_in_line_to_be_forgotten():
    c = PromptCache(2, 1 << 30)
    a, _ = ran(c, P)
    again, _ = c.take(P + [1], G, "")
    assert again == a
    c.failed(a)  # a client that hung up mid-turn: her state still begins with P
    assert c.take(P + [1], G, "") == (a, True)
    c.done(a, P + [1], G, "")
    new, found = c.take([9] + P, G, "")
    assert not found
    c.failed(new)
    assert c.take([9] + P + [1], G, "")[1] is False  # nothing indexed for it
    m, _ = c.take([8] + P, G, "")
    c.done(m, [8] + P, G, "")
    assert c.minds.touch(m, 10) == [new]  # listed first in line


def test_a_bad_prompt_cache_setting_is_refused_by_name():
    for bad in ({"prompt_cache_minds": -1}, {"prompt_cache_bytes": -1}, {"prompt_cache_min_tokens": 0}):
        with pytest.raises(InvalidParams, match=next(iter(bad))):
            Config(model="m.gguf", **bad).validate()
    Config(model="m.gguf", prompt_cache_minds=0).validate()  # off
