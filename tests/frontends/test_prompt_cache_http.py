"""An OpenAI client that names no mind and resends its conversation each turn (as the SDK's
users do) resumes its state on the next turn although other conversations took the slots
between its turns (the prompt cache: policy/prompt_cache.py), and the usage says so."""

from __future__ import annotations

import pytest

from tests.frontends.test_openai_http import _metric, front_on_tiny, openai_client

SYSTEM = "You are a careful assistant. You answer every question in one short sentence. " * 6


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    yield from front_on_tiny(tmp_path_factory)


def test_unnamed_conversations_over_fewer_slots_each_resume_their_state_and_report_it_cached(daemon):
    _, url = daemon
    client = openai_client(url)
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {k}"}] for k in range(3)]
    first = []
    for msgs in chats:  # three conversations over two slots: the first one's state leaves its slot
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        msgs.append({"role": "user", "content": "and then?"})
        first.append(r.usage)
    for msgs, before in zip(chats, first):
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens >= before.prompt_tokens
    assert _metric(url, 'prompt_cache_turns_total{found="yes"}') == 3
