"""The prefix index answers the holder of the longest block-aligned common prefix, as a scan
over every holder would, and never matches across gene sets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from actord.policy.prefix_index import BLOCK, PrefixIndex, block_keys


def aligned_common(a: list[int], b: list[int]) -> int:
    """The oracle: tokens two lists share from their start, cut down to whole blocks."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n // BLOCK * BLOCK


GENES = ((3, 1.0),)


def scan(held: dict[str, list[int]], query: list[int]) -> int:
    return max((aligned_common(t, query) for t in held.values()), default=0)


# Few distinct tokens and lists built from shared stems, so long common prefixes happen.
stems = st.lists(st.integers(0, 2), min_size=0, max_size=5 * BLOCK)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), stems), max_size=6), stems)
def test_longest_is_the_longest_common_block_prefix_a_scan_finds(entries, query):
    idx, held = PrefixIndex(), {}
    base = [7] * (2 * BLOCK)
    for i, (cut, tail) in enumerate(entries):
        toks = base[: cut * BLOCK // 2] + tail
        idx.add(f"k{i}", toks, GENES)
        held[f"k{i}"] = toks
    q = base[:BLOCK] + query
    key, n = idx.longest(q, GENES)
    assert n == scan(held, q)
    if n:
        assert aligned_common(held[key], q) == n  # the key answered holds that prefix
    else:
        assert key is None


@settings(max_examples=60, deadline=None)
@given(st.lists(stems, min_size=1, max_size=5), st.data())
def test_removed_holders_are_never_answered(lists, data):
    idx = PrefixIndex()
    for i, t in enumerate(lists):
        idx.add(i, t)
    gone = data.draw(st.sets(st.integers(0, len(lists) - 1)))
    for i in gone:
        idx.remove(i)
    left = {str(i): t for i, t in enumerate(lists) if i not in gone}
    for q in lists:
        key, n = idx.longest(q)
        assert n == scan(left, q) and (key is None or key not in gone)


def test_a_prefix_under_other_genes_never_matches():
    idx = PrefixIndex()
    toks = list(range(4 * BLOCK))
    idx.add("a", toks, GENES)
    assert idx.longest(toks, GENES) == ("a", 4 * BLOCK)
    assert idx.longest(toks, ((3, 0.5),)) == (None, 0)
    assert idx.longest(toks, ()) == (None, 0)
    assert block_keys(toks, ((1, 1.0), (2, 0.5))) == block_keys(toks, ((2, 0.5), (1, 1.0)))  # a set


def test_partial_blocks_and_the_excluded_holder_do_not_count():
    idx = PrefixIndex()
    toks = list(range(BLOCK + 5))
    idx.add("a", toks)
    assert idx.longest(toks) == ("a", BLOCK)
    assert idx.longest(toks, exclude="a") == (None, 0)
    assert idx.longest(toks[: BLOCK - 1]) == (None, 0)
    idx.add("b", toks)
    assert idx.longest(toks, exclude="a") == ("b", BLOCK)
    idx.add("a", [9] * BLOCK)  # re-added: its old blocks go
    assert idx.longest(toks, exclude="b") == (None, 0) and len(idx) == 2


def test_the_candidates_for_a_whole_holder_are_those_whose_last_full_block_the_query_has():
    idx = PrefixIndex()
    toks = list(range(5 * BLOCK))
    idx.add("long", toks[: 4 * BLOCK])
    idx.add("short", toks[: 2 * BLOCK])
    idx.add("mid-block", toks[: 2 * BLOCK + 9])  # keyed by its 2 full blocks; its tail the caller compares
    assert idx.wholes(toks)[0] == "long" and set(idx.wholes(toks)) == {"long", "short", "mid-block"}
    assert set(idx.wholes(toks[: 3 * BLOCK + 7])) == {"short", "mid-block"}  # "long" is not all there
    assert idx.longest(toks[: 3 * BLOCK + 7]) == ("long", 3 * BLOCK)
    idx.remove("short")
    idx.remove("mid-block")
    assert idx.wholes(toks[: 3 * BLOCK]) == []
