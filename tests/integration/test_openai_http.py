"""The OpenAI-compatible HTTP front, driven by the official `openai` client and raw httpx.

The daemon runs as users run it (`actord serve --http 127.0.0.1:0 --api-key KEY`, its own
process, the front in the same event loop as the socket); the port it bound is read from
`props` over the socket. No network: everything is on loopback.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from actord.client import Client
from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama
from tests.integration.test_daemon import _wait_for

PY = sys.executable
KEY = "test-key"
BODY_LIMIT = 65536


def _start(model: str, tmp: Path, *extra: str) -> tuple[subprocess.Popen, Path, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "actord.sock"
    proc = subprocess.Popen(
        [PY, "-m", "actord.cli", "serve", "--model", model, "--slots", "2", "--ctx", "4096", "--batch", "64",
         "--socket", str(sock), "--page-dir", str(tmp / "pages"), "--log-level", "warning",
         "--http", "127.0.0.1:0", "--http-max-body-bytes", str(BODY_LIMIT), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        _wait_for(sock, proc)
        with Client(str(sock), timeout=10) as c:
            addr = c.call("props")["http"]
    except BaseException:
        _stop(proc)
        raise
    return proc, sock, f"http://{addr}"


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate(timeout=10)  # reaps it and closes its pipes


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-chat.gguf", seed=1,
                                chat_template=TINY_CHAT_TEMPLATE))


@pytest.fixture(scope="module")
def front(chat_model, tmp_path_factory):
    proc, sock, url = _start(chat_model, tmp_path_factory.mktemp("d"), "--api-key", KEY)
    try:
        yield sock, url, proc
    finally:
        _stop(proc)


@pytest.fixture
def client(front) -> openai.OpenAI:
    _, url, _ = front
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=30).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_two_turn_chat_with_user_reuses_the_first_turn_exactly(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    r1 = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=6, temperature=0, user="ada")
    assert r1.choices[0].message.content and r1.choices[0].message.role == "assistant"
    u1 = r1.usage
    assert u1.completion_tokens == 6 and u1.prompt_tokens > 10 and u1.total_tokens == u1.prompt_tokens + 6
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "and then"}]
    r2 = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=6, temperature=0, user="ada")
    # Everything of turn 1 is cached: its prompt and its reply. A reply cut by max_tokens
    # ("length") leaves its last sampled token undecoded, so that one token is re-processed.
    unfed = 1 if r1.choices[0].finish_reason == "length" else 0
    assert r2.usage.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - unfed
    new = len("</s>\n<|user|>\nand then</s>\n<|assistant|>\n")  # byte-fallback-ish: at most one token a char
    assert r2.usage.prompt_tokens - r2.usage.prompt_tokens_details.cached_tokens <= new + unfed


def test_streamed_deltas_join_to_the_whole_answer_under_greedy_sampling(client):
    msgs = [{"role": "user", "content": "the model and the cache"}]
    whole = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_text_completions_and_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    r = client.completions.create(model="tiny-chat", prompt="hello world", max_tokens=5, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-chat", prompt="hello world", max_tokens=5, temperature=0, stream=True))
    assert streamed == r.choices[0].text


def test_wrong_key_unknown_model_and_long_prompt_get_openai_errors(front, client):
    _, url, _ = front
    msgs = [{"role": "user", "content": "hi"}]
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny-chat", messages=msgs)
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.chat.completions.create(model="no-such-model", messages=msgs)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "the " * 5000}],
                                       max_tokens=4)
    assert e.value.status_code in (400, 413) and "does not fit" in e.value.message
    with pytest.raises(openai.APIStatusError) as e:  # streamed: still a status, not a broken stream
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "the " * 5000}],
                                       max_tokens=4, stream=True)
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="alternate|unsupported|n=1"):
        client.chat.completions.create(model="tiny-chat", messages=msgs, n=2)


def test_health_is_public_and_metrics_need_the_key(front):
    _, url, _ = front
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.get(url + "/metrics").status_code == 401
    assert "page_in_total" in httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text


def test_bad_http_input_gets_openai_errors_and_the_daemon_keeps_serving(front, client):
    _, url, proc = front
    h = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    cases = [
        (b"{not json", 400, "malformed JSON"),
        (b'{"messages": "hi"}', 400, "$.messages"),
        (b'{"messages": [{"role": "user", "content": 5}]}', 400, "$.messages[0].content"),
        (b'{"model": "tiny-chat"}', 400, "messages"),
        (b'{"messages": []}', 400, "empty"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "user": "../etc"}', 400, "mind"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "text content"),
        (b'{"messages": [{"role": "user", "content": "' + b"a" * (BODY_LIMIT + 10) + b'"}]}', 413, "limit"),
    ]
    for body, status, words in cases:
        r = httpx.post(url + "/v1/chat/completions", content=body, headers=h, timeout=30)
        assert r.status_code == status, (body[:60], r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["type"] and err["code"], (body[:60], err)
    # A chunked body (no Content-Length) is held to the same limit.
    def gen():
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b" " * 1024
    r = httpx.post(url + "/v1/chat/completions", content=gen(), headers=h, timeout=30)
    assert r.status_code == 413
    assert proc.poll() is None
    ok = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert ok.usage.completion_tokens == 3


def _wait_metric(url: str, name: str, above: float, timeout: float = 20) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = _metric(url, name)
        if v > above:
            return v
        time.sleep(0.05)
    raise AssertionError(f"{name} stayed at {above}")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_generation(front, stream):
    _, url, _ = front
    name = 'requests_total{outcome="cancelled"}'
    before = _metric(url, name)
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": f"go on {stream}"}], "max_tokens": 3800,
            "temperature": 0, "stream": stream}
    h = {"authorization": f"Bearer {KEY}"}
    if stream:
        with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/chat/completions", json=body, headers=h) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few chunks arrive, then the client hangs up
            assert any(g.startswith("data: ") for g in got)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, headers=h, timeout=httpx.Timeout(30, read=0.3))
    _wait_metric(url, name, before)
    # The slot is free again and generation stopped well short of 3800 tokens.
    assert _metric(url, "requests_in_flight") == 0


def test_non_loopback_address_without_a_key_is_refused_at_start(chat_model, tmp_path):
    out = subprocess.run([PY, "-m", "actord.cli", "serve", "--model", chat_model, "--socket", str(tmp_path / "s"),
                          "--http", "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "needs --api-key" in out.stderr


def _mind_workload(turn: callable) -> None:  # type: ignore[valid-type]
    """Four minds, two slots, three turns each: every turn displaces another mind."""
    history = {f"m{i}": [{"role": "user", "content": f"mind {i} says hello"}] for i in range(4)}
    for _ in range(3):
        for mind, msgs in history.items():
            reply, cached, prompt = turn(mind, msgs)
            assert len(msgs) == 1 or prompt - cached <= 40, (mind, cached, prompt)  # only the new messages
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]


def test_many_minds_page_the_same_through_http_as_through_the_socket(chat_model, tmp_path):
    counts = []
    for via in ("socket", "http"):
        proc, sock, url = _start(chat_model, tmp_path / via, "--api-key", KEY, "--page-ram-bytes", "100000000")
        try:
            if via == "socket":
                c = Client(str(sock), timeout=60)

                def turn(mind, msgs):
                    r = c.call("chat", {"messages": msgs, "mind": mind, "n_predict": 4})
                    return r["message"]["content"], r["completion"]["n_cached"], r["completion"]["n_prompt_tokens"]
            else:
                oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)

                def turn(mind, msgs):
                    r = oa.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=4, temperature=0,
                                                   extra_headers={"X-Actord-Mind": mind}, user="ignored-the-header-wins")
                    return (r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens,
                            r.usage.prompt_tokens)
            _mind_workload(turn)
            counts.append((_metric(url, "page_out_total"), _metric(url, "page_in_total")))
            if via == "socket":
                c.close()
        finally:
            _stop(proc)
    assert counts[0] == counts[1] and counts[0][0] >= 8 and counts[0][1] >= 6, counts
