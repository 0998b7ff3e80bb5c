"""JSON-RPC 2.0 to the letter, and the request bounds checked before any work.

The protocol tests run the real RpcServer over a real socket in this process, on both
anyio backends, against an ActorSystem on the tiny model.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
import msgspec
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from actord.vocabulary.types import CompletionRequest, RequestLimits
from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams, PathRefused, PromptTooLong
from actord.frontends.rpc import protocol as P
from actord.frontends.rpc.server import RpcServer
from actord.storage.paths import check_page_name, confine
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def serving(tiny_model: str, tmp_path: Any, **over: Any) -> AsyncIterator[tuple[ActorSystem, str]]:
    cfg = Config(model=tiny_model, slots=2, ctx=256, batch=64, threads=1, socket=str(tmp_path / "s.sock"),
                 page_dir=str(tmp_path / "pages"), **over)
    async with ActorSystem(cfg) as system:
        server = RpcServer(system, cfg.socket)
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            yield system, cfg.socket
            tg.cancel_scope.cancel()


class Line:
    """A raw line client: send bytes, read one JSON value per line."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def recv(self, timeout: float = 20) -> Any:
        with anyio.fail_after(timeout):
            return json.loads(await self.reader.receive_until(b"\n", 1 << 24))

    async def nothing_before(self, rid: int) -> None:
        """The next answer is the health call `rid`: nothing was sent for what came before."""
        await self.send(b'{"jsonrpc":"2.0","id":%d,"method":"health"}\n' % rid)
        got = await self.recv()
        assert got.get("id") == rid and "result" in got, got


@asynccontextmanager
async def line_client(path: str) -> AsyncIterator[Line]:
    stream = await anyio.connect_unix(path)
    async with stream:
        yield Line(stream)


def _err(msg: dict) -> tuple[int, str]:
    return msg["error"]["code"], msg["error"]["data"]["type"]


async def test_batches_answer_in_one_array_leaving_out_notifications(tiny_model, tmp_path):
    async with serving(tiny_model, tmp_path) as (_, path), line_client(path) as c:
        await c.send(b'[{"jsonrpc":"2.0","id":1,"method":"health"},'
                     b'{"jsonrpc":"2.0","method":"health"},'
                     b'{"jsonrpc":"2.0","id":"b","method":"nope"},'
                     b'{"foo":"boo"},'
                     b'{"jsonrpc":"2.0","id":3,"method":"completion","params":{"prompt":[1,2],"n_predict":2,"ignore_eos":true}}]\n')
        got = await c.recv()
        assert isinstance(got, list) and len(got) == 4
        by_id = {json.dumps(m["id"]): m for m in got}
        assert "result" in by_id["1"] and _err(by_id['"b"']) == (-32601, "MethodNotFound")
        assert _err(by_id["null"]) == (-32600, "InvalidRequest")
        assert len(by_id["3"]["result"]["tokens"]) == 2
        # A batch of notifications only: nothing at all comes back.
        await c.send(b'[{"jsonrpc":"2.0","method":"health"},{"jsonrpc":"2.0","method":"nope"}]\n')
        await c.nothing_before(90)
        # An empty batch is one Invalid Request; a batch of non-objects, one error each.
        await c.send(b"[]\n")
        assert _err(await c.recv()) == (-32600, "InvalidRequest")
        await c.send(b"[1,2,3]\n")
        assert [_err(m) for m in await c.recv()] == [(-32600, "InvalidRequest")] * 3


async def test_notifications_get_no_answer_not_even_an_error(tiny_model, tmp_path):
    async with serving(tiny_model, tmp_path) as (_, path), line_client(path) as c:
        for line in [b'{"jsonrpc":"2.0","method":"nope"}', b'{"jsonrpc":"2.0","method":"slot.erase","params":{"slot":99}}',
                     b'{"jsonrpc":"2.0","method":"slot.erase","params":{"slot":"x"}}',
                     b'{"jsonrpc":"2.0","method":"health"}']:
            await c.send(line + b"\n")
        await c.nothing_before(1)


@pytest.mark.parametrize("rid", [b"true", b"false", b"1.5", b"{}", b"[]", b"[1]"])
async def test_invalid_ids_are_refused_and_never_echoed(tiny_model, tmp_path, rid):
    async with serving(tiny_model, tmp_path) as (_, path), line_client(path) as c:
        await c.send(b'{"jsonrpc":"2.0","id":' + rid + b',"method":"health"}\n')
        got = await c.recv()
        assert _err(got) == (-32600, "InvalidRequest") and got["id"] is None


async def test_a_null_id_is_a_request_answered_with_null(tiny_model, tmp_path):
    async with serving(tiny_model, tmp_path) as (_, path), line_client(path) as c:
        await c.send(b'{"jsonrpc":"2.0","id":null,"method":"health"}\n')
        got = await c.recv()
        assert got["id"] is None and got["result"]["status"] == "ok"
        await c.send(b'{"jsonrpc":"2.0","id":"s-1","method":"health"}\n')
        assert (await c.recv())["id"] == "s-1"


@pytest.mark.parametrize("line,code,typ", [
    (b'{"id":1,"method":"health"}', -32600, "InvalidRequest"),  # no jsonrpc member
    (b'{"jsonrpc":"1.0","id":1,"method":"health"}', -32600, "InvalidRequest"),
    (b'{"jsonrpc":"2.0","id":1,"method":5}', -32600, "InvalidRequest"),
    (b'{"jsonrpc":"2.0","id":1,"method":"health","params":5}', -32600, "InvalidRequest"),
    (b'{"jsonrpc":"2.0","id":1,"method":"health","params":"x"}', -32600, "InvalidRequest"),
    (b'{"jsonrpc":"2.0","id":1,"method":"slot.erase","params":[0]}', -32602, "InvalidParams"),
    (b'{"jsonrpc":"2.0","id":1,"method":"rpc.discover"}', -32601, "MethodNotFound"),
    (b'{"jsonrpc":"2.0","id":1,"method":"gene.load","params":{"path":"a\\u0000b"}}', -32000, "PathRefused"),
    (b'{"jsonrpc":"2.0","id":1,"method":"completion","params":{"prompt":"a\\ud800"}}', -32700, "ParseError"),
    (b'{"jsonrpc":"2.0","id":1,"method":"completion","params":{"prompt":"x","temperature":1e999}}', -32602, "InvalidParams"),
    (b'{"jsonrpc":"2.0","id":1,"method":"completion","params":{"prompt":"x","top_k":4294967296}}', -32602, "InvalidParams"),
    (b'{"jsonrpc":"2.0","id":1,"method":"page.out","params":{"slot":0,"page":"a/b"}}', -32000, "PathRefused"),
    (b'{"jsonrpc":"2.0","id":1,"method":"completion","params":{"prompt":"x","mind":"a b"}}', -32602, "InvalidParams"),
    (b"not json", -32700, "ParseError"),
    (b"5", -32600, "InvalidRequest"),
])
async def test_each_malformed_request_gets_its_typed_error(tiny_model, tmp_path, line, code, typ):
    async with serving(tiny_model, tmp_path) as (_, path), line_client(path) as c:
        await c.send(line + b"\n")
        got = await c.recv()
        assert _err(got) == (code, typ), got
        if code != -32700:
            assert got["id"] in (1, None)


async def test_an_empty_params_array_is_no_params(tiny_model, tmp_path):
    async with serving(tiny_model, tmp_path) as (_, path), line_client(path) as c:
        await c.send(b'{"jsonrpc":"2.0","id":1,"method":"health","params":[]}\n')
        assert (await c.recv())["result"]["status"] == "ok"


@pytest.mark.parametrize("depth", [1000, 100_000])
async def test_deep_nesting_is_a_parse_error_not_an_internal_error(tiny_model, tmp_path, depth):
    async with serving(tiny_model, tmp_path, max_line_bytes=1 << 20) as (_, path), line_client(path) as c:
        for line in [b"[" * depth, b'{"a":' * depth,
                     b'{"jsonrpc":"2.0","id":1,"method":"completion","params":{"prompt":' + b"[" * depth + b"}}",
                     b'{"jsonrpc":"2.0","id":1,"method":"health","params":{"x":' + b"[" * depth + b"]" * depth + b"}}"]:
            await c.send(line + b"\n")
            got = await c.recv()
            assert got["error"]["data"]["type"] in ("ParseError", "InvalidParams", "InvalidRequest"), got
            assert got["error"]["data"]["type"] != "InternalError"
        await c.nothing_before(5)


async def test_the_line_limit_is_exact_and_an_overlong_line_leaves_the_connection_usable(tiny_model, tmp_path):
    limit = 4096
    async with serving(tiny_model, tmp_path, max_line_bytes=limit) as (_, path), line_client(path) as c:
        head = b'{"jsonrpc":"2.0","id":1,"method":"health","params":[],"pad":"'
        tail = b'"}'
        at = head + b"x" * (limit - len(head) - len(tail)) + tail
        assert len(at) == limit
        await c.send(at + b"\n")
        assert (await c.recv())["result"]["status"] == "ok"  # exactly the limit: served
        over = head + b"x" * (limit + 1 - len(head) - len(tail)) + tail
        await c.send(over + b"\n")
        got = await c.recv()
        assert _err(got) == (-32600, "RequestTooLarge") and got["error"]["data"]["max_line_bytes"] == limit
        # A line far over the limit, arriving in pieces, is discarded as it comes.
        for _ in range(40):
            await c.send(b"y" * 1024)
        await c.send(b"\n")
        assert _err(await c.recv())[1] == "RequestTooLarge"
        await c.nothing_before(2)


async def test_requests_in_flight_per_connection_are_capped_with_a_typed_error(tiny_model, tmp_path):
    async with serving(tiny_model, tmp_path, max_requests_in_flight=3) as (_, path), line_client(path) as c:
        lines = b"".join(
            b'{"jsonrpc":"2.0","id":%d,"method":"completion","params":{"prompt":[1,2,3],"n_predict":40,"ignore_eos":true}}\n' % i
            for i in range(10))
        await c.send(lines)  # one write: all ten are read before any of them finishes
        got = [await c.recv() for _ in range(10)]
        ok = [m for m in got if "result" in m]
        refused = [m for m in got if "error" in m]
        assert len(ok) == 3 and len(refused) == 7
        assert {_err(m) for m in refused} == {(-32000, "TooManyRequests")}
        # A batch larger than what may be in flight is refused whole.
        await c.send(b"[" + b",".join([b'{"jsonrpc":"2.0","id":1,"method":"health"}'] * 4) + b"]\n")
        assert _err(await c.recv()) == (-32600, "RequestTooLarge")
        await c.nothing_before(3)


# ---- bounds checked before any work ---------------------------------------------------------


def test_prompt_bytes_are_checked_before_tokenizing():
    lim = RequestLimits(max_prompt_bytes=100, max_prompt_tokens=10)
    CompletionRequest(prompt="x" * 100).check(lim)
    with pytest.raises(PromptTooLong) as e:
        CompletionRequest(prompt="x" * 101).check(lim)
    assert e.value.data["n_prompt_bytes"] == 101
    with pytest.raises(PromptTooLong):
        CompletionRequest(prompt="é" * 51).check(lim)  # 102 bytes in UTF-8, 51 characters
    with pytest.raises(PromptTooLong):
        CompletionRequest(prompt=[1] * 11).check(lim)
    with pytest.raises(InvalidParams, match="surrogate"):
        CompletionRequest(prompt="a\ud800").check(lim)


def test_stop_lists_and_genes_are_bounded():
    lim = RequestLimits(max_stop=2, max_stop_bytes=4, max_stop_tokens=3, max_genes=1)
    CompletionRequest(prompt="x", stop=["abcd", "é"], stop_tokens=[1, 2, 3]).check(lim)
    for bad in [dict(stop=["a", "b", "c"]), dict(stop=["abcde"]), dict(stop=["éé√"]),
                dict(stop_tokens=[1, 2, 3, 4]), dict(genes=[{"id": 1}, {"id": 2}])]:
        with pytest.raises(InvalidParams):
            msgspec.convert({"prompt": "x", **bad}, CompletionRequest).check(lim)


def test_config_limits_follow_ctx():
    lim = Config(model="m", ctx=1000).request_limits()
    assert lim.max_prompt_bytes == 32_000 and lim.max_prompt_tokens == 1000
    assert Config(model="m", ctx=1000, max_prompt_bytes=5).request_limits().max_prompt_bytes == 5


def test_page_names_have_a_stated_charset_and_depth(tmp_path):
    assert check_page_name("ada-2.x@y+z_") == "ada-2.x@y+z_"
    for bad in ["", "a/b", ".hidden", "-x", "a b", "é", "x" * 129, "a\x00"]:
        with pytest.raises(PathRefused):
            check_page_name(bad)
    assert confine(tmp_path, "a/b/c/d.page") == tmp_path.resolve() / "a/b/c/d.page"
    with pytest.raises(PathRefused, match="deeper"):
        confine(tmp_path, "a/b/c/d/e.page")
    with pytest.raises(PathRefused, match="over 512"):
        confine(tmp_path, "d/" * 1999 + "x")
    with pytest.raises(PathRefused, match="characters outside"):
        confine(tmp_path, "a/b c.page")
    assert list(tmp_path.iterdir()) == []  # refused before any folder was made


def test_protocol_encodes_odd_error_data_instead_of_crashing():
    from pathlib import Path

    from actord.vocabulary.errors import FileNotFound

    out = json.loads(P.error_response(1, FileNotFound("x", path=Path("/a"))))
    assert out["error"]["data"] == {"type": "FileNotFound", "message": "x", "path": "/a"}
