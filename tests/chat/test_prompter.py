"""The prompter (actord.chat.prompter): a served turn comes back as its exact tokens, the
turn memory's bound, the chained conversation keys (a turn hashes only its new messages),
and every render on a worker thread through the system's seam."""

from __future__ import annotations

import threading

import anyio
import pytest
from hypothesis import given, settings, strategies as st

from actord.chat.messages import ChatMessage, ToolCall
from actord.chat.prompter import ChatPrompter, ConversationKeys, TurnMemory
from actord.engine.jobs import ChatTemplateInfo
from actord.vocabulary.errors import NoChatTemplate
from actord.vocabulary.types import CompletionResult, Timings
from actord.testing.models import TINY_CHAT_TEMPLATE


def test_turn_memory_is_bounded_by_tokens_and_least_recently_used_goes_first():
    mem = TurnMemory(max_tokens=10, entry_tokens=0)
    mem.put(b"a", [1] * 4)
    mem.put(b"b", [2] * 4)
    assert mem.get(b"a") == [1] * 4  # a is now the most recent
    mem.put(b"c", [3] * 4)  # 12 > 10: b goes
    assert mem.get(b"b") is None and mem.get(b"a") is not None and mem.held == 8
    mem.put(b"huge", [0] * 11)  # larger than the budget: not kept, nothing dropped
    assert mem.get(b"huge") is None and len(mem) == 2


def test_turn_memory_charges_each_turn_its_bookkeeping_so_many_short_turns_stay_bounded():
    mem = TurnMemory(max_tokens=1000)  # the default charge: 64 units per turn kept
    for i in range(1000):
        mem.put(b"k%d" % i, [7])
    assert len(mem) == 1000 // 65 and mem.held <= 1000  # 15 turns of 1 token, not 1000
    assert mem.get(b"k999") == [7] and mem.get(b"k0") is None  # the newest stay
    mem.put(b"k999", [8, 9])  # a turn kept again is charged once
    assert mem.held == 14 * 65 + 66 and mem.get(b"k999") == [8, 9]


def _result(tokens: list[int]) -> CompletionResult:
    return CompletionResult(content="", tokens=tokens, n_prompt_tokens=0, n_prompt_processed=0, n_cached=0,
                            slot=0, stop_reason="length", timings=Timings(0, 0, 0, 0))


def _prompter(template: str | None = TINY_CHAT_TEMPLATE, **kw) -> ChatPrompter:
    async def tokenize(text: str) -> list[int]:  # one token per character, "<s>" parsed as 1
        return [1 if i == 0 and text.startswith("<s>") else ord(c) + 10 for i, c in enumerate(text.replace("<s>", "\0", 1))]

    info = ChatTemplateInfo(template=template, bos_text="<s>", eos_text="</s>", add_bos=True, bos=1)
    return ChatPrompter(info, tokenize, **kw)


@pytest.mark.anyio
async def test_a_served_turn_comes_back_as_its_exact_tokens():
    p = _prompter()
    msgs = [ChatMessage("user", "hi")]
    first = await p.build(msgs)
    assert first.tokens[0] == 1 and not first.reused_turn
    generated = [500, 501, 502]  # what the model produced (not what "yo" would tokenize to)
    p.remember(first, "yo", _result(generated))
    nxt = [*msgs, ChatMessage("assistant", "yo"), ChatMessage("user", "more")]
    second = await p.build(nxt)
    assert second.reused_turn
    assert second.tokens[: len(first.tokens) + 3] == first.tokens + generated
    tail = "</s>\n<|user|>\nmore</s>\n<|assistant|>\n"
    assert second.tokens[len(first.tokens) + 3:] == [ord(c) + 10 for c in tail]
    edited = [*msgs, ChatMessage("assistant", "yo!"), ChatMessage("user", "more")]
    assert not (await p.build(edited)).reused_turn  # an edited reply is rendered whole


@pytest.mark.anyio
async def test_no_template_is_a_typed_error_unless_the_request_names_one():
    p = _prompter(template=None)
    with pytest.raises(NoChatTemplate):
        await p.build([ChatMessage("user", "hi")])
    assert (await p.build([ChatMessage("user", "hi")], template=TINY_CHAT_TEMPLATE)).tokens[0] == 1



# ---- the keys: chained, and a message kept as an object is hashed once -----------------------

_roles = st.sampled_from(["system", "user", "assistant", "tool"])
_msgs = st.lists(st.builds(ChatMessage, role=_roles, content=st.text(max_size=20)), max_size=8)


@settings(max_examples=100, deadline=None)
@given(msgs=_msgs)
def test_the_same_conversation_gets_the_same_key_whoever_keys_it_and_however_its_objects_come(msgs):
    a = ConversationKeys().of("tpl", msgs)
    copies = [ChatMessage(m.role, m.content) for m in msgs]  # as a client sends it again
    b = ConversationKeys().of("tpl", copies)
    keys = ConversationKeys()
    keys.of("tpl", msgs)
    c = keys.of("tpl", msgs)  # the objects seen before: the steps kept
    assert a == b == c
    assert len(set(a)) == len(a)  # every prefix a key of its own
    assert ConversationKeys().of("other", msgs)[-1] != a[-1]  # the template is in the key


def test_a_key_changes_with_any_field_the_model_sees():
    call = ToolCall(id="c1", name="f", arguments="{}")
    base = [ChatMessage("user", "hi"), ChatMessage("assistant", "", tool_calls=[call])]
    variants = [
        [ChatMessage("user", "hi!"), base[1]],
        [ChatMessage("system", "hi"), base[1]],
        [base[0], ChatMessage("assistant", "", tool_calls=[ToolCall(id="c1", name="f", arguments='{"a": 1}')])],
        [base[0], ChatMessage("assistant", "", tool_calls=[ToolCall(id="c2", name="f", arguments="{}")])],
        [*base, ChatMessage("tool", "1", tool_call_id="c1")],
    ]
    k = ConversationKeys().of("t", base)[-1]
    assert all(ConversationKeys().of("t", v)[-1] != k for v in variants)


@pytest.mark.anyio
async def test_a_turn_whose_earlier_messages_were_seen_hashes_only_its_new_ones():
    p = _prompter()
    msgs = [ChatMessage("system", "be brief"), ChatMessage("user", "hi")]
    first = await p.build(msgs)
    assert p.keys.hashed == 2
    reply = ChatMessage("assistant", "yo")
    p.remember(first, reply, _result([500, 501]))
    assert p.keys.hashed == 3  # the reply folds onto the prompt's key: the conversation is not hashed again
    for turn in range(5):  # an embedded caller's list, growing: the reply and one new message each turn
        msgs = [*msgs, reply, ChatMessage("user", f"more {turn}")]
        before = p.keys.hashed
        prompt = await p.build(msgs)
        assert prompt.reused_turn and p.keys.hashed == before + 1  # the new user message only
        reply = ChatMessage("assistant", f"ok {turn}")
        p.remember(prompt, reply, _result([600 + turn]))
        assert p.keys.hashed == before + 2
    # The same conversation sent again as new objects (JSON from a client): read, hashed, and found.
    again = [ChatMessage(m.role, m.content) for m in msgs]
    before = p.keys.hashed
    assert (await p.build(again)).reused_turn and p.keys.hashed == before + len(again)


def test_the_kept_steps_are_bounded_and_hold_no_message_alive():
    import gc
    import weakref

    keys = ConversationKeys(max_steps=4)
    msgs = [ChatMessage("user", str(i)) for i in range(10)]
    keys.of("t", msgs)
    assert len(keys._steps) == 4
    gone = ChatMessage("user", "gone")
    ref = weakref.ref(gone)
    keys.of("t", [gone])
    del gone
    gc.collect()
    assert ref() is None


# ---- every render on a worker thread, through the seam, under the limiter ---------------------


@pytest.mark.anyio
async def test_every_render_runs_on_a_worker_thread_through_the_run_sync_seam():
    seen: list[tuple[object, bool]] = []
    loop_thread = threading.get_ident()

    async def run_sync(fn, *args, limiter=None, **kw):
        def on_thread():
            seen.append((limiter, threading.get_ident() != loop_thread))
            return fn(*args)
        return await anyio.to_thread.run_sync(on_thread, limiter=limiter)

    limiter = anyio.CapacityLimiter(2)
    p = _prompter(run_sync=run_sync, limiter=limiter)
    first = await p.build([ChatMessage("user", "hi")])  # the model's own (trusted) template
    p.remember(first, "yo", _result([500]))
    await p.build([ChatMessage("user", "hi"), ChatMessage("assistant", "yo"), ChatMessage("user", "x")])  # the probe
    await p.build([ChatMessage("user", "hi")], template="{{ messages[0].content }}")  # a client's template
    assert seen == [(limiter, True)] * 3
