"""The socket's page verbs act in the caller's scope (service/tenancy.py): a peer of another
uid lists, pages in, drops, spills and restores only her own pages and files, by the names
she gave them; naming another tenant's page gets the same typed not-found as a page that
does not exist, and changes nothing; a slot holding another tenant's cells is empty to her.

The real RpcServer over a real socket, in this process; the peers' uids are what the kernel
would report for them (SO_PEERCRED), handed out by connection: a test cannot run processes
of other uids.
"""

from __future__ import annotations

import itertools
import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from actord.frontends.rpc import server as rpc_server
from actord.frontends.rpc.peers import Peer
from actord.frontends.rpc.server import RpcServer
from actord.vocabulary.kv_identity import SCOPE_MARK, scope_of, scoped_mind
from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

ALICE, MALLORY = 1001, 1002
PROMPT = [1] + [3 + (i * 37) % 500 for i in range(40)]


class Peer_:
    """One connection's JSON-RPC calls: the result, or the error's type."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.reader, self.ids = stream, BufferedByteReceiveStream(stream), itertools.count(1)

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        rid = next(self.ids)
        await self.stream.send(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).encode()
                               + b"\n")
        with anyio.fail_after(60):
            got = json.loads(await self.reader.receive_until(b"\n", 1 << 24))
        assert got["id"] == rid, got
        return got["result"] if "result" in got else ("error", got["error"]["data"]["type"], got["error"]["message"])


@asynccontextmanager
async def daemon(tiny_model: str, tmp_path: Any, monkeypatch: Any) -> AsyncIterator[Any]:
    uids = iter([ALICE, MALLORY, rpc_server.os.geteuid()])  # by connection: alice, mallory, the operator
    monkeypatch.setattr(rpc_server, "peer_of", lambda sock: Peer(pid=1, uid=next(uids), gid=1))
    cfg = Config(model=tiny_model, slots=2, ctx=256, batch=64, threads=1, socket=str(tmp_path / "s.sock"),
                 page_dir=str(tmp_path / "pages"), allow_uid=[ALICE, MALLORY])
    async with ActorSystem(cfg) as system:
        server = RpcServer(system, cfg.socket)
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)

            @asynccontextmanager
            async def connect() -> AsyncIterator[Peer_]:
                async with await anyio.connect_unix(cfg.socket) as stream:
                    peer = Peer_(stream)
                    # Answered: the server has read this connection's peer (in the order the
                    # connections were made: the uids above are handed out in that order).
                    await peer.call("health", {})
                    yield peer

            yield system, connect
            tg.cancel_scope.cancel()


async def test_a_tenant_sees_and_touches_only_her_own_pages_and_a_guess_is_not_found(tiny_model, tmp_path,
                                                                                        monkeypatch):
    async with daemon(tiny_model, tmp_path, monkeypatch) as (system, connect):
        async with connect() as alice, connect() as mallory, connect() as operator:
            await alice.call("completion", {"prompt": PROMPT, "n_predict": 2, "ignore_eos": True, "slot": 0})
            out = await alice.call("page.out", {"slot": 0, "page": "diary"})
            assert out["page"] == "diary"
            spilled = await alice.call("page.spill", {"page": "diary", "file": "diary.page"})
            assert spilled["file"] == "diary.page"
            assert [p["page"] for p in await alice.call("page.list", {})] == ["diary"]

            # Kept under her scope: another tenant's "diary" is another page.
            kept = scoped_mind("diary", scope_of(f"uid:{ALICE}", None))
            assert [p.page for p in await system.page_list()] == [kept]
            assert (tmp_path / "pages" / f"{kept}.page").exists()

            assert await mallory.call("page.list", {}) == []
            assert await operator.call("page.list", {}) == []
            missing = await mallory.call("page.drop", {"page": "no-such-page"})
            guessed = await mallory.call("page.drop", {"page": "diary"})
            assert missing[:2] == guessed[:2] == ("error", "PageNotFound")
            assert guessed[2] == "no page named 'diary'"  # her own name, not the scoped one
            for method, params in (("page.in", {"slot": 1, "page": "diary"}),
                                   ("page.spill", {"page": "diary", "file": "mine.page"})):
                assert (await mallory.call(method, params))[:2] == ("error", "PageNotFound"), method
            gone = await mallory.call("slot.restore", {"slot": 1, "file": "no-such.page"})
            file_guess = await mallory.call("slot.restore", {"slot": 1, "file": "diary.page"})
            assert gone[:2] == file_guess[:2] and gone[0] == "error"
            # The scoped name itself, read off a listing or computed: refused before any work.
            for who in (mallory, operator):
                refused = await who.call("page.drop", {"page": kept})
                assert refused[:2] == ("error", "InvalidParams") and SCOPE_MARK in refused[2]

            # Nothing of alice's was touched: her page and file are as she left them.
            assert [p["page"] for p in await alice.call("page.list", {})] == ["diary"]
            back = await alice.call("page.in", {"slot": 1, "page": "diary"})
            assert back["page"] == "diary" and back["n_tokens"] == len(PROMPT) + 1
            restored = await alice.call("slot.restore", {"slot": 0, "file": "diary.page"})
            assert restored["file"] == "diary.page" and restored["n_tokens"] == len(PROMPT) + 1
            # Her cells in a slot are not another tenant's to see, copy out or erase: the
            # slot is empty to him, and his erase leaves them as they were.
            seen = {s["id"]: s for s in await mallory.call("slot.list", {})}[0]
            assert (seen["n_tokens"], seen["n_checkpoints"], seen["genes"], seen["mind"]) == (0, 0, [], None)
            assert {s["id"]: s for s in await alice.call("slot.list", {})}[0]["n_tokens"] == len(PROMPT) + 1
            for method, params in (("page.out", {"slot": 0, "page": "stolen"}),
                                   ("slot.save", {"slot": 0, "file": "stolen.page"})):
                assert (await mallory.call(method, params))[:2] == ("error", "SlotEmpty"), method
            assert (await mallory.call("slot.erase", {"slot": 0}))["erased"] is True
            assert {s["id"]: s for s in await alice.call("slot.list", {})}[0]["n_tokens"] == len(PROMPT) + 1
            assert (await alice.call("slot.save", {"slot": 0, "file": "again.page"}))["file"] == "again.page"


def test_a_trace_of_a_tenants_page_verbs_replays_as_that_tenant(tiny_model, tmp_path):
    """The tenant a front vouched for is part of each input: a replay asks as the same
    tenant, so her page verbs name the same scoped pages (else the first one diverges)."""
    from actord.replay.replay import replay_file
    from actord.service import tenancy
    from actord.vocabulary.trace import Input, read_trace

    trace = tmp_path / "trace.jsonl"
    cfg = Config(model=tiny_model, slots=2, ctx=256, batch=64, threads=1, page_dir=str(tmp_path / "pages"))

    async def run() -> None:
        async with ActorSystem(cfg, trace=str(trace)) as s:
            async def as_tenant() -> None:
                tenancy.enter(f"uid:{ALICE}")
                await s.complete(prompt=PROMPT, n_predict=2, ignore_eos=True, slot=0)
                await s.page_out(0, "diary")
                await s.page_in(1, "diary")
                await s.page_out(1, "diary")
                await s.page_drop("diary")

            async with anyio.create_task_group() as tg:
                tg.start_soon(as_tenant)

    anyio.run(run)
    inputs = [e for e in read_trace(trace) if isinstance(e, Input)]
    assert {e.tenant for e in inputs if e.method.startswith("page.")} == {f"uid:{ALICE}"}
    r = replay_file(trace, tiny_model)
    assert r.ok, r
