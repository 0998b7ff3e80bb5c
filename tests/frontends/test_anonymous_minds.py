"""The minds the Responses front makes for anonymous conversations are bounded (issue 33,
actord/frontends/http/openai/anonymous.py): past `--http-anonymous-minds`, the least
recently used one's RAM page and page file are dropped and counted, so anonymous traffic
never grows the page store or the page folder without bound; a forgotten conversation's
next turn still answers (it starts fresh); a named mind is never forgotten."""

from __future__ import annotations

import httpx
import pytest

from actord.frontends.client import Client
from actord.policy.lru import DaemonMinds
from tests.frontends.test_openai_http import KEY, _metric, front_on_tiny

H = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    yield from front_on_tiny(tmp_path_factory, "--http-anonymous-minds", "2")


def _create(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": "m", "max_output_tokens": 3, **body}, headers=H,
                      timeout=120)


def test_anonymous_minds_past_the_bound_are_forgotten_oldest_first_and_counted(daemon):
    sock, url = daemon
    first = [_create(url, input=f"conversation {i}: hello").json() for i in range(6)]
    assert all(r["status"] in ("completed", "incomplete") for r in first)
    named = _create(url, input="a named one", user="ada")
    assert named.status_code == 200
    for i in range(2):
        assert _create(url, input=f"later {i}").status_code == 200  # pushes more anonymous ones out
    with Client(str(sock), timeout=60) as c:
        pages = [p["page"] for p in c.call("page.list")]
    anonymous = [p for p in pages if p.startswith("r-")]
    assert len(anonymous) <= 2, pages  # at most the bound (the rest sit in slots)
    assert any(not p.startswith("r-") for p in pages) or len(pages) <= 2  # the named mind is kept, never forgotten
    assert _metric(url, "http_anonymous_minds_evicted_total") >= 4
    again = _create(url, input="and then?", previous_response_id=first[0]["id"])  # its mind was forgotten
    assert again.status_code == 200 and again.json()["status"] in ("completed", "incomplete")


def test_the_rule_counts_minds_and_bytes_and_keeps_the_one_just_used():
    m = DaemonMinds(max_minds=3, max_bytes=100)
    assert m.touch("a", 10) == [] and m.touch("b", 10) == [] and m.touch("c", 10) == []
    assert m.touch("d", 10) == ["a"]  # past the count: the least recently used
    assert m.touch("b", 10) == [] and m.touch("e", 10) == ["c"]  # b was used again: c is the oldest
    assert m.touch("f", 95) == ["d", "b", "e"]  # past the bytes: as many as it takes, never f itself
    assert len(m) == 1 and m.held == 95
    m.keep("d", 0)  # one in a slot: listed again, first in line
    assert m.touch("g", 10) == ["d", "f"] and m.held == 10
