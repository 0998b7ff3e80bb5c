"""actord.chat.tools and tool_output: the format chosen from a template, each format's parser (whole and streamed
in any split), malformed output kept as text, the call grammar's shape, and the history
rewritten for templates without tool support. Pure: no model."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from actord.chat import tools as T
from actord.chat.messages import ChatMessage, Tool, ToolCall
from actord.chat.stream import CallMade
from actord.chat.tool_output import Scanner, StreamAdapter, new_call_id
from actord.vocabulary.errors import InvalidParams
from actord.vocabulary.types import Trigger
from actord.testing.models import GEMMA3_CHAT_TEMPLATE, HERMES_TOOL_TEMPLATE, TINY_CHAT_TEMPLATE

NAMES = {"get_weather", "add"}


def _scan(fmt: str, text: str, max_calls: int | None = None, names=NAMES) -> tuple[str, list[tuple[str, dict]]]:
    sc = Scanner(fmt, names, max_calls)
    sc.feed(text)
    sc.finish()
    return sc.content, [(c.name, json.loads(c.arguments)) for c in sc.calls]


def _streamed(fmt: str, text: str, cuts: list[int], max_calls: int | None = None):
    sc = Scanner(fmt, NAMES, max_calls)
    events = []
    last = 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += sc.feed(text[last:c])
        last = c
    events += sc.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [(v.name, json.loads(v.arguments)) for k, v in events if k == "call"]
    assert content == sc.content and len(calls) == len(sc.calls)
    return content, calls


@pytest.mark.parametrize("template,fmt", [
    (HERMES_TOOL_TEMPLATE, "hermes"),
    ("{% for m in messages %}[INST]{{ m.content }}[/INST]{% if m.tool_calls %}[TOOL_CALLS]{% endif %}{% endfor %}",
     "mistral"),
    ("<|start_header_id|>{{ m }}<|python_tag|>", "llama3"),
    ("{% if tools %}<|start_header_id|>system<|end_header_id|>{{ tools }}{% endif %}", "llama3"),
    (GEMMA3_CHAT_TEMPLATE, "generic"),
    (TINY_CHAT_TEMPLATE, "generic"),
    (None, "generic"),
])
def test_the_format_is_read_from_the_template_markers(template, fmt):
    got, why = T.detect_format(template)
    assert got == fmt and why


HERMES = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
          '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
CASES = [
    ("hermes", HERMES, "Let me look.", [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {}}]',
     "", [("add", {"a": 1, "b": 2}), ("get_weather", {})]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    ("llama3", ' {"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"b": 2}}', "",
     [("add", {"a": 1}), ("add", {"b": 2})]),
    ("llama3", 'The answer is {"name": "add"}', 'The answer is {"name": "add"}', []),  # not opening: text
    ("generic", '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "add", "arguments": {"a": 3, "b": 4}}',
     "", [("get_weather", {"city": "Oslo"}), ("add", {"a": 3, "b": 4})]),
    ("generic", "Hello there, {not a call}", "Hello there, {not a call}", []),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}', "", [("add", {"a": 1})]),  # string args, no closer
    ("hermes", 'a < b and <tool_ is not a call', "a < b and <tool_ is not a call", []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_each_format_parses_its_calls_and_keeps_the_rest_as_content(fmt, text, content, calls):
    assert _scan(fmt, text) == (content, calls)
    assert _streamed(fmt, text, list(range(len(text)))) == (content, calls)  # one character at a time


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 300), max_size=12))
def test_a_streamed_output_parses_the_same_whatever_its_chunks(case, cuts):
    fmt, text, content, calls = case
    assert _streamed(fmt, text, [c for c in cuts if c <= len(text)]) == (content, calls)


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),  # cut by max_tokens
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'),  # a function not offered
    ("hermes", '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'),  # not JSON
    ("hermes", "<tool_call>name=add</tool_call>"),
    ("mistral", "[TOOL_CALLS] []"),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {}}, 7]'),
    ("generic", '{"name": "add", "arguments": {"a": 1}'),
    ("llama3", '{"function": "add"}'),
])
def test_malformed_output_falls_back_to_text(fmt, text):
    content, calls = _scan(fmt, text)
    assert calls == [] and content == text.strip()
    assert _streamed(fmt, text, list(range(len(text)))) == (content, calls)


def test_good_calls_stay_calls_beside_a_malformed_one():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> <tool_call>{"name": "add", "arguments": {'
    content, calls = _scan("hermes", text)
    assert calls == [("add", {"a": 1})] and content == '<tool_call>{"name": "add", "arguments": {'


def test_without_parallel_calls_a_second_call_is_text():
    text = '{"name": "add", "arguments": {"a": 1}}\n{"name": "add", "arguments": {"b": 2}}'
    content, calls = _scan("generic", text, max_calls=1)
    assert calls == [("add", {"a": 1})] and content == '{"name": "add", "arguments": {"b": 2}}'


def test_with_no_tools_nothing_parses():
    assert _scan("hermes", HERMES, names=None) == (HERMES, [])


def test_text_that_may_open_a_marker_is_held_back_until_it_does_not():
    sc = Scanner("hermes", NAMES)
    assert sc.feed("Hi <tool") == [("content", "Hi")]
    assert sc.feed("box") == [("content", " <toolbox")]
    assert sc.finish() == []


@pytest.mark.parametrize("fmt,text,content,calls", [
    ("hermes", "Sure. <tool", "Sure.", []),  # an opener's first characters
    ("hermes", 'Sure. <tool_call>{"name": "get_wea', "Sure.", []),  # a call half written
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool', "", [("add", {"a": 1})]),  # only its closer cut
    ("mistral", '[TOOL_CALLS][{"name": "add"', "", []),
    ("llama3", '<|python_tag|>{"name": "add", "argu', "", []),
    ("generic", '{"answer": "the wea', '{"answer": "the wea', []),  # bare JSON: it may be the answer itself
])
def test_a_call_the_token_limit_cut_is_dropped_not_shown_as_text(fmt, text, content, calls):
    for cuts in ([], [3], list(range(len(text)))):
        sc = Scanner(fmt, NAMES)
        events = []
        last = 0
        for c in cuts + [len(text)]:
            events += sc.feed(text[last:c])
            last = c
        events += sc.finish(cut=True)
        assert "".join(v for k, v in events if k == "content") == sc.content == content
        assert [(c.name, json.loads(c.arguments)) for c in sc.calls] == calls
        assert [(v.name, json.loads(v.arguments)) for k, v in events if k == "call"] == calls


def test_calls_get_ids_and_mistral_ids_are_nine_alphanumerics():
    sc = Scanner("mistral", NAMES)
    sc.feed('[TOOL_CALLS][{"name": "add", "arguments": {}}]')
    sc.finish()
    assert len(sc.calls[0].id) == 9 and sc.calls[0].id.isalnum()
    assert new_call_id("hermes").startswith("call_")


def test_stream_adapter_turns_raw_chunks_into_content_and_typed_call_events():
    got = []
    ad = StreamAdapter(Scanner("hermes", NAMES), got.append)
    for piece in ["Sure", ". <tool", "_call>", '{"name": "add", ', '"arguments": {"a": 1}}', "</tool_call>",
                  '<tool_call>{"name": "add", "arguments": {}}']:
        ad({"slot": 0, "content": piece, "tokens": [1]})
    ad.finish(0)
    assert [c["content"] for c in got] == ["Sure", ".", "", ""]
    assert all("tool_calls" not in c for c in got)  # no wire's shape: the fronts write their own
    [first], [second] = got[2]["calls"], got[3]["calls"]
    assert isinstance(first, CallMade) and first.index == 0 and second.index == 1
    assert (first.call.name, first.call.arguments) == ("add", '{"a": 1}') and first.call.id.startswith("call_")


def test_stream_adapter_passes_a_held_back_chunks_prompt_counts_on():
    got = []
    ad = StreamAdapter(Scanner("hermes", NAMES), got.append)
    ad({"slot": 0, "content": "<tool", "tokens": [1], "n_prompt": 7, "n_cached": 0})  # held: a marker may start
    ad({"slot": 0, "content": "ing", "tokens": [1]})
    ad({"slot": 0, "content": "!", "tokens": [1]})
    assert [c["content"] for c in got] == ["<tooling", "!"]
    assert (got[0]["n_prompt"], got[0]["n_cached"]) == (7, 0) and "n_prompt" not in got[1]


WEATHER = Tool(name="get_weather", description="weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
ADD = Tool(name="add", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})


@pytest.mark.parametrize("fmt", T.FORMATS)
@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_the_call_grammar_names_the_allowed_functions_in_the_format(fmt, mode):
    turn = T.plan_turn(fmt, [ChatMessage(role="user", content="x")], [WEATHER, ADD], mode, "add", parallel=False)
    g = turn.grammar
    assert g.startswith("root ::=") and "actord-call ::=" in g and '"\\"add\\""' in g
    assert ('"\\"get_weather\\""' in g) == (mode != "named")
    lazy = mode == "auto" and fmt != "generic"
    assert bool(turn.triggers) == lazy
    if fmt == "llama3" and lazy:
        assert Trigger(text="{", at_start=True) in turn.triggers
    if fmt == "generic" and mode == "auto":
        assert "actord-text" in g  # a call, or text that does not open with '{'
    assert "(actord-ws" not in g and ")*" not in g.split("\n", 1)[0]  # one call: no repetition


def test_tool_choice_none_renders_no_tools_and_constrains_nothing():
    turn = T.plan_turn("hermes", [ChatMessage(role="user", content="x")], [WEATHER], "none")
    assert turn.grammar == "" and turn.template_tools is None and not turn.parses


def test_generic_history_becomes_text_turns_that_alternate():
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
    msgs = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="weather?"),
            ChatMessage(role="assistant", tool_calls=[call, ToolCall(id="call_2", name="add", arguments="{}")]),
            ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
            ChatMessage(role="tool", tool_call_id="call_2", content="3"),
            ChatMessage(role="user", content="thanks")]
    turn = T.plan_turn("generic", msgs, [WEATHER, ADD], "auto")
    assert [d["role"] for d in turn.render] == ["system", "user", "assistant", "user"]
    assert turn.render[0]["content"].startswith("be brief\n\nYou can call these functions:")
    assert turn.render[2]["content"] == ('{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                         '{"name": "add", "arguments": {}}')
    assert turn.render[3]["content"] == "Result of get_weather (call call_1):\nsunny\n\nResult of add (call call_2):\n3" \
                                        "\n\nthanks"
    assert turn.template_tools is None


def test_native_history_gives_the_template_argument_objects_and_tool_names():
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
    msgs = [ChatMessage(role="user", content="weather?"), ChatMessage(role="assistant", tool_calls=[call]),
            ChatMessage(role="tool", tool_call_id="call_1", content="sunny")]
    turn = T.plan_turn("hermes", msgs, [WEATHER], "auto")
    assert turn.render[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert turn.render[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    assert turn.template_tools[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("fmt", ["hermes", "generic"])
def test_a_past_thought_reaches_the_template_with_its_tool_calls(fmt):
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
    msgs = [ChatMessage(role="user", content="weather?"),
            ChatMessage(role="assistant", tool_calls=[call], reasoning_content="look it up"),
            ChatMessage(role="tool", tool_call_id="call_1", content="sunny")]
    turn = T.plan_turn(fmt, msgs, [WEATHER], "auto")
    assert [d.get("reasoning_content") for d in turn.render if d["role"] == "assistant"] == ["look it up"]


@pytest.mark.parametrize("tools,choice,param", [
    ([Tool(name="a b")], "auto", "tools[0].function.name"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
    ([WEATHER], "maybe", "tool_choice"),
    ([], "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "add"}}, "tool_choice"),
    ([Tool(name="f", parameters={"type": "string", "minLength": 10**6})], "auto", "tools[0].function.parameters"),
])
def test_check_tools_refuses_naming_the_field(tools, choice, param):
    with pytest.raises(InvalidParams) as e:
        T.check_tools(tools, choice)
    assert e.value.data["param"] == param


def test_check_tools_modes():
    assert T.check_tools([WEATHER], None) == ("auto", "")
    assert T.check_tools([WEATHER], "none") == ("none", "")
    assert T.check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}) == ("named", "get_weather")
    assert T.check_tools([WEATHER], {"type": "function", "name": "get_weather"}) == ("named", "get_weather")  # Responses
