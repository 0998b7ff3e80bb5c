"""`n` choices through the OpenAI HTTP front (actord/chat/choices.py), with the official `openai`
client against `actord serve --http` (its own process, 4 slots) on the generated tiny chat
model: n=3 whole and streamed, chat and completions; seeded determinism (choice i is the
n=1 answer for seed + i); usage counting the prompt once, the prompt processed once; logprobs
per choice; n over `--max-n` refused; a mind continuing from choice 0; and a client hanging
up mid-stream cancelling all n (every slot idle afterwards)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from actord.frontends.client import Client
from tests.frontends.test_openai_http import KEY, _metric, front_on_tiny, openai_client

AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    yield from front_on_tiny(tmp_path_factory, "--slots", "4", "--max-n", "5")


@pytest.fixture
def client(front) -> openai.OpenAI:
    return openai_client(front[1], timeout=120)


def _msgs(tag: str) -> list[dict]:
    return [{"role": "user", "content": f"Tell me about {tag}, in a few words please."}]


def _cold(sock) -> None:
    """Every slot erased: a comparison of seeded samples starts from the same cache state (a
    prefix another prompt cached can differ in its logits' last bits: choices.py)."""
    with Client(str(sock), timeout=30) as c:
        for i in c.call("slot.list"):
            c.call("slot.erase", {"slot": i["id"]})


def _slots_idle(sock) -> list[dict]:
    with Client(str(sock), timeout=30) as c:
        for _ in range(3000):  # bounded poll: the daemon notices a hang-up on its own time
            infos = c.call("slot.list")
            if all(i["state"] == "idle" and not i["deferred"] for i in infos):
                return infos
            c.call("health")
        raise AssertionError(f"slots still busy: {infos}")


def test_three_chat_choices_each_its_own_seeded_sample_and_the_prompt_once(client, front):
    sock, url = front
    _cold(sock)
    before = _metric(url, "prompt_tokens_processed_total")
    r = client.chat.completions.create(model="m", messages=_msgs("cats"), n=3, max_tokens=12, temperature=1.0,
                                       seed=11)
    after = _metric(url, "prompt_tokens_processed_total")
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3 and all(c.finish_reason in ("stop", "length") for c in r.choices)
    singles = []
    for i in range(3):
        _cold(sock)
        singles.append(client.chat.completions.create(model="m", messages=_msgs("cats"), max_tokens=12,
                                                      temperature=1.0, seed=11 + i))
    assert texts == [s.choices[0].message.content for s in singles]  # choice i: seed + i
    u = r.usage
    assert u.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt once
    assert u.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # One prefill (the prompt but its last token, less what the cache held), then one token per choice.
    assert u.prompt_tokens_details.cached_tokens == 0  # a cold cache
    assert after - before == u.prompt_tokens - 1 + 3
    _cold(sock)
    again = client.chat.completions.create(model="m", messages=_msgs("cats"), n=3, max_tokens=12, temperature=1.0,
                                           seed=11)
    assert [c.message.content for c in again.choices] == texts


def test_three_streamed_chat_choices_interleave_by_index_with_one_usage_chunk(client, front):
    kw = dict(model="m", messages=_msgs("dogs"), n=3, max_tokens=16, temperature=0.8, seed=5)
    _cold(front[0])
    whole = client.chat.completions.create(**kw)
    _cold(front[0])
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, roles, reasons = ["", "", ""], [None] * 3, [None] * 3
    for ch in chunks[:-1]:
        [c] = ch.choices  # one choice per chunk
        texts[c.index] += c.delta.content or ""
        roles[c.index] = roles[c.index] or c.delta.role
        if c.finish_reason:
            assert reasons[c.index] is None
            reasons[c.index] = c.finish_reason
    assert roles == ["assistant"] * 3
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    last = chunks[-1]
    assert last.choices == [] and sum(1 for ch in chunks if ch.usage is not None) == 1
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)


def test_completions_choices_with_logprobs_whole_and_streamed(client, front):
    kw = dict(model="m", prompt="Once upon a time", n=3, max_tokens=8, temperature=1.0, seed=3, logprobs=2)
    _cold(front[0])
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2] and len({c.text for c in whole.choices}) == 3
    for c in whole.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens)
        assert all(len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert whole.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in whole.choices)
    texts, tokens = ["", "", ""], [[], [], []]
    _cold(front[0])
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens if c.logprobs else []
    assert texts == [c.text for c in whole.choices]
    assert tokens == [c.logprobs.tokens for c in whole.choices]
    _cold(front[0])
    one = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5)
    assert one.choices[0].text == whole.choices[2].text


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("n", [6, 0, -1])
def test_n_outside_one_to_max_n_is_a_400_naming_n(client, route, n):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model="m", messages=_msgs("x"), n=n, max_tokens=2)
        else:
            client.completions.create(model="m", prompt="x", n=n, max_tokens=2)
    assert e.value.param == "n" and "n must be" in e.value.message


def test_a_mind_continues_from_choice_0(client, front):
    msgs = _msgs("the sea")
    r = client.chat.completions.create(model="m", messages=msgs, n=3, max_tokens=10, temperature=1.0, seed=2,
                                       user="n-mind")
    first = r.choices[0].message.content
    nxt = client.chat.completions.create(
        model="m", messages=msgs + [{"role": "assistant", "content": first}, {"role": "user", "content": "more"}],
        max_tokens=4, temperature=0, user="n-mind")
    # Choice 0's turn was remembered and its slot holds it: only the new messages are processed.
    n0 = 10 if r.choices[0].finish_reason == "length" else 1
    assert nxt.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens + n0 - 1
    other = client.chat.completions.create(
        model="m", messages=msgs + [{"role": "assistant", "content": r.choices[1].message.content},
                                    {"role": "user", "content": "more"}], max_tokens=4, temperature=0, user="n-mind")
    assert other.usage.prompt_tokens_details.cached_tokens < nxt.usage.prompt_tokens_details.cached_tokens


def test_a_client_hanging_up_mid_stream_cancels_every_choice(front):
    sock, url = front
    body = {"model": "m", "messages": _msgs("a long story"), "n": 3, "max_tokens": 3000, "temperature": 1.0,
            "stream": True}
    cancelled0 = _metric(url, 'requests_total{outcome="cancelled"}')
    seen: set[int] = set()
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ch = json.loads(line[6:])
                    if ch["choices"] and ch["choices"][0]["delta"].get("content"):
                        seen.add(ch["choices"][0]["index"])
                if len(seen) == 3:
                    break  # leaving the block closes the connection mid-stream
    assert seen == {0, 1, 2}
    infos = _slots_idle(sock)
    assert all(i["state"] == "idle" for i in infos)
    assert _metric(url, 'requests_total{outcome="cancelled"}') - cancelled0 == 3
    assert _metric(url, "predicted_tokens_total") < 9000
