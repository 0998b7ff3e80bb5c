"""The Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}) with the official
`openai` client against `actord serve --http` on the generated tiny chat model: a string
or items as input, instructions, previous_response_id continuing the conversation in its
mind (the second turn's prompt served from the mind's cache), the streaming events, function
calls through the Hermes-style template, and every refused field a 400 naming it."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.frontends.test_openai_http import KEY, front_on_tiny

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    for _, url in front_on_tiny(tmp_path_factory, "--http-responses-max", "8", tools=True):
        yield url


@pytest.fixture
def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_previous_response_id_continues_in_the_mind_from_its_cache(client):
    r1 = client.responses.create(model="m", input="hello world", instructions="be brief", max_output_tokens=6,
                                 temperature=0)
    assert r1.status == "incomplete" and r1.incomplete_details.reason == "max_output_tokens"
    assert r1.output_text and r1.usage.output_tokens == 6 and r1.id.startswith("resp_")
    assert re.fullmatch(r"msg_[0-9a-f]{24}", r1.output[0].id)  # OpenAI's ids: msg_..., not msg-...
    r2 = client.responses.create(model="m", input="and then", instructions="be brief", max_output_tokens=6,
                                 temperature=0, previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id
    # Everything of turn 1 (its prompt and reply, but the reply's last, unfed token) came
    # from the mind's cache: only the new user turn was processed.
    cached = r2.usage.input_tokens_details.cached_tokens
    assert cached >= r1.usage.input_tokens + r1.usage.output_tokens - 1 > 0
    assert r2.usage.input_tokens - cached <= len("<|im_end|>\n<|im_start|>user\nand then<|im_end|>\n<|im_start|>assistant\n") + 1
    # The same conversation sent whole (no previous_response_id) lands in the same mind.
    whole = client.responses.create(model="m", instructions="be brief", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": [{"type": "output_text", "text": r1.output_text}]},
        {"role": "user", "content": [{"type": "input_text", "text": "and then"}]}])
    assert whole.output_text == r2.output_text and whole.usage.input_tokens_details.cached_tokens > 0


def test_a_stored_response_is_retrieved_and_deleted(client):
    r = client.responses.create(model="m", input="keep me", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage.output_tokens == 3
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    gone = client.responses.create(model="m", input="not kept", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", previous_response_id=gone.id, max_output_tokens=2)
    assert e.value.param == "previous_response_id"


def test_the_store_drops_the_oldest_response_past_its_bound(client):
    first = client.responses.create(model="m", input="first", max_output_tokens=2)
    for i in range(8):  # --http-responses-max 8
        client.responses.create(model="m", input=f"filler {i}", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_streamed_events_add_up_to_the_whole_response(client):
    whole = client.responses.create(model="m", input="stream me", max_output_tokens=8, temperature=0, store=False)
    events = list(client.responses.create(model="m", input="stream me", max_output_tokens=8, temperature=0,
                                          stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == [e for e in events if e.type == "response.output_text.done"][0].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip(client, stream):
    kw = dict(model="m", input="weather in Paris?", tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        r = events[-1].response
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].arguments == r.output[0].arguments
    else:
        r = client.responses.create(**kw)
    assert r.status == "completed"
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    assert re.fullmatch(r"fc_[0-9a-f]{24}", call.id)
    again = client.responses.create(model="m", previous_response_id=r.id, tools=[WEATHER], max_output_tokens=4,
                                    temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                           "output": '{"temp": 21}'}])
    assert again.output_text and again.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens


def test_structured_output_through_text_format(client):
    r = client.responses.create(model="m", input="a json", max_output_tokens=200, temperature=0, text={
        "format": {"type": "json_schema", "name": "x", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}}})
    assert isinstance(json.loads(r.output_text)["ok"], bool)


@pytest.mark.parametrize("body,param", [
    ({"background": True}, "background"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": ""}, "input"),
])
def test_a_refused_responses_field_is_a_400_naming_it(front, body, param):
    r = httpx.post(front + "/v1/responses", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "m", "input": "hi", "max_output_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("body,note", [
    ({"reasoning": {"effort": "high"}}, "reasoning.effort 'high' ignored"),
    ({"include": ["message.output_text.logprobs"]}, "include: 'message.output_text.logprobs' dropped"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]: hosted tool 'web_search' dropped"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
                {"role": "user", "content": "hi"}]}, "input[0]: reasoning item dropped"),
])
def test_what_agents_send_beyond_function_tools_is_answered_and_named_in_the_degraded_header(front, body, note):
    r = httpx.post(front + "/v1/responses", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "m", "input": "hi", "max_output_tokens": 2, **body}, timeout=60)
    assert r.status_code == 200, r.text
    assert note in r.headers["x-actord-degraded"]
    plain = httpx.post(front + "/v1/responses", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "m", "input": "hi", "max_output_tokens": 2}, timeout=60)
    assert "x-actord-degraded" not in plain.headers


def test_input_tokens_counts_the_prompt_a_response_would_process(front, client):
    body = {"model": "m", "input": "count me in", "instructions": "be brief", "tools": [WEATHER]}
    counted = httpx.post(front + "/v1/responses/input_tokens", json=body, headers={"Authorization": f"Bearer {KEY}"},
                         timeout=60).json()
    assert counted["object"] == "response.input_tokens"
    r = client.responses.create(**body, max_output_tokens=2, temperature=0)
    assert counted["input_tokens"] == r.usage.input_tokens > 0
    bad = httpx.post(front + "/v1/responses/input_tokens", json={"model": "m", "input": "x",
                     "previous_response_id": "resp_nope"}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "previous_response_not_found"


def test_a_streamed_response_reports_prompt_progress_and_timings_when_asked(front):
    events = []
    body = {"model": "m", "input": "tell me a long story " * 20, "max_output_tokens": 4, "temperature": 0,
            "stream": True, "return_progress": True, "timings_per_token": True}
    with httpx.stream("POST", front + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in events if "prompt_progress" in e)
    assert progress[-1]["processed"] == progress[-1]["total"] > 0
    assert all(p["processed"] >= p["cache"] for p in progress)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("prompt_per_second" in e["timings"] for e in deltas)
    done = events[-1]
    assert done["type"] in ("response.completed", "response.incomplete") and done["timings"]["predicted_n"] == 4
    # Not asked: none of it.
    plain = httpx.post(front + "/v1/responses", json={**body, "return_progress": False, "timings_per_token": False},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text
    assert "prompt_progress" not in plain and '"timings"' not in plain


def test_the_unprefixed_route_calls_a_cut_response_completed_as_llama_server_does(front):
    body = {"model": "m", "input": "hello", "max_output_tokens": 2, "temperature": 0}
    h = {"Authorization": f"Bearer {KEY}"}
    v1 = httpx.post(front + "/v1/responses", json=body, headers=h, timeout=60).json()
    bare = httpx.post(front + "/responses", json=body, headers=h, timeout=60).json()
    assert v1["status"] == "incomplete" and v1["incomplete_details"] == {"reason": "max_output_tokens"}
    assert bare["status"] == "completed" and bare["incomplete_details"] is None
