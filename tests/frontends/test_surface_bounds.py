"""Every bound a client can push on the HTTP surface added since the socket was attacked
(issue 26 item 5), one test each: over it, a typed 4xx before any work (nothing reaches the
tokenizer or a slot), and the daemon serves the next request as before. The bounds the
older tests pin are named where they live: n (test_openai_choices, test_native_http),
top_logprobs and logit_bias entries on the socket (tests/engine/test_grammar.py), grammar
bytes (same), stored responses by count (test_openai_responses), /slots paths leaving the
page folder (test_native_http), draft models of another vocabulary
(tests/serving/test_speculative.py)."""

from __future__ import annotations

import httpx
import pytest

from actord.chat.tools import MAX_TOOLS
from actord.engine.grammar import MAX_SCHEMA_BYTES
from actord.frontends.client import Client
from actord.frontends.http.openai.response_store import ResponseStore, Stored
from actord.vocabulary.types import RequestLimits
from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama
from tests.frontends.daemons import Daemon

MAX_PROMPT_BYTES = 4096


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    model = str(write_tiny_llama(tmp / "tiny.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE))
    d = Daemon(model, tmp, "--http", "127.0.0.1:0", "--max-prompt-bytes", str(MAX_PROMPT_BYTES))
    try:
        with Client(str(d.sock), timeout=60) as c:
            with httpx.Client(base_url="http://" + c.call("props")["http"], timeout=60) as h:
                yield h, c
    finally:
        d.proc.kill()
        d.proc.wait(30)


def refused(front, path: str, body: dict, status: int, param: str | None = None) -> dict:
    """POST body: answered `status` with a typed error (naming `param`), no prompt token
    read, and a plain chat served after it."""
    h, c = front
    seen = _prompt_tokens(c)
    r = h.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] and err["message"], err
    if param is not None:
        assert err.get("param") == param, err
    assert _prompt_tokens(c) == seen  # refused before the tokenizer
    ok = h.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "still here"}]})
    assert ok.status_code == 200
    return err


def _prompt_tokens(c: Client) -> float:
    text = c.call("metrics")["text"]
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("prompt_tokens_total "))


ASK = [{"role": "user", "content": "weather?"}]


def test_a_tool_list_over_max_tools_is_a_400_naming_tools(front):
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
    refused(front, "/v1/chat/completions", {"model": "m", "messages": ASK, "tools": tools}, 400, "tools")


def test_a_json_schema_over_its_bytes_is_a_400_naming_response_format(front):
    big = {"type": "object", "description": "x" * (MAX_SCHEMA_BYTES + 1)}
    err = refused(front, "/v1/chat/completions", {"model": "m", "messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "big", "schema": big}}}, 400)
    assert "response_format" in (err.get("param") or "") + err["message"], err


def test_a_grammar_over_its_bytes_is_a_400_on_the_native_completion(front):
    from actord.engine.grammar import MAX_GRAMMAR_BYTES

    refused(front, "/completion", {"prompt": "hi", "n_predict": 2, "grammar": "x" * (MAX_GRAMMAR_BYTES + 1)}, 400)


def test_logit_bias_over_its_entries_is_a_400_naming_logit_bias(front):
    """More entries than the bound (1024) need ids past the tiny vocabulary (512): the key
    range refuses them first, the same 400; the count alone is pinned on the socket
    (tests/engine/test_grammar.py)."""
    n = RequestLimits().max_logit_bias + 1
    refused(front, "/v1/chat/completions", {"model": "m", "messages": ASK, "max_tokens": 2,
                                            "logit_bias": {str(i): 1 for i in range(n)}}, 400, "logit_bias")


def test_top_logprobs_over_its_bound_is_a_400_naming_it(front):
    refused(front, "/v1/chat/completions", {"model": "m", "messages": ASK, "logprobs": True,
                                            "top_logprobs": RequestLimits().max_top_logprobs + 1}, 400, "top_logprobs")


def test_tokenize_over_the_prompt_bytes_is_refused_typed(front):
    err = refused(front, "/tokenize", {"content": "x" * (MAX_PROMPT_BYTES + 1)}, 400)
    assert "PromptTooLong" in str(err) or "content" in err["message"], err


def test_a_slots_file_name_over_the_name_bound_is_a_400(front):
    refused(front, "/slots/0?action=save", {"filename": "a" * 300 + ".page"}, 400)


def stored(n: int) -> Stored:
    return Stored(mind=None, messages=[], body={}, n_bytes=n)


def test_stored_responses_are_bounded_in_bytes_least_recently_used_first():
    s = ResponseStore(max_items=100, max_bytes=1000)
    for i in range(4):
        s.put(f"r{i}", stored(300))
    assert s.held == 900 and len(s) == 3 and s.get("r0") is None  # r0 went for r3
    s.get("r1")  # read: now the most recently used
    s.put("r4", stored(300))
    assert s.get("r2") is None and s.get("r1") is not None and s.held <= 1000
    s.put("huge", stored(1001))  # over the whole budget: never kept, nothing else dropped
    assert s.get("huge") is None and len(s) == 3


def test_stored_responses_are_bounded_in_count():
    s = ResponseStore(max_items=2, max_bytes=1 << 20)
    for i in range(3):
        s.put(f"r{i}", stored(1))
    assert len(s) == 2 and s.get("r0") is None and s.held == 2
