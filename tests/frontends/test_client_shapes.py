"""What agent clients send, made acceptable without a model: schemas relaxed to what the
grammar holds (actord/chat/schema_relax.py), conversations folded for strict templates
(actord/chat/folding.py), Responses tool namespaces, hosted tools, `include` and reasoning
items (actord/frontends/http/openai/responses_extras.py), and the degraded header."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from actord.chat.folding import merge_runs, merge_systems
from actord.chat.messages import ChatMessage, ToolCall
from actord.chat.schema_relax import relaxed
from actord.chat.template import ChatTemplate
from actord.engine.grammar import schema_grammar
from actord.frontends.http.degraded import Degraded, Folds, fold
from actord.frontends.http.openai import responses_extras as X
from actord.frontends.http.openai.responses_api import input_messages
from actord.vocabulary.errors import ChatTemplateError, InvalidParams
from actord.testing.chat_templates import GEMMA3_CHAT_TEMPLATE

RECORDED = Path(__file__).parent / "recorded"


def _claude_workflow_schema() -> dict:
    body = json.loads((RECORDED / "claude_code_2.1.197_first.json").read_text())["body"]
    return next(t["input_schema"] for t in body["tools"] if t["name"] == "Workflow")


def test_claude_codes_workflow_schema_is_refused_as_sent_and_converts_once_relaxed():
    schema = _claude_workflow_schema()
    with pytest.raises(InvalidParams):
        schema_grammar(schema, "tools")
    out, notes = relaxed(schema, "Workflow")
    assert notes == ["Workflow.script: maxLength 524288 dropped (the grammar holds at most 1000)",
                     "Workflow.args: no type, any JSON value"]
    assert out["properties"]["args"] == {} and "maxLength" not in out["properties"]["script"]
    assert schema_grammar(out, "tools")
    assert schema["properties"]["script"]["maxLength"] == 524288  # the request's own schema is left as it was


def test_a_schema_the_grammar_holds_is_returned_as_the_same_object_with_no_notes():
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}, "b": {}}}
    out, notes = relaxed(schema)
    assert out is schema and notes == []


def test_relaxing_reaches_every_subschema_and_only_widens():
    schema = {"type": "object", "properties": {"xs": {"type": "array", "minItems": 5000,
                                                      "items": {"anyOf": [{"title": "t"}, {"type": "integer"}]}}},
              "$defs": {"d": {"type": "any"}}}
    out, notes = relaxed(schema, "s")
    assert "minItems" not in out["properties"]["xs"]
    assert out["properties"]["xs"]["items"]["anyOf"] == [{}, {"type": "integer"}]
    assert out["$defs"]["d"] == {}
    assert len(notes) == 3 and any("type 'any' unknown" in n for n in notes)


def test_system_messages_anywhere_merge_into_one_leading_one_in_order():
    msgs = [ChatMessage(role="user", content="u1"), ChatMessage(role="system", content="s1"),
            ChatMessage(role="assistant", content="a1"), ChatMessage(role="system", content="s2"),
            ChatMessage(role="user", content="u2")]
    out = merge_systems(msgs)
    assert [(m.role, m.content) for m in out] == [("system", "s1\n\ns2"), ("user", "u1"), ("assistant", "a1"),
                                                  ("user", "u2")]
    lead = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="u")]
    assert merge_systems(lead) is lead


def test_runs_of_one_role_merge_but_tool_results_and_calls_stay_apart():
    call = ToolCall(id="c1", name="f", arguments="{}")
    msgs = [ChatMessage(role="user", content="a"), ChatMessage(role="user", content="b"),
            ChatMessage(role="assistant", content="t"), ChatMessage(role="assistant", tool_calls=[call]),
            ChatMessage(role="tool", tool_call_id="c1", content="r1"), ChatMessage(role="tool", content="r2")]
    out = merge_runs(msgs)
    assert [(m.role, m.content) for m in out] == [("user", "a\n\nb"), ("assistant", "t"), ("tool", "r1"),
                                                  ("tool", "r2")]
    assert out[1].tool_calls == [call]


def test_codexs_developer_and_user_runs_render_with_gemmas_template_once_folded():
    tpl = ChatTemplate(GEMMA3_CHAT_TEMPLATE, bos_token="<bos>")
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d1"}]},
             {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d2"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "env"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}]
    msgs = [msgspec.structs.replace(m, role="system") if m.role == "developer" else m  # as turns.roles_for fits them
            for m in input_messages(items)]
    as_dicts = lambda ms: [{"role": m.role, "content": m.content} for m in ms]  # noqa: E731
    with pytest.raises(ChatTemplateError):
        tpl.render(as_dicts(msgs))
    degraded = Degraded()
    folded = fold(msgs, Folds(systems=True, runs=True), degraded)
    text = tpl.render(as_dicts(folded))
    assert text == "<bos><start_of_turn>user\nd1\n\nd2\n\nenv\n\nSay hi<end_of_turn>\n<start_of_turn>model\n"
    assert len(degraded.notes) == 2
    assert fold(msgs, Folds(), Degraded()) is msgs  # a template that takes the shape gets it unchanged


def test_a_namespace_is_flattened_and_hosted_tools_are_dropped_each_noted():
    body = json.loads((RECORDED / "codex_0.171.0_first.json").read_text())["body"]
    degraded = Degraded()
    tools = X.flat_tools(body["tools"], degraded)
    names = [t["name"] for t in tools]
    assert "close_agent" in names and "exec_command" in names
    assert all(t.get("type", "function") == "function" for t in tools)
    assert len(tools) == len(body["tools"]) - 2 + 5
    assert degraded.notes == ["tools[4]: namespace 'multi_agent_v1' flattened into its 5 tools",
                              "tools[8]: hosted tool 'web_search' dropped: this server runs none"]


def test_our_opaque_reasoning_comes_back_as_the_next_assistant_turns_thought_and_a_foreign_one_is_dropped():
    item = X.reasoning_item("rs_1", "thinking about it", True)
    assert item["encrypted_content"] != "thinking about it"
    items = [{"type": "message", "role": "user", "content": "q"}, item,
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "r"},
             {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAAABopenai"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
    degraded = Degraded()
    msgs = input_messages(items, degraded=degraded)
    assert msgs[1].reasoning_content == "thinking about it" and msgs[1].tool_calls[0].id == "c1"
    assert msgs[3].reasoning_content is None
    assert degraded.notes == ["input[4]: reasoning item dropped: its encrypted_content is not this server's"]
    with pytest.raises(InvalidParams):  # without a Degraded (the socket's reading): refused, as before
        input_messages(items)


def test_include_keeps_the_encrypted_reasoning_and_drops_the_rest_by_name():
    degraded = Degraded()
    assert X.wants_reasoning(["reasoning.encrypted_content", "message.output_text.logprobs"], degraded)
    assert degraded.notes == ["include: 'message.output_text.logprobs' dropped: this server produces no such "
                              "output data"]
    assert not X.wants_reasoning(None, Degraded())
    with pytest.raises(InvalidParams):
        X.wants_reasoning("reasoning.encrypted_content", Degraded())


def test_the_degraded_header_is_ascii_bounded_and_absent_when_nothing_was_degraded():
    assert Degraded().headers() == []
    d = Degraded()
    d.add("tools[0] (caf\u00e9): no type; any value")
    for i in range(1000):
        d.add(f"note {i} " + "x" * 40)
    [(name, value)] = d.headers()
    assert name == b"x-actord-degraded" and len(value) <= 4096
    assert value.startswith(b"tools[0] (caf\\xe9): no type, any value; ") and value.endswith(b"more")


def test_a_thought_is_answered_as_an_opaque_reasoning_item_first_whole_or_streamed():
    from actord.frontends.http.openai.responses_events import Events, output_items

    msg = ChatMessage(role="assistant", content="hi", reasoning_content="let me think")
    items = output_items(msg, False, sealed=True)
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert X.unseal(items[0]["encrypted_content"]) == "let me think"
    assert [i["type"] for i in output_items(msg, False)] == ["message"]  # include did not ask for it

    ev = Events({"id": "resp_1"}, sealed=True)
    wire = ev.thought("let me ") + ev.thought("think") + ev.text("hi")
    body = {"status": "completed", "output": ev.output}
    wire += ev.finish(body)
    events = [json.loads(b.split(b"data: ", 1)[1]) for b in wire.split(b"\n\n") if b]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["type"] for d in done] == ["reasoning", "message"]
    assert X.unseal(done[0]["encrypted_content"]) == "let me think" and ev.output[0] is not ev.output[1]
    assert [e["type"] for e in events].index("response.output_item.added") < \
        [e["type"] for e in events].index("response.output_text.delta")


def test_a_custom_freeform_tool_is_dropped_by_name():
    degraded = Degraded()
    tools = X.flat_tools([{"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
                          {"type": "function", "name": "f"}], degraded)
    assert [t["name"] for t in tools] == ["f"]
    assert degraded.notes == ["tools[0]: custom tool 'apply_patch' dropped: only function tools (JSON arguments) "
                              "are called here"]


def test_a_service_that_renders_no_templates_folds_nothing():
    import anyio

    from actord.frontends.http.degraded import probe_folds

    class Router:  # the cluster's front: its nodes render the templates
        pass

    assert anyio.run(probe_folds, Router()) == Folds()
