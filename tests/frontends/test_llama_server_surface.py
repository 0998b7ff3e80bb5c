"""llama-server's wire and server surface on the HTTP front (issue 28): header names in
their canonical case, its CORS answers, /metrics and /slots off (501), the UI page at `/`,
several listen addresses, model aliases and tags, `__verbose`, Vertex AI's prediction
route, and the flags that turn them on and off.

The front is driven as an ASGI app (httpx's ASGITransport) with no system attached, or
served by its own uvicorn protocol on loopback where the wire's bytes are what is pinned;
no model, no network beyond loopback.
"""

from __future__ import annotations

import socket
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from actord.frontends.config_flags import serve_config
from actord.frontends.http.app import HttpFront
from actord.frontends.http.bounds import answer, canonical_head
from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams
from tests.waits import eventually

KEY = "surface-key"
pytestmark = pytest.mark.anyio
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # uvicorn serves on asyncio


def front(**kw: Any) -> HttpFront:
    return HttpFront(None, Config(model="/models/tiny.gguf", **{"api_key": KEY, **kw}))


def client(f: HttpFront) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=f.app), base_url="http://front")


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


# -- header names ---------------------------------------------------------------------------


def test_an_answer_head_gets_canonical_names_and_its_values_untouched():
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\naccess-control-allow-origin: http://a.b\r\n" \
           b"etag: \"x-y\"\r\nx-actord-mind: ada\r\n\r\n"
    assert canonical_head(head) == b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" \
        b"Access-Control-Allow-Origin: http://a.b\r\nETag: \"x-y\"\r\nX-Actord-Mind: ada\r\n\r\n"
    assert b"Content-Type: application/json" in answer(503, "busy", "Overloaded", retry_after=1)
    assert b"Retry-After: 1" in answer(503, "busy", "Overloaded", retry_after=1)


def test_an_answer_head_leaves_with_its_first_body_bytes_in_one_send_or_alone_at_the_turns_end():
    import asyncio

    from actord.frontends.http.bounds import _CanonicalHead

    class Sends:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.sent.append(data)

        def writelines(self, parts) -> None:  # one send of all the parts (uvloop: writev)
            self.sent.append(b"".join(parts))

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            self.sent.append(b"<closed>")

    head = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n"

    async def main() -> tuple[list[bytes], list[bytes], list[bytes]]:
        loop = asyncio.get_running_loop()
        whole, alone, closed = Sends(), Sends(), Sends()
        t = _CanonicalHead(whole, loop)
        t.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # an interim answer goes at once
        t.write(head)
        t.write(b"{}")
        t.write(b"more")
        _CanonicalHead(alone, loop).write(head)  # a stream's head whose first chunk is late
        c = _CanonicalHead(closed, loop)
        c.write(head)
        c.close()  # a HEAD answer's: no body write, the connection closed
        await asyncio.sleep(0)
        return whole.sent, alone.sent, closed.sent

    canonical = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\n\r\n"
    whole, alone, closed = asyncio.run(main())
    assert whole == [b"HTTP/1.1 100 Continue\r\n\r\n", canonical + b"{}", b"more"]
    assert alone == [canonical] and closed == [canonical, b"<closed>"]


async def _raw(port: int, request: bytes) -> bytes:
    async with await anyio.connect_tcp("127.0.0.1", port) as s:
        await s.send(request)
        out = b""
        with anyio.move_on_after(10):
            while True:
                try:
                    out += await s.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
        return out


@ASYNCIO_ONLY
async def test_header_names_go_out_canonical_on_whole_and_streamed_answers_and_the_body_is_untouched():
    f = front(api_key=None)

    async def events(request: Request) -> StreamingResponse:
        async def gen() -> Any:
            for i in range(3):
                yield f"data: content-type: {i}\r\n\r\n".encode()
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def whole(request: Request) -> JSONResponse:
        return JSONResponse({"k": "content-type: x"}, headers={"x-custom-thing": "v"})

    f.app.router.routes[:0] = [Route("/sse", events), Route("/whole", whole)]
    f.config = msgspec.structs.replace(f.config, http="127.0.0.1:0")
    async with anyio.create_task_group() as tg:
        address = await tg.start(f.serve)
        port = int(address.rsplit(":", 1)[1])
        sse = await _raw(port, b"GET /sse HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        one = await _raw(port, b"GET /whole HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        tg.cancel_scope.cancel()
    head, _, body = sse.partition(b"\r\n\r\n")
    assert b"\r\nContent-Type: text/event-stream" in head and b"\r\nTransfer-Encoding: chunked" in head
    assert b"content-type" not in head and body.count(b"data: content-type: ") == 3  # the body as the app wrote it
    head, _, body = one.partition(b"\r\n\r\n")
    assert b"\r\nX-Custom-Thing: v" in head and b"\r\nContent-Length: " in head and b"\r\nDate: " in head
    assert body == b'{"k":"content-type: x"}'


# -- CORS -----------------------------------------------------------------------------------


PREFLIGHT = {"origin": "web.mydomain.fr", "access-control-request-method": "POST",
             "access-control-request-headers": "Authorization"}


async def test_a_preflight_is_answered_as_llama_server_answers_it_before_the_key():
    async with client(front()) as c:
        r = await c.options("/completions", headers=PREFLIGHT)
        assert r.status_code == 200 and r.content == b""
        assert r.headers["access-control-allow-origin"] == "web.mydomain.fr"  # reflected, not "*"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        assert r.headers["access-control-allow-headers"] == "*"
        r = await c.get("/v1/models", headers={"origin": "http://ui.example", **auth()})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert "access-control-allow-origin" not in (await c.get("/v1/models", headers=auth())).headers
    async with client(front(cors_headers="Authorization, Content-Type")) as c:
        r = await c.options("/completions", headers=PREFLIGHT)
        assert r.headers["access-control-allow-headers"] == "Authorization, Content-Type"


async def test_a_browser_answer_exposes_the_degraded_header_to_the_page_script():
    """A page's script reads only the headers an answer exposes: X-Actord-Degraded (what its
    request was answered without) is named in Access-Control-Expose-Headers whenever an
    origin is served, and nothing is added for a client that sent no Origin."""
    async with client(front()) as c:
        r = await c.get("/v1/models", headers={"origin": "http://ui.example", **auth()})
        assert r.status_code == 200
        assert r.headers["access-control-expose-headers"] == "X-Actord-Degraded"
        r = await c.get("/v1/models", headers={"origin": "http://ui.example"})  # an error answer too
        assert r.status_code == 401 and r.headers["access-control-expose-headers"] == "X-Actord-Degraded"
        assert "access-control-expose-headers" not in (await c.get("/v1/models", headers=auth())).headers


async def test_an_origin_the_list_does_not_name_is_still_refused_preflight_or_not():
    async with client(front(cors_origin=["localhost"])) as c:
        r = await c.options("/completions", headers={**PREFLIGHT, "origin": "http://evil.example"})
        assert r.status_code == 403
        r = await c.options("/completions", headers={**PREFLIGHT, "origin": "http://127.0.0.1:3000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://127.0.0.1:3000"


# -- routes off: /metrics, /slots, the UI -------------------------------------------------------


@pytest.mark.parametrize("path,flag", [("/metrics", "http_metrics"), ("/slots", "http_slots")])
async def test_metrics_and_slots_off_answer_501_in_llama_servers_shape(path, flag):
    async with client(front(**{flag: False})) as c:
        r = await c.get(path, headers=auth())
    assert r.status_code == 501
    err = r.json()["error"]
    assert err["code"] == 501 and err["type"] == "not_supported_error" and "--" + flag.replace("_", "-") in err["message"]


async def test_the_ui_page_is_at_the_root_with_its_assets_public_and_its_data_keyed():
    async with client(front()) as c:
        root = await c.get("/")
        assert root.status_code == 200 and root.text.startswith("<!doctype html>")
        assert root.headers["content-security-policy"].count("manifest-src 'self'") == 1
        assert (await c.get("/dashboard")).content == root.content
        manifest = (await c.get("/manifest.webmanifest")).json()
        assert manifest["start_url"] == "/"
        version = await c.get("/_app/version.json")
        assert version.status_code == 200 and "version" in version.json()
        sw = await c.get("/sw.js")
        assert sw.status_code == 200 and "unregister()" in sw.text
        assert (await c.get("/dashboard/state")).status_code == 401
    async with client(front(http_ui=False)) as c:
        for path in ("/", "/dashboard", "/sw.js", "/manifest.webmanifest", "/_app/version.json"):
            assert (await c.get(path)).status_code == 404, path
        assert (await c.get("/dashboard/state")).status_code == 401  # the data route stays, keyed


# -- names ------------------------------------------------------------------------------------


async def test_the_model_is_listed_once_by_its_first_alias_with_every_alias_and_tag():
    f = front(model_alias=["tinyllama-2,fim", "code"], model_tags=["chat,fim,small"])
    async with client(f) as c:
        data = (await c.get("/v1/models", headers=auth())).json()["data"]
        assert len(data) == 1 and data[0]["id"] == "code"
        assert data[0]["aliases"] == ["code", "fim", "tinyllama-2"] and data[0]["tags"] == ["chat", "fim", "small"]
        for name in ("fim", "tiny", "tiny.gguf"):  # any alias, the stem, the file name
            assert (await c.get(f"/v1/models/{name}", headers=auth())).status_code == 200
    async with client(front()) as c:
        only = (await c.get("/models", headers=auth())).json()["data"]
        assert [m["id"] for m in only] == ["tiny"] and only[0]["aliases"] == [] and only[0]["tags"] == []


def test_empty_alias_or_tag_pieces_are_refused():
    for kw in ({"model_alias": ["a,,b"]}, {"model_tags": ["x,"]}):
        with pytest.raises(InvalidParams, match="must not be empty"):
            Config(model="m.gguf", **kw).validate()


# -- several addresses -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@ASYNCIO_ONLY
async def test_several_addresses_are_served_by_one_front_and_share_its_connection_count():
    if not _ipv6():
        pytest.skip("no IPv6 loopback here")
    port = _free_port()
    f = front(http=f"127.0.0.1:{port},[::1]:{port}")
    f.bind()
    assert f.address == f"127.0.0.1:{port},[::1]:{port}"
    async with anyio.create_task_group() as tg:
        await tg.start(f.serve)
        async with httpx.AsyncClient(timeout=10) as c:
            for host in ("127.0.0.1", "[::1]"):
                assert (await c.get(f"http://{host}:{port}/health")).status_code == 503  # served: no system yet
        a = await anyio.connect_tcp("127.0.0.1", port)
        b = await anyio.connect_tcp("::1", port)
        # The two accepted by the loop (each its own listener), counted once for all of them.
        await eventually(lambda: f.gate.open == 2, "both connections counted by the one gate")
        await a.aclose()
        await b.aclose()
        tg.cancel_scope.cancel()
    assert f._socks == []


def test_port_zero_with_several_addresses_is_refused():
    with pytest.raises(InvalidParams, match="port 0"):
        front(http="127.0.0.1:0,127.0.0.1:0").bind()


# -- __verbose ----------------------------------------------------------------------------------


async def test_verbose_answers_carry_llama_servers_debug_object_whole_and_streamed():
    from actord.frontends.http.openai.routes import OpenAIAnswer
    from actord.vocabulary.types import CompletionResult, Timings

    class F:
        fingerprint = "b0-x"

    r = CompletionResult(content="a\nb", tokens=[5, 6, 7], n_prompt_tokens=4, n_prompt_processed=4, n_cached=0,
                         slot=1, stop_reason="length", timings=Timings(10.0, 20.0, 400.0, 150.0))

    async def run(on_token: Any) -> CompletionResult:
        return r

    async def prompt() -> str:
        return "<bos>Book"

    whole = await OpenAIAnswer(F(), run, chat=False, model="m", stream=False, include_usage=False,
                               logprobs=False, prompt_of=prompt).whole()
    v = whole["__verbose"]
    assert v["prompt"] == "<bos>Book" and v["content"] == "a\nb" and v["tokens_predicted"] == 3
    assert v["stop_type"] == "limit" and v["has_new_line"] and v["timings"]["predicted_n"] == 3
    chunks = await OpenAIAnswer(F(), run, chat=True, model="m", stream=True, include_usage=True,
                                logprobs=False, prompt_of=prompt).streamed(None)
    assert "__verbose" in chunks[0] and all("__verbose" not in c for c in chunks[1:])
    plain = await OpenAIAnswer(F(), run, chat=False, model="m", stream=False, include_usage=False,
                               logprobs=False).whole()
    assert "__verbose" not in plain


def test_the_generation_rate_is_over_the_tokens_after_the_first():
    from actord.frontends.http.openai.answers import llama_timings
    from actord.vocabulary.types import CompletionResult, Timings

    def t(n: int) -> dict[str, Any]:
        return llama_timings(CompletionResult(content="", tokens=list(range(n)), n_prompt_tokens=2,
                                              n_prompt_processed=2, n_cached=0, slot=0, stop_reason="length",
                                              timings=Timings(5.0, 30.0, 400.0, 1.0)))

    assert t(1)["predicted_per_second"] == 0.0 and t(1)["predicted_per_token_ms"] == 0.0
    assert t(16)["predicted_per_second"] == pytest.approx(1e3 / 30.0 * 15) and t(16)["predicted_per_token_ms"] == 2.0


# -- /metrics ----------------------------------------------------------------------------------


class _System:
    def __init__(self) -> None:
        from actord.vocabulary.metrics import Metrics

        self.metrics = Metrics()

    def n_deferred(self) -> int:
        return 0


def test_llama_servers_series_have_its_names_kinds_and_window_rates():
    from actord.frontends.http.native.metrics import LlamaSeries

    s, series = _System(), LlamaSeries()
    m = s.metrics
    m.engine_steps_total.inc(4)
    m.engine_step_seqs_total.inc(6)
    m.prompt_tokens_total.inc(10)
    m.prompt_tokens_processed_total.inc(8)
    m.prompt_tokens_cached_total.inc(2)
    m.prompt_seconds_total.inc(2.0)
    m.predicted_steps_total.inc(30)
    m.predicted_seconds_total.inc(3.0)
    m.n_tokens_max.set(40)

    def parse(text: str) -> dict[str, tuple[str, float]]:
        kinds = {ln.split()[2]: ln.split()[3] for ln in text.splitlines() if ln.startswith("# TYPE ")}
        return {ln.split()[0]: (kinds[ln.split()[0]], float(ln.split()[1]))
                for ln in text.splitlines() if ln.startswith("llamacpp:")}

    got = parse(series.series(s))
    assert got["llamacpp:prompt_tokens_total"] == ("counter", 8) and got["llamacpp:prompt_tokens_cached_total"][1] == 2
    assert got["llamacpp:n_tokens_max"] == ("counter", 40)  # a counter in llama-server's list too
    assert got["llamacpp:prompt_seconds_total"][1] == 2 and got["llamacpp:tokens_predicted_seconds_total"][1] == 3
    assert got["llamacpp:prompt_tokens_seconds"] == ("gauge", 4) and got["llamacpp:predicted_tokens_seconds"][1] == 10
    assert got["llamacpp:n_busy_slots_per_decode"] == ("gauge", 1.5)
    assert parse(series.series(s))["llamacpp:predicted_tokens_seconds"][1] == 0  # nothing since the last scrape


async def test_metrics_carry_the_process_start_time_header():
    f = front()
    f.system = _System()  # type: ignore[assignment]
    f.system.metrics_text = lambda: ""  # type: ignore[attr-defined]
    async with client(f) as c:
        r = await c.get("/metrics", headers=auth())
    assert r.status_code == 200 and r.headers["process-start-time-unix"] == str(f.created)
    assert "# TYPE llamacpp:n_decode_total counter" in r.text


# -- Vertex AI --------------------------------------------------------------------------------


def test_vertex_settings_come_from_its_container_variables(monkeypatch):
    from actord.frontends.http.vertex import request_format

    assert Config(model="m.gguf").vertex is False
    monkeypatch.setenv("AIP_MODE", "PREDICTION")
    monkeypatch.setenv("AIP_HTTP_PORT", "9123")
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "v1/predict")
    c = Config(model="m.gguf")
    assert c.vertex and c.aip_http_port == 9123 and c.aip_predict_route == "v1/predict"
    assert request_format("/v1/chat/completions") == "chatCompletions"
    assert request_format("/apply-template") == "applyTemplate" and request_format("/slots/{id}") == "slots"


def test_vertex_listens_on_its_port_and_its_route_may_not_hide_ours():
    port = _free_port()
    f = front(aip_mode="PREDICTION", aip_http_port=port, http="127.0.0.1:8")
    try:
        assert f.bind().getsockname()[1] == port
    finally:
        f.close()
    with pytest.raises(InvalidParams, match="AIP_PREDICT_ROUTE"):
        front(aip_mode="PREDICTION", aip_predict_route="/completion")


async def test_a_prediction_serves_each_instance_by_its_route_in_order():
    f = front(aip_mode="PREDICTION", aip_health_route="/isalive")
    seen: list[Any] = []

    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append((body, request.headers.get("authorization")))
        return JSONResponse({"got": body.get("x")}, status_code=200 if body.get("x") != 2 else 400)

    f.app.router.routes.insert(0, Route("/v1/echo-this", echo, methods=["POST"]))
    async with client(f) as c:
        assert (await c.post("/predict", json={"instances": []})).status_code == 401  # keyed like the rest
        r = await c.post("/predict", headers=auth(), json={"instances": [
            {"@requestFormat": "echoThis", "x": 1, "stream": True}, {"@requestFormat": "/v1/echo-this", "x": 2},
            {"@requestFormat": "nothing"}, {"x": 3}, 7]})
        assert r.status_code == 200
        p = r.json()["predictions"]
        assert p[0] == {"got": 1} and p[1] == {"got": 2}  # a route's error answer is its prediction
        assert "no handler" in p[2]["error"]["message"] and "@requestFormat" in p[3]["error"]["message"]
        assert p[4]["error"]["code"] == 400
        assert sorted(b["x"] for b, _ in seen) == [1, 2] and all(a == f"Bearer {KEY}" for _, a in seen)
        assert next(b for b, _ in seen if b["x"] == 1)["stream"] is False
        too_many = await c.post("/predict", headers=auth(), json={"instances": [{}] * 129})
        assert too_many.status_code == 400
        assert (await c.get("/isalive")).status_code == 503  # /health's answer, before the model loads


# -- flags ---------------------------------------------------------------------------------


def test_the_surface_flags_are_generated_from_config():
    c = serve_config(["--model", "m.gguf", "--no-http-metrics", "--no-http-slots", "--no-http-ui", "--http-verbose",
                      "--model-alias", "a,b", "--model-tags", "t1,t2", "--cors-headers", "Authorization",
                      "--http", "127.0.0.1:8080,[::1]:8080"])
    assert (c.http_metrics, c.http_slots, c.http_ui, c.http_verbose) == (False, False, False, True)
    assert c.model_alias == ["a,b"] and c.model_tags == ["t1,t2"] and c.cors_headers == "Authorization"
    d = Config(model="m.gguf")
    assert (d.http_metrics, d.http_slots, d.http_ui, d.http_verbose) == (True, True, True, False)
    with pytest.raises(InvalidParams, match="needs --api-key"):
        Config(model="m.gguf", http="127.0.0.1:8080,0.0.0.0:8080").validate()
