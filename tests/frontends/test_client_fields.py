"""Fields common clients send, honoured on every route that generates: `ignore_eos`
(NVIDIA AIPerf's fixed output lengths), a session header naming a mind when the operator
says so (--http-mind-headers: X-Correlation-ID, X-Session-Id), and a named tool choice
giving exactly one call on OpenAI's chat, the Responses API and Anthropic's Messages.

The route tests drive the front as an ASGI app over a service that records what it is
asked and answers nothing more (the request each route builds is what is checked); the
one-call tests run the tiny model with the Hermes tool template."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import pytest

from actord.chat import tools as T
from actord.chat.messages import Tool
from actord.frontends.http.app import HttpFront
from actord.frontends.http.turns import mind_for
from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams
from tests.frontends.test_openai_http import KEY, front_on_tiny, openai_client

pytestmark = pytest.mark.anyio
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "responses": ("/v1/responses", {"input": "hi"}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
}


class Recorder:
    """A service that records the chat or completion a route asks for, then refuses it."""

    def __init__(self) -> None:
        self.asked: list[Any] = []

    def model_props(self) -> Any:
        return SimpleNamespace(n_ctx=4096, n_vocab=512)

    async def chat_info(self) -> Any:
        return SimpleNamespace(template=None)

    async def chat(self, request: Any, on_token: Any = None, n: int = 1) -> Any:
        self.asked.append(request)
        raise InvalidParams("recorded")

    async def complete(self, request: Any, on_token: Any = None) -> Any:
        self.asked.append(request)
        raise InvalidParams("recorded")


async def _ask(route: str, extra: dict, headers: dict | None = None, **config: Any) -> Any:
    rec = Recorder()
    front = HttpFront(None, Config(model="/models/tiny.gguf", api_key=KEY, **config))
    front.attach(rec)  # type: ignore[arg-type]
    path, body = ROUTES[route]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front.app), base_url="http://front") as c:
        r = await c.post(path, json={**body, **extra}, headers={"authorization": f"Bearer {KEY}", **(headers or {})})
    assert r.status_code == 400 and "recorded" in r.text, r.text
    [asked] = rec.asked
    return asked


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("route", list(ROUTES))
async def test_ignore_eos_reaches_the_generation_on_every_route(route):
    assert (await _ask(route, {"ignore_eos": True})).ignore_eos is True
    assert (await _ask(route, {})).ignore_eos is False


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_session_header_names_a_mind_only_when_the_operator_names_the_header(route):
    session = {"X-Correlation-ID": "bench-7"}
    flagged = await _ask(route, {}, session, http_mind_headers=["X-Correlation-ID,X-Session-Id"])
    assert flagged.mind == mind_for("h", "bench-7")
    other = await _ask(route, {}, {"X-Session-Id": "s-1"}, http_mind_headers=["X-Correlation-ID,X-Session-Id"])
    assert other.mind == mind_for("h", "s-1")
    unflagged = await _ask(route, {}, session)
    assert unflagged.mind != flagged.mind
    named = await _ask(route, {}, {**session, "X-Actord-Mind": "ada"}, http_mind_headers=["X-Correlation-ID"])
    assert named.mind == "ada"  # the explicit header still wins


def test_an_empty_mind_header_name_is_refused_at_start():
    with pytest.raises(InvalidParams):
        Config(model="m.gguf", http_mind_headers=["X-Correlation-ID,"]).validate()


def test_a_named_choice_plans_one_call_whatever_parallel_tool_calls_says():
    tools = [Tool(name="f", parameters={"type": "object", "properties": {"a": {"type": "string"}}}),
             Tool(name="g")]
    for fmt in T.FORMATS:
        named = T.plan_turn(fmt, [], tools, "named", "f", parallel=True)
        assert not named.parallel and named.scanner().max_calls == 1
        assert T.plan_turn(fmt, [], tools, "required", parallel=True).parallel  # only the named choice is one call


# -- one call, on the tiny tool-template model --------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}


@pytest.fixture(scope="module")
def tools_front(tmp_path_factory):
    for _, url in front_on_tiny(tmp_path_factory, tools=True):
        yield url


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_named_tool_choice_gives_exactly_one_call_on_every_api(tools_front):
    oa = openai_client(tools_front)
    chat = oa.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "weather in Paris"}], max_tokens=200, temperature=0,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert len(chat.choices[0].message.tool_calls) == 1 and chat.choices[0].finish_reason == "tool_calls"
    resp = oa.responses.create(
        model="m", input="weather in Paris", max_output_tokens=200, temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        tool_choice={"type": "function", "name": "get_weather"})
    assert [o.type for o in resp.output] == ["function_call"] and resp.status == "completed"
    an = anthropic.Anthropic(base_url=tools_front, api_key=KEY, max_retries=0, timeout=120)
    msg = an.messages.create(
        model="m", max_tokens=200, messages=[{"role": "user", "content": "weather in Paris"}],
        tools=[{"name": "get_weather", "input_schema": WEATHER}], tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["tool_use"] and msg.stop_reason == "tool_use"


# -- strict templates: conversations folded, on the tiny model with Gemma 3's template --------


@pytest.fixture(scope="module")
def gemma_front(tmp_path_factory):
    from actord.testing.models import GEMMA3_CHAT_TEMPLATE, write_tiny_llama
    from tests.frontends.test_openai_http import _start, _stop

    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-gemma.gguf", seed=1,
                                 chat_template=GEMMA3_CHAT_TEMPLATE))
    proc, _, url = _start(model, tmp_path_factory.mktemp("d"), "--api-key", KEY)
    try:
        yield url
    finally:
        _stop(proc)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_system_messages_anywhere_and_same_role_runs_are_folded_where_gemmas_template_refuses_them(gemma_front):
    chat = _post(gemma_front, "/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "system", "content": "s1"}, {"role": "developer", "content": "d1"},
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "s2"}, {"role": "user", "content": "u2"}, {"role": "user", "content": "u3"}]})
    assert chat.status_code == 200, chat.text
    assert chat.headers["x-actord-degraded"] == (
        "messages: 2 system message(s) merged into the first (the template takes one, first); "
        "messages: 1 message(s) merged into the one before, of the same role (the template takes alternating roles)")
    codex = _post(gemma_front, "/v1/responses", {"max_output_tokens": 2, "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d1"}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d2"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "env"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}]})
    assert codex.status_code == 200, codex.text
    assert "merged" in codex.headers["x-actord-degraded"]
    claude = _post(gemma_front, "/v1/messages", {"max_tokens": 2, "system": "s", "messages": [
        {"role": "user", "content": "u"}, {"role": "system", "content": "mid-conversation"}]})
    assert claude.status_code == 200, claude.text
    assert "1 system message(s) merged" in claude.headers["x-actord-degraded"]
    alternating = _post(gemma_front, "/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    assert alternating.status_code == 200 and "x-actord-degraded" not in alternating.headers
    refused = _post(gemma_front, "/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]})  # no fold makes it start with a user
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_forced_tool_with_the_same_schema_as_text_format_is_one_call_and_says_the_format_was_dropped(
        tools_front):
    # instructor's RESPONSES_TOOLS mode: a forced call and text.format with the call's schema.
    r = _post(tools_front, "/v1/responses", {
        "model": "m", "input": "weather in Paris", "max_output_tokens": 200, "temperature": 0,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "get_weather", "schema": WEATHER}}})
    assert r.status_code == 200, r.text
    assert [o["type"] for o in r.json()["output"]] == ["function_call"]
    assert r.headers["x-actord-degraded"] == "text.format dropped: a forced tool call's grammar holds the output"
