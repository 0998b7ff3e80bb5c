"""Reasoning over HTTP (actord.chat.reasoning) on the tiny model with DeepSeek-R1's real
template, which opens the thought in its generation prompt: the tiny model never closes it,
so its whole reply is the thought unless a budget closes it. `reasoning_content` in the answer and as stream deltas,
`reasoning_format: none` leaving it in the content, thinking turned off per request (the
prompt then closes the thought, and the reply is content), and /apply-template showing both."""

from __future__ import annotations

import httpx
import pytest

from tests.chat.test_reasoning import R1, TEMPLATES
from tests.frontends.test_openai_http import KEY, _start, _stop, openai_client

H = {"authorization": f"Bearer {KEY}"}
MSGS = [{"role": "user", "content": "What is 1+1?"}]


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    from actord.testing.models import write_tiny_llama

    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-r1.gguf", seed=1))
    proc, _, url = _start(model, tmp_path_factory.mktemp("d"), "--api-key", KEY,
                          "--chat-template-file", str(TEMPLATES / f"{R1}.jinja"))
    try:
        yield url
    finally:
        _stop(proc)


def test_the_thought_comes_back_in_reasoning_content_whole_and_streamed(front):
    oa = openai_client(front)
    r = oa.chat.completions.create(model="m", messages=MSGS, max_tokens=12, temperature=0)
    msg = r.choices[0].message.model_dump()
    raw = oa.chat.completions.create(model="m", messages=MSGS, max_tokens=12, temperature=0,
                                     extra_body={"reasoning_format": "none"}).choices[0].message
    assert msg["reasoning_content"] and msg["content"] == ""
    assert msg["reasoning_content"] == raw.content.strip() and not hasattr(raw, "reasoning_content") or \
        raw.model_dump().get("reasoning_content") is None
    chunks = list(oa.chat.completions.create(model="m", messages=MSGS, max_tokens=12, temperature=0, stream=True))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""


def test_thinking_off_per_request_closes_the_thought_and_the_reply_is_content(front):
    body = {"messages": MSGS, "max_tokens": 6, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(front + "/v1/chat/completions", json=body, headers=H, timeout=60).json()
    msg = r["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"]
    on = httpx.post(front + "/apply-template", json={"messages": MSGS}, headers=H, timeout=60).json()["prompt"]
    off = httpx.post(front + "/apply-template", json={"messages": MSGS, "chat_template_kwargs": {
        "enable_thinking": False}}, headers=H, timeout=60).json()["prompt"]
    assert on.endswith("<think>\n") and off == on + "</think>"
    budget0 = httpx.post(front + "/v1/chat/completions", json={**body, "chat_template_kwargs": {},
                                                              "reasoning_budget": 0}, headers=H, timeout=60).json()
    assert budget0["choices"][0]["message"]["content"] == msg["content"]


def test_a_budget_closes_the_thought_with_its_message_and_the_reply_goes_on_whole_and_streamed(front):
    body = {"messages": MSGS, "max_tokens": 20, "temperature": 0, "reasoning_budget_tokens": 3,
            "reasoning_budget_message": " Enough."}
    msg = httpx.post(front + "/v1/chat/completions", json=body, headers=H, timeout=60).json()["choices"][0]["message"]
    assert msg["reasoning_content"].endswith(" Enough.") and msg["content"]
    oa = openai_client(front)
    chunks = list(oa.chat.completions.create(model="m", messages=MSGS, max_tokens=20, temperature=0, stream=True,
                                             extra_body={"reasoning_budget": 3, "reasoning_budget_message": " Enough."}))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]


def test_a_bad_reasoning_field_is_a_400_naming_it(front):
    for field, value in (("reasoning_format", "deepseek-legacy"), ("reasoning_budget", -2), ("reasoning_budget_message", 3),
                         ("chat_template_kwargs", [1])):
        r = httpx.post(front + "/v1/chat/completions", json={"messages": MSGS, field: value}, headers=H, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_apply_template_takes_tools_and_renders_them_as_a_chat_turn_would(front):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    plain = httpx.post(front + "/apply-template", json={"messages": MSGS}, headers=H, timeout=60)
    with_tools = httpx.post(front + "/apply-template", json={"messages": MSGS, "tools": [weather]}, headers=H,
                            timeout=60)
    assert plain.status_code == with_tools.status_code == 200
    assert "get_weather" in with_tools.json()["prompt"] and "get_weather" not in plain.json()["prompt"]
    assert with_tools.json()["prompt"].endswith("<think>\n")
    bad = httpx.post(front + "/apply-template", json={"messages": MSGS, "tools": [{"type": "web"}]}, headers=H,
                     timeout=60)
    assert bad.status_code == 400
