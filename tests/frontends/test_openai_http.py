"""The OpenAI-compatible HTTP front, driven by the official `openai` client and raw httpx.

The daemon runs as users run it (`actord serve --http 127.0.0.1:0 --api-key KEY`, its own
process, the front in the same event loop as the socket); the port it bound is read from
`props` over the socket. No network: everything is on loopback.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from actord.frontends.client import Client
from actord.frontends.http.turns import mind_for
from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama
from actord.testing.daemon import wait_until_serving
from tests.waits import wait_until

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
        wait_until_serving(proc, sock, timeout_s=60, poll_s=0.1)
        with Client(str(sock), timeout=10) as c:
            addr = c.call("props")["http"]
    except BaseException:
        _stop(proc)
        raise
    return proc, sock, f"http://{addr}"


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate(timeout=10)  # reaps it and closes its pipes


def front_on_tiny(tmp_path_factory, *flags: str, chat: bool = True, tools: bool = False, keys: str = KEY):
    """A module fixture's body: a daemon with the HTTP front (and `keys`, KEY by default) on
    the tiny llama (with a chat template unless `chat` is False; with `tools`, the Hermes
    tool-calling one and its markers as control tokens); yields (socket, url), stopped after."""
    from actord.testing.models import HERMES_TOOL_TEMPLATE

    kw: dict = {"chat_template": TINY_CHAT_TEMPLATE} if chat else {}
    if tools:
        kw = {"chat_template": HERMES_TOOL_TEMPLATE, "control_tokens": ("<tool_call>", "</tool_call>")}
    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=1, **kw))
    proc, sock, url = _start(model, tmp_path_factory.mktemp("d"), "--api-key", keys, *flags)
    try:
        yield sock, url
    finally:
        _stop(proc)


def openai_client(url: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-chat.gguf", seed=1,
                                chat_template=TINY_CHAT_TEMPLATE))


@pytest.fixture(scope="module")
def front(chat_model, tmp_path_factory):
    proc, sock, url = _start(chat_model, tmp_path_factory.mktemp("d"), "--api-key", KEY, "--model-alias", "tiny-alias")
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


def test_a_mind_keeps_her_cache_through_ten_anonymous_requests_on_two_slots(client):
    """Issue 26: anonymous requests (no `user`) two at a time on a 2-slot daemon need her slot
    too; she goes to her page first and her next turn is cached whole."""
    import concurrent.futures

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about the sea"}]
    r1 = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=6, temperature=0, user="ida")
    u1 = r1.usage

    def anonymous(i: int) -> None:
        client.chat.completions.create(model="tiny-chat", max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": f"anonymous question {i}"}])

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(anonymous, range(10)))
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "and then"}]
    r2 = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=6, temperature=0, user="ida")
    unfed = 1 if r1.choices[0].finish_reason == "length" else 0
    assert r2.usage.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - unfed


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
    assert [m.id for m in models.data] == ["tiny-alias"]  # listed once, by its alias (llama-server's)
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o-mini")  # served when asked for, but not listed, so not found
    assert e.value.code == "model_not_found"
    r = client.completions.create(model="tiny-chat", prompt="hello world", max_tokens=5, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-chat", prompt="hello world", max_tokens=5, temperature=0, stream=True))
    assert streamed == r.choices[0].text


def test_wrong_key_gets_an_authentication_error(front):
    _, url, _ = front
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "invalid_api_key"


def test_placeholder_model_name_is_served(client):
    msgs = [{"role": "user", "content": "hello world"}]
    r = client.chat.completions.create(model="gpt-4o-mini", messages=msgs, max_tokens=4, temperature=0)
    assert r.model == "gpt-4o-mini" and r.usage.completion_tokens == 4  # echoed, as llama-server does
    same = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=4, temperature=0)
    assert same.choices[0].message.content == r.choices[0].message.content
    t = client.completions.create(model="text-davinci-003", prompt="hello", max_tokens=2, temperature=0)
    assert t.model == "text-davinci-003" and t.usage.completion_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_context_overflow_is_400_context_length_exceeded(client, stream):
    with pytest.raises(openai.BadRequestError) as e:  # streamed too: a status, not a broken stream
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "the " * 5000}],
                                       max_tokens=4, stream=stream)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in e.value.message and "does not fit" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-chat", prompt=list(range(3, 4103)), max_tokens=4, stream=stream)
    assert e.value.code == "context_length_exceeded"


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
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "text content"),
        (b'{"messages": [{"role": "user", "content": "' + b"a" * (BODY_LIMIT + 10) + b'"}]}', 413, "limit"),
    ]
    for body, status, words in cases:
        r = httpx.post(url + "/v1/chat/completions", content=body, headers=h, timeout=30)
        assert r.status_code == status, (body[:60], r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["type"] and err["code"], (body[:60], err)
    # The header names a mind as given: it must be a valid name (user and prompt_cache_key are free-form).
    r = httpx.post(url + "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "x"}]}',
                   headers={**h, "x-actord-mind": "../etc"}, timeout=30)
    assert r.status_code == 400 and "mind" in r.json()["error"]["message"]
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
    """`name`'s value once it has passed `above` (counters start at 0: a value past it is truthy)."""
    return wait_until(lambda: (v := _metric(url, name)) > above and v, f"{name} above {above}", timeout=timeout)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_generation(front, stream):
    _, url, _ = front
    name = 'requests_total{outcome="cancelled"}'
    gone = 'http_client_gone_total{phase="generation"}'
    before, gone_before = _metric(url, name), _metric(url, gone)
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
    assert _wait_metric(url, gone, gone_before) == gone_before + 1
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


@pytest.mark.slow
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


# -- names, routes, fields (issue 17 points 3-6) --------------------------------------------


def _minds(sock: Path) -> set[str]:
    with Client(str(sock), timeout=30) as c:
        return {s["mind"] for s in c.call("slot.list") if s["mind"]} | {p["page"] for p in c.call("page.list")}


def test_user_with_spaces_maps_to_a_stable_mind(front, client):
    sock, _, _ = front
    user = "Ada Lovelace: analyst/engine " + "x" * 200  # a space, ':', '/', over 128 characters
    msgs = [{"role": "user", "content": "a mind with a free-form name"}]
    r1 = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0, user=user)
    assert mind_for("u", user) in _minds(sock)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "again"}]
    r2 = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0, user=user)
    # The same mind served turn 2: everything of turn 1 but at most its last token was cached.
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens + r1.usage.completion_tokens - 1


def test_prompt_cache_key_takes_precedence_over_user(front, client):
    sock, _, _ = front
    msgs = [{"role": "user", "content": "cache routing by key"}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=2, temperature=0, user="someone",
                                   prompt_cache_key="conversation 7")
    minds = _minds(sock)
    assert mind_for("k", "conversation 7") in minds and mind_for("u", "someone") not in minds


def test_unknown_route_is_json_404(front):
    _, url, _ = front
    h = {"authorization": f"Bearer {KEY}"}
    for method, path in [("GET", "/nope"), ("POST", "/v1/responses/x/cancel"), ("GET", "/v1/chat"), ("POST", "/completion/x")]:
        r = httpx.request(method, url + path, headers=h, json={})
        assert r.status_code == 404 and r.headers["content-type"] == "application/json", (path, r.text)
        assert r.json()["error"]["type"] == "not_found_error" and path in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/chat/completions", headers=h)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_bare_paths_are_served_as_llama_server_does(front):
    _, url, _ = front
    bare = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)  # no /v1
    r = bare.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert [m.id for m in bare.models.list().data] == ["tiny-alias"]
    assert httpx.get(url + "/v1/health").json()["status"] == "ok"


def test_finished_stream_is_not_counted_as_client_gone(front, client):
    _, url, _ = front
    before = _metric(url, 'http_client_gone_total{phase="generation"}')
    msgs = [{"role": "user", "content": "finish normally"}]
    for stream in (True, False):
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=3, temperature=0, stream=stream)
        if stream:
            assert [c.choices[0].finish_reason for c in r if c.choices][-1] == "length"
    for c in client.completions.create(model="m", prompt="hello", max_tokens=3, stream=True):
        pass
    assert _metric(url, 'http_client_gone_total{phase="generation"}') == before


def test_developer_role_is_rendered_as_system_for_a_template_without_it(client):
    def tokens(role):
        return client.chat.completions.create(model="m", messages=[{"role": role, "content": "be brief"},
                                                                   {"role": "user", "content": "hi"}],
                                              max_tokens=3, temperature=0)
    dev, sys_ = tokens("developer"), tokens("system")
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens
    assert dev.choices[0].message.content == sys_.choices[0].message.content


@pytest.mark.slow
def test_developer_role_reaches_gemma_template_as_system(chat_model, tmp_path):
    from actord.testing.models import GEMMA3_CHAT_TEMPLATE

    tpl = tmp_path / "gemma.jinja"
    tpl.write_text(GEMMA3_CHAT_TEMPLATE)
    proc, _, url = _start(chat_model, tmp_path / "d", "--chat-template-file", str(tpl))
    try:
        oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = oa.chat.completions.create(model="m", messages=[{"role": "developer", "content": "be brief"},
                                                            {"role": "user", "content": "hi"}], max_tokens=2)
        assert r.usage.completion_tokens == 2  # Gemma's template would refuse an unknown first role
    finally:
        _stop(proc)


def test_text_content_parts_join_with_a_newline(client):
    parts = client.chat.completions.create(
        model="m", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}])
    joined = client.chat.completions.create(model="m", max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "hello\nworld"}])
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    assert parts.choices[0].message.content == joined.choices[0].message.content


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_zero_is_refused_naming_it(client, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **{field: 0})
    assert e.value.param == field


@pytest.mark.parametrize("field,value", [
    ("n", 99), ("n_probs", 2), ("tool_choice", "required"),
    ("tools", [{"type": "function", "function": {"description": "no name"}}]),
])
def test_a_field_actord_cannot_honour_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: value})
    assert e.value.param.split("[")[0] == field and field in e.value.message


def test_completions_take_one_prompt_in_a_list_and_refuse_more_than_max_n(client):
    one = client.completions.create(model="m", prompt=["hello world"], max_tokens=3, temperature=0)
    plain = client.completions.create(model="m", prompt="hello world", max_tokens=3, temperature=0)
    assert one.choices[0].text == plain.choices[0].text
    for field, kw in [("prompt", {"prompt": ["a"] * 9}), ("echo", {"prompt": "a", "echo": True}),
                      ("suffix", {"prompt": "a", "suffix": "z"})]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="m", max_tokens=2, **kw)
        assert e.value.param == field


def test_system_fingerprint_is_on_every_answer(client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
    assert r.system_fingerprint and r.system_fingerprint.startswith("b")  # llama-server's b<build> form
    chunks = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=2, stream=True))
    assert {c.system_fingerprint for c in chunks} == {r.system_fingerprint}
    assert client.completions.create(model="m", prompt="hi", max_tokens=2).system_fingerprint == r.system_fingerprint


def test_chat_default_max_tokens_is_bounded_not_the_context(chat_model, tmp_path):
    proc, _, url = _start(chat_model, tmp_path / "d", "--http-default-max-tokens", "7")
    try:
        oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "go on and on"}],
                                       temperature=0)
        assert r.usage.completion_tokens <= 7
    finally:
        _stop(proc)


@pytest.mark.slow
def test_a_prompt_longer_than_4096_tokens_fits_a_larger_context(chat_model, tmp_path):
    """The edge checks a request under this daemon's limits, not the defaults' (4096)."""
    proc, _, url = _start(chat_model, tmp_path / "d", "--ctx", "8192")
    try:
        oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = [3 + i % 500 for i in range(5000)]
        r = oa.completions.create(model="m", prompt=prompt, max_tokens=1)
        assert r.usage.prompt_tokens == 5000 and r.usage.completion_tokens == 1
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model="m", prompt=[3 + i % 500 for i in range(8200)], max_tokens=1)
        assert e.value.code == "context_length_exceeded" and "8192" in e.value.message
    finally:
        _stop(proc)


def test_without_cors_origin_any_browser_page_is_served_and_its_preflight_answered(front):
    """llama-server's default: browser UIs built on it connect unchanged (the key still holds)."""
    _, url, _ = front
    for ui in ("http://ui.example", "https://chat.example:8443"):
        pre = httpx.options(url + "/v1/chat/completions", headers={
            "origin": ui, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", ui)
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert pre.headers["access-control-allow-headers"] == "*"  # llama-server's (--cors-headers to name them)
        r = httpx.get(url + "/v1/models", headers={"origin": ui, "authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", ui)
    assert httpx.get(url + "/v1/models", headers={"origin": "http://ui.example"}).status_code == 401


@pytest.mark.parametrize("origin,allowed", [
    ("http://localhost:8080", True), ("http://127.0.0.1:5173", True), ("https://[::1]", True),
    ("http://localhost", True), ("http://ui.example", True), ("http://localhost.evil.example", False),
    ("http://127.0.0.1.evil.example", False), ("http://evil.example", False), ("null", False)])
def test_the_localhost_keyword_allows_local_origins_only(origin, allowed):
    from actord.frontends.http.cors import origin_allowed

    assert origin_allowed(origin, frozenset({"localhost", "http://ui.example"})) is allowed
    assert origin_allowed(origin, frozenset()) and origin_allowed(origin, frozenset({"*"}))


@pytest.mark.slow
def test_cors_preflight_for_an_allowed_origin_and_refusal_for_others(chat_model, tmp_path):
    ui = "http://ui.example"
    proc, _, url = _start(chat_model, tmp_path / "d", "--cors-origin", ui, "--cors-origin", "localhost")
    try:
        pre = httpx.options(url + "/v1/chat/completions", headers={
            "origin": ui, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ui
        assert "POST" in pre.headers["access-control-allow-methods"]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        ok = httpx.post(url + "/v1/chat/completions", json=body, headers={"origin": ui}, timeout=60)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ui
        # Any other page is refused, a preflight or not: a website must not drive a loopback
        # daemon through its user's browser.
        for method in ("POST", "OPTIONS"):
            r = httpx.request(method, url + "/v1/chat/completions", json=body, headers={
                "origin": "http://evil.example", "access-control-request-method": "POST"}, timeout=60)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200  # no Origin
        local = "http://localhost:5173"  # the keyword: a UI served from this machine
        pre = httpx.options(url + "/v1/chat/completions", headers={
            "origin": local, "access-control-request-method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == local
        ok = httpx.post(url + "/v1/chat/completions", json=body, headers={"origin": local}, timeout=60)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == local
    finally:
        _stop(proc)
