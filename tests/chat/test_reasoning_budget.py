"""The reasoning budget end to end (actord.chat.reasoning's policy, the scheduling core's
forcing) on the tiny model with DeepSeek-R1's real template, whose generation prompt opens
the thought: the tiny model never closes it, so only a budget ends it.

What is pinned: a budget of N closes the thought after exactly N tokens (its text is the
reasoning_content, the end marker follows in the output, the reply goes on as content),
streamed and whole agree, the budget message goes before the end marker, budget 0 is
thinking off and -1 no limit, n_predict bounds the whole, the daemon's --reasoning-budget
applies when the request names none, and a bad budget (or one with a grammar it would
bypass) is a typed error that changes nothing.
"""

from __future__ import annotations

import pytest

from actord.chat.messages import ChatMessage, ChatRequest
from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams
from actord.service.system import ActorSystem
from tests.chat.test_reasoning import R1, TEMPLATES

pytestmark = pytest.mark.anyio
MSGS = [ChatMessage(role="user", content="What is 1+1?")]


def system(model: str, **kw) -> ActorSystem:
    return ActorSystem(Config(model=model, slots=1, ctx=512, batch=64,
                              chat_template_file=str(TEMPLATES / f"{R1}.jinja"), **kw))


async def turn(s: ActorSystem, n_predict: int = 24, **kw):
    chunks: list = []
    r = await s.chat(ChatRequest(messages=MSGS, n_predict=n_predict, **kw), on_token=chunks.append)
    streamed = ("".join(c.get("reasoning", "") for c in chunks), "".join(c["content"] for c in chunks))
    return r, streamed


async def test_a_budget_closes_the_thought_after_exactly_n_tokens_and_the_reply_goes_on_as_content(tiny_model):
    async with system(tiny_model) as s:
        free, _ = await turn(s, reasoning_budget=-1)
        assert free.message.content == "" and "</think>" not in free.completion.content  # -1: no limit
        end = await s.tokens_of("</think>", add_special=False)
        for n in (1, 4):
            r, streamed = await turn(s, reasoning_budget=n)
            toks = r.completion.tokens
            assert toks[:n] == free.completion.tokens[:n] and toks[n:n + len(end)] == end
            assert r.message.reasoning_content == (await s.text_of(toks[:n])).strip()
            assert r.message.content and r.completion.content.endswith(r.message.content)
            assert len(toks) == 24 and r.completion.stop_reason == "length"
            assert streamed == (r.message.reasoning_content, r.message.content)
        msg, streamed = await turn(s, reasoning_budget=4, reasoning_budget_message=" Time to answer.")
        assert msg.message.reasoning_content == r.message.reasoning_content + " Time to answer."
        assert "Time to answer.</think>" in msg.completion.content and msg.message.content
        assert streamed == (msg.message.reasoning_content, msg.message.content)


async def test_budget_zero_is_thinking_off_and_n_predict_bounds_the_whole(tiny_model):
    async with system(tiny_model) as s:
        off, _ = await turn(s, template_kwargs={"enable_thinking": False})
        zero, _ = await turn(s, reasoning_budget=0)
        assert zero.message == off.message and zero.message.content
        end = await s.tokens_of("</think>", add_special=False)
        cut, streamed = await turn(s, n_predict=3 + 2, reasoning_budget=3)  # the end marker cut by n_predict
        assert cut.completion.tokens[3:] == end[:2] and cut.completion.stop_reason == "length"
        assert streamed == (cut.message.reasoning_content, cut.message.content)


async def test_the_daemons_budget_applies_unless_the_request_names_one(tiny_model):
    async with system(tiny_model, reasoning_budget=2, reasoning_budget_message=" ok") as s:
        r, _ = await turn(s)
        assert "ok</think>" in r.completion.content and r.message.content
        free, _ = await turn(s, reasoning_budget=-1)
        assert "</think>" not in free.completion.content


async def test_a_bad_budget_is_refused_typed_and_changes_nothing(tiny_model):
    with pytest.raises(InvalidParams):
        Config(model=tiny_model, reasoning_budget=-2).validate()
    async with system(tiny_model) as s:
        before, _ = await turn(s, reasoning_budget=3)
        for kw, param in (({"reasoning_budget": -2}, "reasoning_budget"),
                          ({"reasoning_budget": 3, "grammar": 'root ::= "a"+'}, "reasoning_budget")):
            with pytest.raises(InvalidParams) as e:
                await turn(s, **kw)
            assert e.value.data["param"] == param
        good = {"budget": 2, "start": [5], "end": [7], "forced": [7], "pieces": ["eA=="], "opened": True}
        for bad in ({"budget": 0}, {"pieces": []}, {"forced": [10**7]}, {"start": [], "opened": False}):
            with pytest.raises(InvalidParams) as e:  # a completion's budget, checked as its other fields
                await s.complete(prompt=[1, 2, 3], n_predict=4, thought_budget={**good, **bad})
            assert e.value.data["param"] == "thought_budget"
        after, _ = await turn(s, reasoning_budget=3)
        assert after.message == before.message and after.completion.tokens == before.completion.tokens
        done = await s.complete(prompt=[1, 2, 3], n_predict=6, thought_budget=good)
        assert done.tokens[2] == 7 and done.content.startswith(await s.text_of(done.tokens[:2]) + "x")
