"""One way in per chat API: OpenAI's chat completions, Anthropic's messages and the
Responses API each read a request into one turn with a pure `to_turn` (no front, no I/O:
the same request and context give the same turn), the length and sampling a request leaves
unsaid come from one place (actord/chat/defaults.py), and the same refusal happens at the
same point on every API (chat.turn.precheck, before the service is asked anything)."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import pytest

from actord.chat.defaults import TurnDefaults, asked, turn_defaults
from actord.chat.turn import precheck
from actord.frontends.http.anthropic import wire as W
from actord.frontends.http.app import HttpFront
from actord.frontends.http.openai import responses_api as R
from actord.frontends.http.openai import wire as O
from actord.frontends.http.turns import TurnContext, mind_for
from actord.vocabulary import errors as E
from actord.vocabulary.config import Config
from actord.vocabulary.types import DEFAULT_LIMITS
from tests.frontends.test_error_statuses import KEY, FailingService

CONTEXT = TurnContext(defaults=TurnDefaults(max_tokens=77), limits=DEFAULT_LIMITS, n_vocab=512, max_n=4)
HI = [{"role": "user", "content": "hi"}]


def _turns(**asked_for: Any) -> dict[str, Any]:
    """The turn each API reads from the same ask (the length in each API's own field)."""
    n = asked_for.pop("max_tokens", None)
    openai = {"messages": HI, **asked_for, **({"max_tokens": n} if n else {})}
    anthropic = {"messages": HI, **asked_for, **({"max_tokens": n} if n else {})}
    responses = {"input": "hi", "store": False, **asked_for, **({"max_output_tokens": n} if n else {})}
    return {"openai": O.to_turn(msgspec.convert(openai, O.ChatCompletionRequest), {}, CONTEXT),
            "anthropic": W.to_turn(msgspec.convert(anthropic, W.MessagesRequest), {}, CONTEXT),
            "responses": R.to_turn(msgspec.convert(responses, R.ResponsesRequest), {}, CONTEXT)}


def test_what_a_request_leaves_unsaid_is_the_chat_layers_default_on_every_api():
    for api, turn in _turns().items():
        c = turn.chat
        assert (c.n_predict, c.temperature, c.top_p) == (77, 1.0, 1.0), api
    for api, turn in _turns(max_tokens=5, temperature=0.5, top_p=0.25).items():
        c = turn.chat
        assert (c.n_predict, c.temperature, c.top_p) == (5, 0.5, 0.25), api


def test_the_default_length_is_the_flag_within_the_context():
    config = Config(model="/m.gguf", http_default_max_tokens=300)
    assert turn_defaults(config, 4096).max_tokens == 300 and turn_defaults(config, 128).max_tokens == 128
    assert asked(TurnDefaults(max_tokens=9), messages=[], max_tokens=None, temperature=0.0, top_p=None).n_predict == 9


def test_to_turn_is_pure_the_same_request_reads_the_same_turn():
    headers = {"x-actord-mind": "ada"}
    req = msgspec.convert({"messages": HI, "user": "someone", "tools": [{"type": "web_search"}]},
                          O.ChatCompletionRequest)
    a, b = O.to_turn(req, headers, CONTEXT), O.to_turn(req, headers, CONTEXT)
    assert a.chat == b.chat and a.degraded.notes == b.degraded.notes and a.chat.mind == "ada"
    named = O.to_turn(req, {}, CONTEXT)  # no header: the user's digest, and its label for the dashboard
    assert named.chat.mind == mind_for("u", "someone") and named.label == (named.chat.mind, "user", "someone")


def test_the_precheck_reads_the_turns_own_fields_with_no_stand_in_completion():
    chat = _turns()["openai"].chat
    assert precheck(chat, DEFAULT_LIMITS) is chat
    for bad, param in [({"stop": ["x"] * (DEFAULT_LIMITS.max_stop + 1)}, "stop"), ({"temperature": -1.0}, None),
                       ({"mind": "a/b"}, None), ({"min_p": 2.0}, "min_p")]:
        with pytest.raises(E.InvalidParams) as e:
            precheck(msgspec.structs.replace(chat, **bad), DEFAULT_LIMITS)
        assert param is None or e.value.data.get("param", e.value.data.get("field")) == param, e.value.data


ROUTES = [("/v1/chat/completions", {"messages": HI}), ("/chat/completions", {"messages": HI}),
          ("/v1/messages", {"messages": HI}), ("/v1/responses", {"input": "hi"})]


@pytest.mark.anyio
@pytest.mark.parametrize("path,body", ROUTES, ids=[p for p, _ in ROUTES])
async def test_a_turn_refused_by_the_precheck_is_the_same_400_before_the_service_is_asked(path, body):
    """A bad mind name and too many stop strings are refused on every chat API as a 400
    before anything is asked of the service (whose every generation would be a 500 here)."""
    config = Config(model="/models/fake.gguf", api_key=KEY)
    front = HttpFront(FailingService(config, E.InternalError("the service was asked")), config)
    auth = {"authorization": f"Bearer {KEY}"}
    stops = ["s"] * (config.request_limits().max_stop + 1)
    stop = {"stop_sequences": stops} if path == "/v1/messages" else {"stop": stops}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front.app), base_url="http://front") as c:
        r = await c.post(path, json={"model": "m", **body}, headers={**auth, "x-actord-mind": "a/b"})
        assert r.status_code == 400 and "mind name" in r.text, r.text
        if path != "/v1/responses":  # Responses takes no stop strings
            r = await c.post(path, json={"model": "m", **body, **stop}, headers=auth)
            assert r.status_code == 400 and "stop strings" in r.text, r.text
        r = await c.post(path, json={"model": "m", **body}, headers=auth)
        assert r.status_code == 500  # a well-formed turn reaches the service


def test_a_hosted_models_options_are_answered_as_on_the_responses_api_ignored_and_named():
    """reasoning_effort, verbosity and web_search_options on Chat Completions are what the
    Responses API's reasoning.effort and hosted tools are: the turn goes on, and the
    X-Actord-Degraded header names each (an agent's every turn is not refused)."""
    req = msgspec.convert({"messages": HI, "reasoning_effort": "high", "verbosity": "low",
                           "web_search_options": {"search_context_size": "low"}}, O.ChatCompletionRequest)
    O.refuse_unsupported(req)
    notes = O.to_turn(req, {}, CONTEXT).degraded.notes
    assert [n.split(" ")[0] for n in notes] == ["reasoning_effort", "verbosity", "web_search_options"], notes
    plain = msgspec.convert({"messages": HI, "reasoning_effort": "none"}, O.ChatCompletionRequest)
    assert O.to_turn(plain, {}, CONTEXT).degraded.notes == []
