"""Tool calling through the OpenAI HTTP front, with the official `openai` client against
`actord serve --http` (its own process): a generated tiny model given a Hermes-style
template (HERMES_TOOL_TEMPLATE, whose `<tool_call>` markers are control tokens of its
vocab, as in Qwen's), and the real Gemma 3 270M, whose template knows no tools (the
generic, grammar-held JSON format).

The tiny model's weights are random: it has no wish to call anything. `required` and a
named function hold it to the call's grammar from the first token; `auto` leaves it free
until it writes the marker itself, which a +100 logit bias on the marker token makes it do
(then the lazy grammar takes over). Greedy decoding makes every answer repeatable, so a
streamed answer is compared with the whole one."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from actord.frontends.client import Client
from tests.frontends.test_openai_http import KEY, _start, _stop

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    from actord.testing.models import HERMES_TOOL_TEMPLATE, write_tiny_llama

    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-tools.gguf", seed=1,
                                 chat_template=HERMES_TOOL_TEMPLATE, control_tokens=("<tool_call>", "</tool_call>")))
    proc, sock, url = _start(model, tmp_path_factory.mktemp("d"), "--api-key", KEY)
    try:
        with Client(str(sock), timeout=30) as c:
            marker = c.call("tokenize", {"content": "<tool_call>", "parse_special": True})["tokens"]
        assert len(marker) == 1
        yield url, marker[0], sock
    finally:
        _stop(proc)


@pytest.fixture
def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _create(client: openai.OpenAI, stream: bool, **kw):
    """One chat completion; a streamed one is folded into (message, finish_reason, chunks)
    the way a client accumulates tool-call deltas (by index)."""
    if not stream:
        r = client.chat.completions.create(model="m", temperature=0, **kw)
        return r.choices[0].message, r.choices[0].finish_reason, r
    chunks = list(client.chat.completions.create(model="m", temperature=0, stream=True, **kw))
    text, calls, reason = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            got = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            got["id"] = tc.id or got["id"]
            got["name"] += (tc.function.name or "") if tc.function else ""
            got["arguments"] += (tc.function.arguments or "") if tc.function else ""
        reason = ch.choices[0].finish_reason or reason
    msg = openai.types.chat.ChatCompletionMessage(
        role="assistant", content=text or None,
        tool_calls=[{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for _, c in sorted(calls.items())] or None)
    return msg, reason, chunks


def _calls(msg) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]


def _weather_ok(args: dict) -> bool:
    return set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 8 \
        and args["unit"] in ("c", "f")


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_round_trip_on_a_hermes_template(client, stream):
    msg, reason, _ = _create(client, stream, messages=ASK, tools=[WEATHER], tool_choice="required",
                             parallel_tool_calls=False, max_tokens=200, user=f"hermes-required-{stream}")
    assert reason == "tool_calls"
    [(name, args)] = _calls(msg)
    assert name == "get_weather" and _weather_ok(args)
    assert msg.tool_calls[0].id.startswith("call_") and msg.content is None
    whole, _, first = _create(client, False, messages=ASK, tools=[WEATHER], tool_choice="required",
                              parallel_tool_calls=False, max_tokens=200)
    assert _calls(whole) == _calls(msg)  # streamed or not, greedy: the same call
    # The round trip: the call goes back with its result, and the model answers.
    history = ASK + [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp": 21}'}]
    again = client.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=6,
                                           temperature=0, user=f"hermes-required-{stream}")
    assert again.choices[0].message.content and not again.choices[0].message.tool_calls
    assert again.choices[0].finish_reason == "length"
    if not stream:
        # The call came back as sent: the mind's prompt + reply tokens were reused exactly,
        # so only the tool result and the new turn's header were processed.
        u1, u2 = first.usage, again.usage
        assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens + u1.completion_tokens - 1


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_call_when_the_model_writes_the_marker(client, front, stream):
    _, marker, _ = front
    bias = {str(marker): 100}
    msg, reason, chunks = _create(client, stream, messages=ASK, tools=[WEATHER], tool_choice="auto",
                                  parallel_tool_calls=False, max_tokens=200, logit_bias=bias)
    assert reason == "tool_calls"
    [(name, args)] = _calls(msg)
    assert name == "get_weather" and _weather_ok(args)  # the lazy grammar held the call once it began
    whole, _, _ = _create(client, False, messages=ASK, tools=[WEATHER], parallel_tool_calls=False,
                          max_tokens=200, logit_bias=bias)
    assert _calls(whole) == _calls(msg)
    if stream:
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert [d.index for d in deltas] == [0] and deltas[0].id and deltas[0].type == "function"
        assert deltas[0].function.name == "get_weather"


def test_auto_without_the_marker_answers_in_text(client):
    msg, reason, _ = _create(client, False, messages=ASK, tools=[WEATHER], max_tokens=8)
    assert msg.content and not msg.tool_calls and reason == "length"


def test_parallel_calls_come_back_as_several_tool_calls(client):
    msg, _, _ = _create(client, False, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=400)
    calls = _calls(msg)
    assert len(calls) >= 2 and all(n == "get_weather" and _weather_ok(a) for n, a in calls)
    assert len({c.id for c in msg.tool_calls}) == len(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_function(client, stream):
    msg, reason, _ = _create(client, stream, messages=ASK, tools=[WEATHER, ADD], parallel_tool_calls=False,
                             tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=120)
    [(name, args)] = _calls(msg)
    assert reason == "tool_calls" and name == "add" and set(args) == {"a", "b"}
    assert all(isinstance(v, int) and not isinstance(v, bool) for v in args.values())


def test_tool_choice_none_renders_no_tools_and_answers_text(client):
    none = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=4, temperature=0)
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=4, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls


def test_legacy_functions_answer_with_function_call(client):
    r = client.chat.completions.create(model="m", messages=ASK, functions=[WEATHER["function"]],
                                       function_call={"name": "get_weather"}, max_tokens=120, temperature=0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "function_call" and m.function_call.name == "get_weather"
    assert _weather_ok(json.loads(m.function_call.arguments)) and not m.tool_calls
    history = ASK + [{"role": "assistant", "content": None, "function_call": m.function_call.model_dump()},
                     {"role": "function", "name": "get_weather", "content": "sunny"}]
    again = client.chat.completions.create(model="m", messages=history, functions=[WEATHER["function"]],
                                           max_tokens=4, temperature=0)
    assert again.choices[0].message.content


def test_a_hosted_tool_is_dropped_and_named_in_the_degraded_header_as_on_responses(front):
    """Chat Completions answers a request offering a hosted tool (`web_search`: no local
    server runs one) as the Responses API does: the tool dropped, the rest served, and the
    drop named in X-Actord-Degraded; a request offering none carries no such header."""
    url = front[0] + "/v1/chat/completions"
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "m", "messages": ASK, "max_tokens": 2, "temperature": 0}
    r = httpx.post(url, headers=auth, json={**body, "tools": [{"type": "web_search"}, WEATHER]}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-actord-degraded"] == "tools[0]: hosted tool 'web_search' dropped: this server runs none"
    r = httpx.post(url, headers=auth, json={**body, "tools": [{"type": "custom", "custom": {"name": "patch"}}]},
                   timeout=120)
    assert r.status_code == 200 and "custom tool 'patch' dropped" in r.headers["x-actord-degraded"]
    plain = httpx.post(url, headers=auth, json={**body, "tools": [WEATHER]}, timeout=120)
    assert plain.status_code == 200 and "x-actord-degraded" not in plain.headers


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": ASK + [{"role": "tool", "content": "21"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "y",
                                                                        "tool_calls": [{"function": {}}]}]},
     "messages[1].tool_calls"),
])
def test_a_bad_tool_field_is_a_400_naming_it(client, body, param):
    body = {"messages": ASK, "max_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", **body)
    assert e.value.param == param, e.value.message
    ok = client.chat.completions.create(model="m", messages=ASK, max_tokens=2)  # nothing changed
    assert ok.usage.completion_tokens == 2


# -- Gemma 3 270M: the generic format ------------------------------------------------------

GEMMA_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def gemma(real_model, tmp_path_factory):
    from actord.testing.models import GEMMA3_CHAT_TEMPLATE

    d = tmp_path_factory.mktemp("gemma")
    template = d / "gemma.jinja"
    template.write_text(GEMMA3_CHAT_TEMPLATE)
    proc, _, url = _start(real_model, d / "d", "--api-key", KEY, "--chat-template-file", str(template))
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    finally:
        _stop(proc)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_gemma_generic_format_round_trip_required_then_auto(gemma, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg, reason, _ = _create(gemma, stream, messages=ask, tools=[GEMMA_WEATHER], tool_choice="required",
                             parallel_tool_calls=False, max_tokens=60, user=f"gemma-{stream}")
    assert reason == "tool_calls" and _calls(msg) == [("get_weather", {"city": "Paris"})]
    history = ask + [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                           "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    # Auto: after a call and its result in its history, the model calls again (a pretrained
    # 270M model follows the pattern it sees); the call parses the same streamed or not.
    again, reason, _ = _create(gemma, stream, messages=history, tools=[GEMMA_WEATHER],
                               parallel_tool_calls=False, max_tokens=60, user=f"gemma-{stream}")
    assert reason == "tool_calls" and _calls(again) == [("get_weather", {"city": "Paris"})]


@pytest.mark.slow
def test_gemma_generic_auto_on_a_fresh_conversation_may_answer_in_text(gemma):
    r = gemma.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi! How are you?"}],
                                      tools=[GEMMA_WEATHER], max_tokens=12, temperature=0)
    m = r.choices[0].message
    assert m.content and not m.content.startswith("{") and not m.tool_calls  # text: it opens with no '{'
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3", "generic"])
@pytest.mark.parametrize("stream", [False, True])
def test_every_format_holds_a_required_call_to_its_grammar_and_parses_it(client, fmt, stream):
    msg, reason, _ = _create(client, stream, messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                             parallel_tool_calls=False, max_tokens=200, extra_body={"tool_format": fmt})
    [(name, args)] = _calls(msg)
    assert reason == "tool_calls" and name in ("get_weather", "add")
    assert _weather_ok(args) if name == "get_weather" else set(args) == {"a", "b"}
    if fmt == "mistral":
        assert len(msg.tool_calls[0].id) == 9 and msg.tool_calls[0].id.isalnum()


def test_llama3_auto_starts_its_grammar_at_an_opening_brace(client, front):
    with Client(str(front[2]), timeout=30) as c:
        [brace] = c.call("tokenize", {"content": "{", "add_special": False})["tokens"]
    msg, reason, _ = _create(client, False, messages=ASK, tools=[WEATHER], parallel_tool_calls=False, max_tokens=200,
                             logit_bias={str(brace): 100}, extra_body={"tool_format": "llama3"})
    [(name, args)] = _calls(msg)
    assert reason == "tool_calls" and name == "get_weather" and _weather_ok(args)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_each_of_n_choices_parses_its_own_tool_calls(client, stream):
    kw = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
              max_tokens=200, temperature=1.0, seed=4, n=3)
    if not stream:
        choices = client.chat.completions.create(**kw).choices
        got = [(c.index, c.finish_reason, _calls(c.message)) for c in choices]
    else:
        calls: dict[int, dict[int, dict]] = {0: {}, 1: {}, 2: {}}
        reasons: dict[int, str] = {}
        for ch in client.chat.completions.create(stream=True, **kw):
            for c in ch.choices:
                for tc in c.delta.tool_calls or []:
                    one = calls[c.index].setdefault(tc.index, {"name": "", "arguments": ""})
                    one["name"] += tc.function.name or ""
                    one["arguments"] += tc.function.arguments or ""
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        got = [(i, reasons[i], [(t["name"], json.loads(t["arguments"])) for _, t in sorted(calls[i].items())])
               for i in range(3)]
    assert [i for i, _, _ in got] == [0, 1, 2]
    for _, reason, parsed in got:
        [(name, args)] = parsed  # one call per choice, parsed by that choice's own scanner
        assert reason == "tool_calls" and name == "get_weather" and _weather_ok(args)
    assert len({json.dumps(p, sort_keys=True) for _, _, p in got}) > 1  # independent samples


def test_a_tool_schema_past_the_grammars_bounds_is_relaxed_and_named_in_the_degraded_header(front):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "minItems": 10**9}, "any": {"title": "t"}}}}}
    r = httpx.post(front[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"messages": ASK, "max_tokens": 2, "tools": [tool]})
    assert r.status_code == 200, r.text
    assert r.headers["x-actord-degraded"] == ("tools[0] (f).xs: minItems 1000000000 dropped (the grammar holds at most "
                                              "1000); tools[0] (f).any: no type, any JSON value")
