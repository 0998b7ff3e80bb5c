"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) with the official
`anthropic` client and raw httpx against `actord serve --http` (its own process) on the
generated tiny model with a Hermes-style tool template: a whole and a streamed message agree
under greedy sampling, the stream's events come in Anthropic's order, a tool round trip,
count_tokens counts the prompt the turn processes, stop sequences are named, structured
output, bad fields are 400s in Anthropic's shape that change nothing, the key is read from
x-api-key, and a client that hangs up mid-stream ends its generation."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.frontends.test_openai_http import KEY, _metric, _wait_metric, front_on_tiny

WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}
GREEDY = {"temperature": 0}  # the newest SDK no longer sends sampling fields itself


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    for _, url in front_on_tiny(tmp_path_factory, tools=True):
        yield url


@pytest.fixture
def client(front) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=front, api_key=KEY, max_retries=0, timeout=120)


def _post(front: str, body: dict, headers: dict | None = None, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(front + path, json=body, headers={"x-api-key": KEY} if headers is None else headers, timeout=60)


def _requests(front: str) -> float:
    """Every request the daemon ran, whatever its outcome."""
    text = httpx.get(front + "/metrics", headers={"x-api-key": KEY}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("requests_total{"))


def _sse(text: str) -> list[dict]:
    out = []
    for ev in text.split("\n\n"):
        if ev.strip():
            kind, data = ev.split("\n")
            d = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {d['type']}"
            out.append(d)
    return out


def test_a_whole_and_a_streamed_message_agree_and_the_stream_keeps_anthropics_order(client, front):
    kw = dict(model="m", max_tokens=8, system="be brief", messages=[{"role": "user", "content": "hello there"}],
              extra_body=GREEDY)
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "m"
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s if e.type != "text"]  # "text": the SDK's own event, beside the deltas
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    # message_start's usage is the prompt's, as the final one says.
    events = _sse(_post(front, {**kw["extra_body"], **{k: v for k, v in kw.items() if k != "extra_body"},
                                "stream": True}).text)
    start, delta = events[0]["message"]["usage"], events[-2]["usage"]
    assert start["input_tokens"] + start["cache_read_input_tokens"] == \
        delta["input_tokens"] + delta["cache_read_input_tokens"] == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 0
    assert start["output_tokens"] == 0 and delta["output_tokens"] == 8 and "timings" not in events[-1]


def test_count_tokens_counts_the_prompt_the_turn_processes(client):
    for extra in ({}, {"tools": [WEATHER]}, {"system": [{"type": "text", "text": "sys"}]}):
        msgs = [{"role": "user", "content": "count me please"}]
        n = client.messages.count_tokens(model="m", messages=msgs, **extra).input_tokens
        r = client.messages.create(model="m", max_tokens=1, messages=msgs, **extra)
        assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_round_trip(client, stream):
    kw = dict(model="m", max_tokens=120, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "weather in Paris?"}], extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kw) as s:
            starts = [e.content_block.type for e in s if e.type == "content_block_start"]
            m = s.get_final_message()
        assert starts[-1] == "tool_use"
    else:
        m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"}
    again = client.messages.create(model="m", max_tokens=4, tools=[WEATHER], extra_body=GREEDY, messages=[
        *kw["messages"], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 21}'}]}])
    assert again.content[0].type == "text" and again.stop_reason in ("end_turn", "max_tokens")


def test_stop_sequences_name_the_one_that_ended_the_message(client):
    msgs = [{"role": "user", "content": "say something"}]
    text = client.messages.create(model="m", max_tokens=12, messages=msgs, extra_body=GREEDY).content[0].text
    stop = text[4:7]
    m = client.messages.create(model="m", max_tokens=12, messages=msgs, stop_sequences=["\x01never", stop],
                               extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_structured_output_follows_output_config_format(client):
    m = client.messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": "json"}],
                               extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": {
                                   "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                   "additionalProperties": False}}}})
    assert isinstance(json.loads(m.content[0].text)["ok"], bool)


@pytest.mark.parametrize("body,named", [
    ({"messages": []}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": ["x"] * 33}, "stop"),
    ({"stop_sequences": ["x" * 300]}, "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}]},
     "image input is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
    ({"tools": [WEATHER, WEATHER]}, "listed twice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": "x"}}, "thinking.budget_tokens"),
    ({"mcp_servers": [{"type": "url"}]}, "mcp_servers"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id"),
])
def test_a_bad_field_is_a_400_in_anthropics_shape_and_changes_nothing(front, client, body, named):
    before = _requests(front)
    r = _post(front, {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert named in err["error"]["message"], err
    assert _requests(front) == before  # nothing ran
    assert client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "ok"}]).usage


def test_the_key_is_taken_from_x_api_key_or_bearer(front):
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert _post(front, body).status_code == 200
    assert _post(front, body, {"authorization": f"Bearer {KEY}"}).status_code == 200
    assert _post(front, body, {"x-api-key": KEY}, "/v1/messages/count_tokens").status_code == 200
    for headers in ({"x-api-key": "wrong"}, {}, {"authorization": "Bearer wrong", "x-api-key": KEY}):
        r = _post(front, body, headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=front, api_key="wrong", max_retries=0).messages.create(**body)
    # Every route takes it, as llama-server's do.
    r = httpx.post(front + "/v1/chat/completions", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200


def test_metadata_user_id_names_a_mind_that_keeps_the_conversation(client):
    meta = {"user_id": "user_abc_session_1"}
    first = [{"role": "user", "content": "remember the word apricot"}]
    r1 = client.messages.create(model="m", max_tokens=4, messages=first, metadata=meta, extra_body=GREEDY)
    r2 = client.messages.create(model="m", max_tokens=4, metadata=meta, extra_body=GREEDY, messages=[
        *first, {"role": "assistant", "content": r1.content[0].text}, {"role": "user", "content": "and now?"}])
    assert r2.usage.cache_read_input_tokens >= r1.usage.input_tokens + r1.usage.cache_read_input_tokens


def test_a_client_that_hangs_up_mid_stream_ends_its_generation(front):
    name = 'requests_total{outcome="cancelled"}'
    gone = 'http_client_gone_total{phase="generation"}'
    before, gone_before = _metric(front, name), _metric(front, gone)
    body = {"model": "m", "max_tokens": 3800, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "go on and on"}]}
    with httpx.Client(timeout=30) as c, c.stream("POST", front + "/v1/messages", json=body,
                                                 headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]  # a few events arrive, then the client hangs up
        assert got[0] == "event: message_start"
    _wait_metric(front, name, before)
    assert _wait_metric(front, gone, gone_before) == gone_before + 1
    assert _metric(front, "requests_in_flight") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_cut_by_max_tokens_shows_no_markup(front, stream):
    body = {"model": "m", "max_tokens": 6, "tools": [WEATHER], "tool_choice": {"type": "any"}, **GREEDY,
            "messages": [{"role": "user", "content": "weather in Paris?"}], "stream": stream}
    r = _post(front, body)
    assert r.status_code == 200, r.text
    if stream:
        events = _sse(r.text)
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        stop = events[-2]["delta"]["stop_reason"]
    else:
        text, stop = "".join(b.get("text", "") for b in r.json()["content"]), r.json()["stop_reason"]
    assert stop == "max_tokens" and text == "" and "tool" not in r.text.replace("tool_use", "")
