"""Anthropic's Messages API, its pure parts (actord/frontends/http/anthropic/wire.py and
stream.py): a request read into actord's chat (system blocks, tool_use and tool_result,
thinking, the billing stamp), the fields refused with a 400 naming them, the answer's
blocks and stop reasons, the error object, and the streamed events' order built from
stand-in chunks and results (no model)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anyio
import msgspec
import pytest

from actord.chat.messages import ChatMessage, ToolCall
from actord.chat.stream import CallMade
from actord.frontends.http.anthropic import wire as W
from actord.frontends.http.anthropic.stream import AnthropicAnswer, error_object
from actord.frontends.http.responses import HttpError
from actord.vocabulary.errors import InvalidParams, PromptTooLong


def _req(**body) -> W.MessagesRequest:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return msgspec.convert(body, W.MessagesRequest)


def test_system_blocks_join_and_the_billing_stamp_is_made_constant():
    a = W.chat_messages(_req(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=a5145;"},
                                     {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}]))
    b = W.chat_messages(_req(system="x-anthropic-billing-header: cc_version=2.1; cch=9f00e;\nYou are an agent."))
    assert a[0] == b[0] == ChatMessage(role="system", content="x-anthropic-billing-header: cc_version=2.1; cch=00000;\n"
                                                                   "You are an agent.")
    assert W.system_text("cch=a5145; stays") == "cch=a5145; stays"  # only the header's stamp


def test_tool_use_thinking_and_tool_results_become_chat_messages():
    msgs = W.chat_messages(_req(messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": " it?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look first", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "."}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "here:"},
            {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
             "content": [{"type": "text", "text": "a.py"}, {"type": "text", "text": "b.py"}]}]},
    ]))
    assert msgs == [
        ChatMessage(role="user", content="What is\n it?"),
        ChatMessage(role="assistant", content="", reasoning_content="look first",
                    tool_calls=[ToolCall(id="t1", name="ls", arguments='{"path": "."}')]),
        # Results first: they answer the call just before them; the text follows as the user's.
        ChatMessage(role="tool", tool_call_id="t1", content="a.py\nb.py"),
        ChatMessage(role="user", content="here:"),
    ]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
    ({"container": "c1"}, "container"),
])
def test_a_refused_field_is_named(body, param):
    with pytest.raises(InvalidParams) as e:
        W.check(_req(**body))
    assert e.value.data["param"] == param


@pytest.mark.parametrize("content,param", [
    ([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}],
     "messages[0].content[0]"),
    ([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}],
     "messages[0].content[0].content[0]"),
    ([{"type": "document", "source": {}}], "messages[0].content[0]"),
])
def test_images_and_documents_are_refused_as_unsupported_input(content, param):
    with pytest.raises(InvalidParams) as e:
        W.chat_messages(_req(messages=[{"role": "user", "content": content}]))
    assert e.value.data["param"] == param and "input is not supported" in e.value.message


def test_an_unknown_block_type_or_a_missing_messages_fails_at_decode():
    with pytest.raises(msgspec.ValidationError, match=r"messages\[0\].content\[0\]"):
        _req(messages=[{"role": "user", "content": [{"type": "server_tool_use", "id": "x"}]}])
    with pytest.raises(msgspec.ValidationError, match="messages"):
        msgspec.convert({"max_tokens": 5}, W.MessagesRequest)


def test_a_system_message_inside_messages_keeps_its_place_and_other_roles_are_refused():
    msgs = W.chat_messages(_req(messages=[{"role": "user", "content": "u"},
                                          {"role": "system", "content": [{"type": "text", "text": "s"}]}]))
    assert [(m.role, m.content) for m in msgs] == [("user", "u"), ("system", "s")]
    with pytest.raises(InvalidParams) as e:
        W.chat_messages(_req(messages=[{"role": "tool", "content": "x"}]))
    assert e.value.data["param"] == "messages[0].role"


def test_server_tools_are_dropped_and_a_schema_relaxed_when_degrading_is_allowed():
    from actord.frontends.http.degraded import Degraded

    d = Degraded()
    tool = {"name": "run", "input_schema": {"type": "object", "properties": {"args": {"description": "any"}}}}
    f = W.chat_tools(_req(tools=[{"type": "web_search_20250305", "name": "web_search"}, tool]), d)
    assert [t.name for t in f["tools"]] == ["run"] and f["tools"][0].parameters["properties"]["args"] == {}
    assert d.notes == ["tools[0]: server tool 'web_search_20250305' (web_search) dropped: this server runs none",
                       "tools[1] (run).args: no type, any JSON value"]


TOOL = {"name": "get_weather", "description": "The weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.parametrize("choice,want,parallel", [
    (None, "auto", True), ({"type": "auto"}, "auto", True), ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True), ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                                       {"type": "function", "function": {"name": "get_weather"}}, False),
])
def test_tools_and_tool_choice_map_to_the_chat_tool_fields(choice, want, parallel):
    f = W.chat_tools(_req(tools=[TOOL], **({"tool_choice": choice} if choice else {})))
    assert [t.name for t in f["tools"]] == ["get_weather"] and f["tools"][0].parameters == TOOL["input_schema"]
    assert f["tool_choice"] == want and f["parallel_tool_calls"] is parallel


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
])
def test_a_bad_tool_thinking_or_format_field_is_named(body, param):
    with pytest.raises(InvalidParams) as e:
        req = _req(**body)
        W.chat_tools(req), W.thinking_kwargs(req), W.output_grammar(req)
    assert e.value.data["param"] == param


def test_thinking_sets_the_templates_enable_thinking():
    assert W.thinking_kwargs(_req()) == {}
    assert W.thinking_kwargs(_req(thinking={"type": "enabled", "budget_tokens": 50})) == {"enable_thinking": True}
    assert W.thinking_budget(_req(thinking={"type": "enabled", "budget_tokens": 50})) == 50
    assert W.thinking_budget(_req(thinking={"type": "disabled"})) is None and W.thinking_budget(_req()) is None
    assert W.thinking_kwargs(_req(thinking={"type": "disabled"}, chat_template_kwargs={"x": 1})) == \
        {"x": 1, "enable_thinking": False}


def _result(content="", calls=None, thought=None, stop="eos", n_prompt=12, n_cached=5, n_out=3):
    c = SimpleNamespace(n_prompt_tokens=n_prompt, n_cached=n_cached, tokens=[0] * n_out, stop_reason=stop)
    return SimpleNamespace(completion=c, message=ChatMessage(role="assistant", content=content, tool_calls=calls,
                                                             reasoning_content=thought))


@pytest.mark.parametrize("stop,calls,word,want", [
    ("eos", None, "", "end_turn"), ("stop", None, "END", "stop_sequence"), ("length", None, "", "max_tokens"),
    ("context", None, "", "max_tokens"), ("eos", [ToolCall(id="c", name="f", arguments="{}")], "", "tool_use"),
])
def test_stop_reasons(stop, calls, word, want):
    body = W.from_result("msg_1", "m", _result("x", calls, stop=stop), word)
    assert body["stop_reason"] == want and body["stop_sequence"] == (word or None)


def test_the_whole_message_has_thinking_text_then_tool_use_blocks_and_anthropics_usage():
    calls = [ToolCall(id="c1", name="f", arguments='{"a": 1}'), ToolCall(id="c2", name="g", arguments="not json")]
    body = W.from_result("msg_1", "m", _result("hi", calls, thought="hmm"), "")
    assert body["content"] == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                               {"type": "text", "text": "hi"},
                               {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
                               {"type": "tool_use", "id": "c2", "name": "g", "input": {}}]
    assert body["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 5,
                             "output_tokens": 3}
    assert "timings" not in body and body["type"] == "message" and body["role"] == "assistant"
    assert W.from_result("m", "m", _result(""), "")["content"] == [{"type": "text", "text": ""}]


def test_errors_take_anthropics_shape_and_words():
    status, body = error_object(InvalidParams("bad", param="x"))
    assert (status, body) == (400, {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}})
    status, body = error_object(PromptTooLong("over", n_prompt_tokens=5000, n_ctx=4096))
    assert status == 400 and body["error"]["message"].startswith("prompt is too long: 5000 tokens > 4096 maximum")
    assert error_object(HttpError(401, "no key", "invalid_api_key"))[1]["error"]["type"] == "authentication_error"
    assert error_object(HttpError(413, "big", "body_too_large"))[1]["error"]["type"] == "request_too_large"
    assert W.error_type(503) == "overloaded_error" and W.error_type(500) == "api_error"


def _events(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for ev in data.decode().split("\n\n"):
        if ev:
            kind, payload = ev.split("\n")
            assert kind.startswith("event: ") and payload.startswith("data: ")
            d = json.loads(payload[6:])
            assert d["type"] == kind[7:]
            out.append((kind[7:], d))
    return out


def _stream(chunks: list[dict], result) -> list[tuple[str, dict]]:
    async def run(on_token):
        return result

    async def word(r):
        return ""

    a = AnthropicAnswer(run, word, "msg_1", "m")
    data = b"".join(a.chunk(c) for c in chunks)
    return _events(data + b"".join(anyio.run(a.streamed, None)))


def test_streamed_events_open_and_close_each_block_in_order():
    call = ToolCall(id="c1", name="f", arguments='{"a": 1}')
    evs = _stream([{"content": "", "n_prompt": 12, "n_cached": 5}, {"reasoning": "hm", "content": ""},
                   {"content": "he"}, {"content": "llo"}, {"content": "", "calls": [CallMade(index=0, call=call)]}],
                  _result("hello", [call], thought="hm"))
    kinds = [(k, d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type")) for k, d in evs]
    assert kinds == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert evs[0][1]["message"]["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0,
                                             "cache_read_input_tokens": 5, "output_tokens": 0}
    assert evs[0][1]["message"]["content"] == [] and evs[9][1]["content_block"]["input"] == {}
    assert evs[10][1]["delta"]["partial_json"] == '{"a": 1}'
    assert evs[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert evs[-2][1]["usage"]["output_tokens"] == 3


def test_a_stream_with_no_output_still_has_message_start_and_one_text_block():
    evs = _stream([], _result(""))
    assert [k for k, _ in evs] == ["message_start", "content_block_start", "content_block_stop", "message_delta",
                                   "message_stop"]
    assert evs[0][1]["message"]["usage"]["input_tokens"] == 7  # from the result, when no chunk came


def test_a_stream_error_is_anthropics_error_event():
    a = AnthropicAnswer(None, None, "msg_1", "m")  # type: ignore[arg-type]
    [(kind, body)] = _events(a.error_event(InvalidParams("boom")))
    assert kind == "error" and body == {"type": "error", "error": {"type": "invalid_request_error", "message": "boom"}}
