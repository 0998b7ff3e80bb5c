"""Bounded cost before work (issue 33), through a daemon without a key as users run it: a
body nested past the depth bound, entry counts that grow the work (logit_bias repeats,
a /tokenize list, a schema's alternatives, a tools list) and a Host that is not the
daemon's own are each refused with a typed 4xx naming the field, in the API's own error
shape, before any work; and the daemon serves on."""

from __future__ import annotations

import threading

import httpx
import pytest

from actord.frontends.http import costs
from actord.frontends.http.cors import host_allowed
from actord.frontends.http.responses import HttpError
from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama
from tests.frontends.test_openai_http import _start, _stop
from tests.waits import eventually


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-chat.gguf", seed=1,
                                 chat_template=TINY_CHAT_TEMPLATE))
    proc, _, url = _start(model, tmp_path_factory.mktemp("d"), "--http-host", "my.box", "--http-max-body-bytes", str(16 << 20))
    try:
        yield url
    finally:
        _stop(proc)


def _deep(n: int) -> bytes:
    return b'{"model": "m", "x": ' + b"[" * n + b"]" * n + b', "messages": [{"role": "user", "content": "hi"}]}'


def test_a_body_nested_past_the_depth_bound_is_a_400_in_each_apis_own_shape(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        for n in (200, 100_000):
            body = _deep(n)
            r = c.post("/v1/chat/completions", content=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
            assert "nests deeper than 128" in r.json()["error"]["message"]
            r = c.post("/v1/messages", content=body)
            assert r.status_code == 400 and r.json()["type"] == "error", r.text  # Anthropic's shape
            assert r.json()["error"]["type"] == "invalid_request_error"
            r = c.post("/completion", content=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text  # llama-server's
            assert r.json()["error"]["actord"]["type"] == "invalid_json"
            r = c.post("/v1/responses", content=b"[" * n)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        ok = c.post("/v1/chat/completions", content=_deep(20).replace(b'"m"', b'"m", "max_tokens": 2'))
        assert ok.status_code in (200, 400) and "invalid_json" not in ok.text  # depth 20 passes the bound
        assert c.get("/health").status_code == 200


def test_the_depth_scan_counts_brackets_outside_strings_only():
    assert costs.json_too_deep(b'{"a": "' + b"[" * 500 + b'"}', 8) is None
    assert costs.json_too_deep(b'{"a": "\\"' + b"[" * 500 + b'"}', 8) is None  # an escaped quote stays inside
    assert costs.json_too_deep(b"[" * 9 + b"]" * 9, 8) == "depth"
    assert costs.json_too_deep(b"[" * 8 + b"]" * 8, 8) is None
    assert costs.json_too_deep(b'[{"a": [1]}, [[2]]]' * 1000, 3) is None
    assert costs.json_too_deep(b"[]]][[[[]]]", 4) == "unbalanced"
    assert costs.json_too_deep(b"[" + b"1," * 3000 + b"1]", 8, max_values=2048) == "values"
    assert costs.json_too_deep(b'["' + b"1," * 3000 + b'1"]', 8, max_values=2048) is None  # commas in a string


def test_logit_bias_entries_are_counted_before_repeats_merge(url):
    pairs = [[5, 1.0]] * 5000  # one distinct id: merged, it would pass a distinct count
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/completion", json={"prompt": "hi", "n_predict": 1, "logit_bias": pairs})
        assert r.status_code == 400 and r.json()["error"]["actord"]["param"] == "logit_bias", r.text
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "logit_bias": {str(i): 1 for i in range(2000)}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_a_body_holding_more_values_than_the_bound_is_refused_before_it_is_decoded(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/tokenize", json={"content": ["a"] * 1_000_000})
        assert r.status_code == 413 and r.json()["error"]["actord"]["param"] == "body", r.text
        r = c.post("/completion", json={"prompt": "x", "logit_bias": [[5, 1.0]] * 1_300_000})
        assert r.status_code == 413 and "http_max_json_values" in r.json()["error"]["message"], r.text
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x" * 4_000_000}],
                                                  "max_tokens": 1})
        assert "http_max_json_values" not in r.text  # a long string is one value, whatever its bytes


def test_a_tokenize_list_past_a_prompts_size_is_refused_before_any_tokenizing(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/tokenize", json={"content": [1] * 5000})  # more entries than a prompt holds
        assert r.status_code == 400 and r.json()["error"]["actord"]["param"] == "content", r.text
        r = c.post("/tokenize", json={"content": ["a"] * 1000})  # fits a prompt, but a job per string
        assert r.status_code == 400 and "strings" in r.json()["error"]["message"], r.text
        r = c.post("/tokenize", json={"content": ["a", 5, "b"]})
        assert r.status_code == 200 and 5 in r.json()["tokens"]


def test_a_schema_with_more_alternatives_than_the_bound_is_refused_naming_the_field(url):
    schema = {"type": "string", "enum": [f"v{i}" for i in range(11_500)]}
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        assert r.status_code == 400 and "enum, anyOf and oneOf" in r.json()["error"]["message"], r.text


def test_tools_past_the_prompt_bytes_or_count_are_refused_before_rendering(url):
    def tool(i: int, desc: str = "d") -> dict:
        return {"type": "function", "function": {"name": f"f{i}", "description": desc,
                                                 "parameters": {"type": "object", "properties": {}}}}

    msgs = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": [tool(0, "x" * 200_000)]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": [tool(i) for i in range(200)]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        r = c.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": msgs, "tools": [
            {"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(200)]})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_a_rebinding_host_is_refused_without_a_key_and_the_own_names_pass(url):
    port = url.rsplit(":", 1)[1]
    with httpx.Client(base_url=url, timeout=60) as c:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io"):
            r = c.get("/dashboard/state", headers={"host": host})
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (host, r.text)
            r = c.post("/slots/0?action=erase", headers={"host": host})
            assert r.status_code == 403, host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "my.box",
                     f"my.box:{port}", "app.localhost"):
            assert c.get("/health", headers={"host": host}).status_code == 200, host


def test_host_names_allowed_are_addresses_localhost_and_configured_names():
    allowed = frozenset({"my.box"})
    assert host_allowed("10.1.2.3:8080", allowed) and host_allowed("[fe80::1]:80", allowed)
    assert host_allowed("MY.BOX.", allowed) and host_allowed("localhost", allowed)
    assert not host_allowed("attacker.example", allowed) and not host_allowed("", allowed)
    assert host_allowed("anything", frozenset({"*"}))


@pytest.mark.anyio
async def test_parse_work_past_its_budget_is_a_413_naming_the_field():
    release, ended = threading.Event(), threading.Event()

    def slow() -> int:
        release.wait(30)  # the parse runs on past its budget until the test has its answer
        ended.set()
        return 1

    with pytest.raises(HttpError) as e:
        await costs.offload(slow, size=costs.OFFLOAD_BYTES + 1, budget_s=0.01, field="body")
    assert e.value.status == 413 and e.value.param == "body"
    release.set()
    await eventually(ended.is_set, "the abandoned parse thread ends before the test does")


def test_body_bytes_in_flight_are_bounded_in_all_and_per_address():
    b = costs.BodyBytes(total=100)
    b.add("a", 50)
    with pytest.raises(HttpError) as e:
        b.add("a", 1)  # one address: half the bound
    assert e.value.status == 503 and e.value.param == "body"
    b.add("b", 40)
    with pytest.raises(HttpError):
        b.add("c", 11)  # in all
    b.release("a", 50)
    b.add("c", 11)
    assert b.held == 51 and b.by_peer == {"b": 40, "c": 11}


@pytest.mark.slow
def test_a_body_past_the_bytes_in_flight_gets_503_as_it_arrives(tmp_path):
    model = str(write_tiny_llama(tmp_path / "tiny.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE))
    proc, _, url = _start(model, tmp_path / "d", "--http-max-body-bytes", str(16 << 20),
                          "--http-max-body-bytes-in-flight", str(1 << 20))  # 512 KiB from one address
    try:
        import socket as _socket

        host, port = url.removeprefix("http://").rsplit(":", 1)
        s = _socket.create_connection((host, int(port)), timeout=60)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 4000000\r\n\r\n" + b" " * (700 << 10))  # under the body limit, over the share
        answer = b""
        while not answer.rstrip().endswith(b"}"):  # what the bound must produce, while the body still arrives
            answer += s.recv(65536)
        s.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"http_max_body_bytes_in_flight" in answer, answer
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200  # the bytes were given back
    finally:
        _stop(proc)
