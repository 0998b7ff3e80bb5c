"""The OpenAI HTTP front served at the router (actord/cluster/front.py), driven by the
official `openai` client and raw httpx, against a simulated 2-node cluster with the tiny
chat model: one cluster for the module, its front on 127.0.0.1:0 behind an API key
(`ClusterConfig.node.http` / `api_key`, as `actord cluster up --http ... --api-key ...`).
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from tests.cluster.clusters import NO_RAY, local_cluster, node_config
from tests.waits import wait_until

ray = pytest.importorskip("ray", reason=NO_RAY)
openai = pytest.importorskip("openai")

from actord.cluster.client import ClusterClient, get  # noqa: E402
from actord.frontends.http.turns import mind_for  # noqa: E402
from actord.testing.models import write_tiny_chat  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "cluster-key"
NODES = ("n1", "n2")
FRONT = {"http": "127.0.0.1:0", "api_key": KEY}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return str(write_tiny_chat(tmp_path_factory.mktemp("m") / "tiny-chat.gguf"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, chat_model):
    with local_cluster(tmp_path_factory.mktemp("http"), chat_model, nodes=2, node=FRONT) as c:
        yield c


@pytest.fixture(scope="module")
def ray_client(cluster) -> ClusterClient:
    return ClusterClient(cluster.router)


@pytest.fixture(scope="module")
def url(ray_client) -> str:
    return "http://" + ray_client.status()["router"]["http"]


@pytest.fixture
def client(url) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def turns_applied(cluster) -> dict[str, int]:
    return {n: get(cluster.node(n).load.remote()).unwrap().turns_applied for n in NODES}


def test_a_two_turn_chat_with_the_same_user_reuses_its_first_turn_on_the_directory_node(cluster, ray_client,
                                                                                         client):
    before = turns_applied(cluster)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    r1 = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=6, temperature=0, user="ada")
    u1 = r1.usage
    assert r1.choices[0].message.role == "assistant" and u1.completion_tokens == 6
    mind = mind_for("u", "ada")  # the single-node front's mind for `user`
    entry = ray_client.where(mind)
    assert entry is not None and entry.epoch == 1
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "and then"}]
    r2 = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=6, temperature=0, user="ada")
    # As on one daemon: turn 1's prompt and reply are cached (the node rendered the chat
    # and remembered the turn), but the last token of a reply cut by max_tokens.
    unfed = 1 if r1.choices[0].finish_reason == "length" else 0
    assert r2.usage.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - unfed > 0
    # Both turns ran on the directory's node, as fenced turns of the mind; the other held nothing.
    after = turns_applied(cluster)
    assert {n: after[n] - before[n] for n in NODES} == {n: 2 if n == entry.node else 0 for n in NODES}
    assert ray_client.where(mind) == entry
    held = {n: [h.mind for h in get(cluster.node(n).holdings.remote()).unwrap()] for n in NODES}
    assert [n for n in NODES if mind in held[n]] == [entry.node]
    # The Responses API names a conversation's mind itself; its next response is cached too.
    a = client.responses.create(model="tiny-chat", input="tell me", max_output_tokens=4, temperature=0)
    b = client.responses.create(model="tiny-chat", input="more", previous_response_id=a.id, max_output_tokens=4,
                                temperature=0)
    assert b.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("user", ["bo", None], ids=["a-mind", "no-mind"])
def test_a_streamed_chat_joins_to_the_whole_answer_under_greedy_sampling(client, user):
    kw = {"user": user} if user else {}
    msgs = [{"role": "user", "content": "the model and the cache"}]
    whole = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=12, temperature=0, **kw)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}, **kw))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == whole.choices[0].message.content
    assert len([d for d in deltas if d]) > 1  # relayed chunk by chunk, not as one
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    text = client.completions.create(model="tiny-chat", prompt="hello world", max_tokens=5, temperature=0, **kw)
    streamed = client.completions.create(model="tiny-chat", prompt="hello world", max_tokens=5, temperature=0,
                                         stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text and text.usage.completion_tokens == 5


# Requests a front refuses, each answered by the cluster exactly as by one daemon.
MSGS = [{"role": "user", "content": "x"}]
REFUSED: list[tuple[str, str, Any, dict[str, str]]] = [
    ("POST", "/v1/chat/completions", {"messages": MSGS, "temperature": 5}, {}),
    ("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": -1}, {}),
    ("POST", "/v1/chat/completions", {"messages": []}, {}),
    ("POST", "/v1/chat/completions", {"messages": MSGS, "n_probs": 2}, {}),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, {}),
    ("POST", "/v1/chat/completions", b"{not json", {}),
    ("POST", "/v1/chat/completions", {"messages": MSGS}, {"x-actord-mind": "../x"}),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True}, {}),
    # Over the context: refused by the node that rendered it, the typed error relayed.
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there " * 700}]}, {}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there " * 700}],
                                      "stream": True}, {}),
    ("POST", "/v1/chat/completions", {"messages": MSGS}, {"authorization": "Bearer wrong"}),
    ("GET", "/v1/nothing-here", None, {}),
]


def _send(c: Any, method: str, path: str, body: Any, headers: dict[str, str]) -> Any:
    h = {"authorization": f"Bearer {KEY}", **headers}
    if isinstance(body, bytes):
        return c.request(method, path, content=body, headers={**h, "content-type": "application/json"})
    return c.request(method, path, json=body, headers=h)


def single_node_answers(model: str) -> list[tuple[int, Any]]:
    """What one daemon's front answers each of REFUSED (in process, its ASGI app)."""
    from actord.frontends.http.app import HttpFront
    from actord.service.system import ActorSystem

    async def run() -> list[tuple[int, Any]]:
        cfg = node_config(model, **FRONT)
        async with ActorSystem(cfg) as s:
            app = HttpFront(s, cfg).app
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return [(r.status_code, r.json()) for r in [await _send(c, *req) for req in REFUSED]]

    return anyio.run(run)


def test_refused_requests_get_the_single_node_status_and_error_object(url, chat_model):
    with httpx.Client(base_url=url, timeout=120) as c:
        got = [(r.status_code, r.json()) for r in [_send(c, *req) for req in REFUSED]]
    want = single_node_answers(chat_model)
    for req, g, w in zip(REFUSED, got, want):
        assert g == w, (req[1], str(req[2])[:60])
    assert [s for s, _ in got] == [400] * 10 + [401, 404]
    assert got[0][1]["error"] == {"message": "temperature must be in [0, 2]", "type": "invalid_request_error",
                                  "param": "temperature", "code": "InvalidParams"}
    assert got[8][1]["error"]["code"] == got[9][1]["error"]["code"] == "context_length_exceeded"


def test_what_the_cluster_does_not_serve_is_a_clear_refusal(url, client):
    for call in (lambda: client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, n=2),
                 lambda: client.completions.create(model="m", prompt="x", max_tokens=2, n=2)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.param == "n" and "cluster" in e.value.message
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(model="m", input="x")
    assert e.value.status_code == 501 and e.value.code == "NotServed"
    h = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, timeout=60) as c:
        for method, path in (("GET", "/slots"), ("POST", "/completion"), ("POST", "/tokenize"), ("GET", "/props")):
            r = c.request(method, path, headers=h, json={})
            err = r.json()["error"]  # llama-server's error object, as one daemon answers these routes
            assert r.status_code == 501 and err["code"] == 501 and err["actord"]["type"] == "NotServed", path
        assert c.get("/slots").status_code == 401  # the key first
        health = c.get("/health").json()
        assert health["status"] == "ok" and health["live_nodes"] == 2
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]


def test_a_client_that_hangs_up_mid_stream_cancels_the_turn_on_its_node(cluster, ray_client, url):
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 900,
            "temperature": 0, "user": "hangs-up", "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"},
                      timeout=120) as s:
        for line in s.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # the first generated text: hang up (900 tokens take about a second here)
    mind = mind_for("u", "hangs-up")
    node = ray_client.where(mind).node
    wait_until(lambda: get(cluster.node(node).load.remote()).unwrap().queue == 0, "the node's queue empties")
    # The node's turn was cancelled (ray.cancel), not run to its end: never recorded as applied.
    held = [h for h in get(cluster.node(node).holdings.remote()).unwrap() if h.mind == mind]
    assert [h.last_turn for h in held] == [None]


def test_while_the_router_is_down_its_http_address_answers_a_typed_503(cluster, ray_client, url):
    """Issue 33: a node on the router's machine stands in for its HTTP front while the
    router's process is gone (actord/cluster/standin.py): 503 in OpenAI's shape, code
    NodeUnavailable, not a refused connection. The router is killed without restart so the
    stand-in is surely seen, then started again as Ray would (last: on port 0 it takes
    another port)."""
    from actord.cluster.local import start_router

    ray.kill(cluster.router, no_restart=True)
    try:
        while True:  # refused only until a node sees the router's process gone and stands in
            try:
                r = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=30)
            except httpx.TransportError:
                continue
            if r.status_code == 200:
                continue  # ray.kill returns before the process ends: the router answered once more
            break
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "NodeUnavailable"
    finally:
        cluster.router = ray_client.router = start_router(cluster.cfg, cluster.cluster.head_node.node_id)
    assert ray_client.status()["router"]["http"]  # the restarted router serves its front again
