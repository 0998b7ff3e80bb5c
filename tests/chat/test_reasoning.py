"""Reasoning models (actord.chat.reasoning) with the real templates llama.cpp's server tests
name (tests/chat/templates/, from the vendored llama.cpp): thinking on, off and auto render
as llama-server renders them (its test_template.py's table), and a thought is parsed out of
the output into reasoning_content the same whole or streamed in any chunking."""

from __future__ import annotations

from pathlib import Path

import pytest

from actord.chat import reasoning as R
from actord.chat.messages import check_reasoning
from actord.chat.template import ChatTemplate

TEMPLATES = Path(__file__).parent / "templates"
R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"
QWEN3 = "Qwen-Qwen3-0.6B"
QWQ = "Qwen-QwQ-32B"
CR7B = "CohereForAI-c4ai-command-r7b-12-2024-tool_use"
TOOL = {"type": "function", "function": {"name": "test", "description": "", "parameters": {
    "type": "object", "properties": {"success": {"type": "boolean", "const": True}}, "required": ["success"]}}}


def source(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def render(name: str, mode: str, tools: list | None = None, kwargs: dict | None = None) -> tuple[str, R.TurnReasoning]:
    src = source(name)
    turn = R.for_turn(src, mode, "auto", kwargs or {}, None)
    tpl = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    text = turn.finish(tpl.render([{"role": "user", "content": "What is today?"}], tools=tools,
                                  context=turn.context))
    turn.start(text[-64:])
    return text, turn


@pytest.mark.parametrize("tools", [None, [], [TOOL]])
@pytest.mark.parametrize("name,mode,end", [  # llama-server's tests/unit/test_template.py::test_reasoning
    (R1, "on", "<think>\n"), (R1, "auto", "<think>\n"), (R1, "off", "<think>\n</think>"),
    (QWEN3, "auto", "<|im_start|>assistant\n"), (QWEN3, "off", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    (QWQ, "auto", "<|im_start|>assistant\n<think>\n"), (QWQ, "off", "<|im_start|>assistant\n<think>\n</think>"),
    (CR7B, "auto", "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    (CR7B, "off", "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>"),
])
def test_thinking_renders_as_llama_server_renders_it(name, mode, end, tools):
    text, turn = render(name, mode, tools)
    assert text.endswith(end)
    # The template opened the thought exactly where the prompt ends inside one.
    assert turn.thinking is (end.endswith("<think>\n") and mode != "off")


def test_a_request_enable_thinking_and_a_zero_budget_override_the_daemon():
    assert render(QWEN3, "on", kwargs={"enable_thinking": False})[0].endswith("<think>\n\n</think>\n\n")
    assert render(R1, "off", kwargs={"enable_thinking": True})[0].endswith("<think>\n")
    assert not R.thinking_enabled("on", {}, 0) and R.thinking_enabled("auto", {}, -1)


CASES = [  # (template, opened by the template, output, reasoning, content)
    (QWEN3, False, "<think>\nLet me count: 1, 2.\n</think>\n\nThe answer is 2.", "Let me count: 1, 2.",
     "The answer is 2."),
    (QWEN3, False, "No thought at all.", None, "No thought at all."),
    (QWEN3, False, "  <thi", None, "  <thi"),  # a marker's start, never finished: content
    (R1, True, "I should say hi.\n</think>\n\nHello!", "I should say hi.", "Hello!"),
    (R1, True, "Still thinking when the budget ran out", "Still thinking when the budget ran out", ""),
    (QWQ, True, "Hmm.\n\nMore: a<b.\n</think>\nDone.", "Hmm.\n\nMore: a<b.", "Done."),
    (CR7B, False, "<|START_THINKING|>Plan it.<|END_THINKING|>Answer.", "Plan it.", "Answer."),
]


@pytest.mark.parametrize("name,opened,out,thought,content", CASES)
def test_a_thought_is_parsed_out_the_same_whole_and_streamed_in_any_chunking(name, opened, out, thought, content):
    markers = R.markers_of(source(name))
    assert R.split(out, markers, thinking=opened, fmt="auto") == (thought, content)
    assert R.split(out, markers, thinking=opened, fmt="none") == (None, out)
    for size in (1, 2, 3, 7):
        p = R.ReasoningParser(markers, thinking=opened)
        got = [p.feed(out[i:i + size]) for i in range(0, len(out), size)] + [p.finish()]
        assert "".join(r for r, _ in got) == (thought or "") and "".join(c for _, c in got) == content


def test_streamed_chunks_carry_the_thought_apart_and_hold_a_marker_back():
    sent: list[dict] = []
    sink = R.ReasoningSink(R.ReasoningParser(R.THINK), sent.append)
    for piece in ["<th", "ink>Why", " not", "</th", "ink>\n", "Yes"]:
        sink({"slot": 0, "content": piece, "tokens": [1]})
    sink.finish(0)
    assert [(c.get("reasoning", ""), c["content"]) for c in sent] == [("Why", ""), (" not", ""), ("", "Yes")]


def test_a_held_back_first_chunk_passes_its_prompt_counts_on_with_the_next_sent():
    sent: list[dict] = []
    sink = R.ReasoningSink(R.ReasoningParser(R.THINK), sent.append)
    sink({"slot": 0, "content": "<th", "tokens": [1], "n_prompt": 9, "n_cached": 4})  # held: a marker may start
    sink({"slot": 0, "content": "ink>Why", "tokens": [1]})
    sink({"slot": 0, "content": " not", "tokens": [1]})
    assert [(c.get("n_prompt"), c.get("n_cached")) for c in sent] == [(9, 4), (None, None)]


def test_the_families_markers_are_read_off_the_template():
    assert R.markers_of(source(CR7B)) is R.COMMAND_R7B
    assert {R.markers_of(source(n)) for n in (R1, QWEN3, QWQ)} == {R.THINK}
    assert R.markers_of("{{ messages[0].content }}") is None and R.markers_of(None) is None


@pytest.mark.parametrize("fields,param", [
    ({"fmt": "deepseek-legacy"}, "reasoning_format"), ({"mode": "maybe"}, "reasoning"),
    ({"budget": -2}, "reasoning_budget"), ({"budget": True}, "reasoning_budget")])
def test_a_reasoning_field_out_of_range_is_refused_naming_it(fields, param):
    from actord.vocabulary.errors import InvalidParams

    with pytest.raises(InvalidParams) as e:
        check_reasoning(**fields)
    assert e.value.data["param"] == param
