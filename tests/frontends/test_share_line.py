"""The HTTP front's line (shares.py `Shares.enter`): past its address's or key's share, a
generation waits its turn instead of a 429, oldest first per client, while another
client's starts at once within its own share; the line is bounded per address and per
key; a waiter that goes away leaves nothing counted, and one let in as it was cancelled
gives its turn on. No assertion is on time: each step waits for a condition."""

from __future__ import annotations

import json

import anyio
import pytest

from actord.frontends.shares import Shares, Ticket, socket_peer
from tests.waits import eventually

A, B = "10.0.0.1", "10.0.0.2"


def _shares(per_peer: int = 1, per_key: int = 8, waiting: int = 4) -> Shares:
    return Shares(generations_per_peer=per_peer, generations_per_key=per_key, queued_per_peer=100,
                  queued_per_key=100, waiting_per_peer=waiting)


async def _enter_all(sh: Shares, tg: anyio.abc.TaskGroup, order: list[str], who: list[tuple[str, str | None, str]]):
    tickets: dict[str, Ticket] = {}

    async def one(peer: str, key: str | None, name: str) -> None:
        got = await sh.enter(peer, key)
        assert isinstance(got, Ticket), got
        order.append(name)
        tickets[name] = got

    for peer, key, name in who:
        tg.start_soon(one, peer, key, name)
        await anyio.sleep(0)  # each in the line in the order given
    return tickets


def test_past_its_share_a_generation_waits_and_is_let_in_oldest_first_as_its_share_frees():
    async def run() -> None:
        sh = _shares()
        first = await sh.enter(A, None)
        assert isinstance(first, Ticket)
        order: list[str] = []
        async with anyio.create_task_group() as tg:
            tickets = await _enter_all(sh, tg, order, [(A, None, "a1"), (A, None, "a2")])
            await eventually(lambda: sh.waiting[A] == 2, "both wait")
            assert order == []
            first.release()
            await eventually(lambda: order == ["a1"], "the oldest is let in")
            assert sh.waiting[A] == 1 and sh.generations[A] == 1
            tickets["a1"].release()
            await eventually(lambda: order == ["a1", "a2"], "then the next")
            tickets["a2"].release()
        assert not sh.generations and not sh.waiting and not sh.line

    anyio.run(run)


def test_another_address_starts_at_once_while_one_address_waits():
    async def run() -> None:
        sh = _shares()
        held = await sh.enter(A, None)
        order: list[str] = []
        async with anyio.create_task_group() as tg:
            await _enter_all(sh, tg, order, [(A, None, "a1")])
            await eventually(lambda: sh.waiting[A] == 1, "a1 waits")
            other = await sh.enter(B, None)  # not behind A's line: its own share is free
            assert isinstance(other, Ticket) and order == []
            other.release()
            assert order == []  # B's end frees no share of A's
            assert isinstance(held, Ticket)
            held.release()
            await eventually(lambda: order == ["a1"], "a1 let in")
            tg.cancel_scope.cancel()

    anyio.run(run)


def test_a_key_past_its_share_waits_whatever_address_it_comes_from():
    async def run() -> None:
        sh = _shares(per_peer=8, per_key=1)
        held = await sh.enter(A, "key0")
        order: list[str] = []
        async with anyio.create_task_group() as tg:
            await _enter_all(sh, tg, order, [(B, "key0", "b-key0")])
            await eventually(lambda: sh.key_waiting["key0"] == 1, "the key's second waits")
            other = await sh.enter(B, "key1")  # the same address, another key: at once
            assert isinstance(other, Ticket)
            assert isinstance(held, Ticket)
            held.release()
            await eventually(lambda: order == ["b-key0"], "let in as the key's share frees")
            tg.cancel_scope.cancel()

    anyio.run(run)


def test_the_line_is_bounded_per_address_and_per_key_and_one_more_is_refused():
    async def run() -> None:
        sh = _shares(per_peer=1, per_key=1, waiting=1)
        await sh.enter(A, None)
        async with anyio.create_task_group() as tg:
            await _enter_all(sh, tg, [], [(A, None, "a1")])
            await eventually(lambda: sh.waiting[A] == 1, "a1 waits")
            refused = await sh.enter(A, None)
            assert isinstance(refused, tuple) and refused[1] == "peer_generations" and "1 waiting" in refused[0]
            await sh.enter(B, "k")
            await _enter_all(sh, tg, [], [(B, "k", "b1")])
            await eventually(lambda: sh.key_waiting["k"] == 1, "b1 waits")
            refused = await sh.enter("10.0.0.3", "k")  # a third address, the same key: the key's line is full
            assert isinstance(refused, tuple) and refused[1] == "key_generations"
            assert sh.waiting["10.0.0.3"] == 0
            tg.cancel_scope.cancel()
        assert not sh.waiting and not sh.key_waiting and not sh.line  # the cancelled waiters left it

    anyio.run(run)


def test_with_no_line_a_generation_past_its_share_is_refused_at_once():
    async def run() -> None:
        sh = _shares(waiting=0)
        await sh.enter(A, None)
        refused = await sh.enter(A, None)
        assert isinstance(refused, tuple) and refused[1] == "peer_generations"
        assert not sh.line

    anyio.run(run)


def test_a_waiter_that_goes_away_holds_nothing_and_the_one_behind_it_moves_up():
    async def run() -> None:
        sh = _shares()
        held = await sh.enter(A, None)
        order: list[str] = []
        gone = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            async def leaving() -> None:
                with gone:
                    await sh.enter(A, None)
                    order.append("gone one let in")

            tg.start_soon(leaving)
            await eventually(lambda: sh.waiting[A] == 1, "the leaving one waits")
            await _enter_all(sh, tg, order, [(A, None, "a2")])
            await eventually(lambda: sh.waiting[A] == 2, "a2 waits behind it")
            gone.cancel()
            await eventually(lambda: sh.waiting[A] == 1, "the leaving one left the line")
            assert isinstance(held, Ticket)
            held.release()
            await eventually(lambda: order == ["a2"], "a2 let in")
            tg.cancel_scope.cancel()
        assert not sh.waiting and not sh.line

    anyio.run(run)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_waiter_let_in_as_it_is_cancelled_passes_its_turn_to_the_next(backend):
    async def run() -> None:
        sh = _shares()
        held = await sh.enter(A, None)
        order: list[str] = []
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def cancelled_one() -> None:  # as the front's guard holds a ticket
                with scope:
                    got = await sh.enter(A, None)  # on asyncio the cancel lands here...
                    assert isinstance(got, Ticket)
                    try:
                        await anyio.sleep(0)  # ...on trio at its next checkpoint
                        order.append("never")
                    finally:
                        got.release()

            tg.start_soon(cancelled_one)
            await eventually(lambda: sh.waiting[A] == 1, "it waits")
            await _enter_all(sh, tg, order, [(A, None, "a2")])
            await eventually(lambda: sh.waiting[A] == 2, "a2 behind it")
            assert isinstance(held, Ticket)
            held.release()  # lets the first in...
            scope.cancel()  # ...which is cancelled before it runs: its turn goes on to a2
            await eventually(lambda: order == ["a2"], "a2 let in")
            assert sh.generations[A] == 1
            tg.cancel_scope.cancel()

    anyio.run(run, backend=backend)


# -- fair parts: an address's share while other addresses are active ------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fair(clock: Clock, per_peer: int = 4, slots: int = 2, waiting: int = 8) -> Shares:
    return Shares(generations_per_peer=per_peer, generations_per_key=8, queued_per_peer=100, queued_per_key=100,
                  waiting_per_peer=waiting, slots=slots, clock=clock, linger_s=1.0)


def test_fair_parts_are_rounded_up_so_every_slot_is_used_while_every_client_is_at_work():
    sh = _fair(Clock(), per_peer=16, slots=3)
    sh.generations.update({A: 1, B: 1})
    assert sh.peer_share(A) == 2  # 3 slots, 2 clients: 2 each, not 1 (a slot idle)
    sh.generations["10.0.0.3"] = 1
    assert sh.peer_share(A) == 1
    sh.slots = 8
    assert sh.peer_share(A) == 3


def test_alone_an_address_holds_its_whole_share():
    async def run() -> None:
        sh = _fair(Clock())
        got = [await sh.enter(A, None) for _ in range(4)]  # twice the slots: the default share
        assert all(isinstance(t, Ticket) for t in got) and sh.peer_share(A) == 4

    anyio.run(run)


def test_while_another_address_is_active_an_address_is_let_in_only_within_its_fair_part():
    async def run() -> None:
        clock = Clock()
        sh = _fair(clock)
        mine = [await sh.enter(A, None) for _ in range(4)]
        order: list[str] = []
        async with anyio.create_task_group() as tg:
            other = await sh.enter(B, None)  # within its own fair part (2 slots over 2 addresses: 1)
            assert isinstance(other, Ticket) and sh.peer_share(A) == 1 and sh.peer_share(B) == 1
            tickets = await _enter_all(sh, tg, order, [(A, None, "a5")])
            await eventually(lambda: sh.waiting[A] == 1, "A's fifth waits")
            for t in mine[:3]:
                assert isinstance(t, Ticket)
                t.release()
            assert order == []  # A still holds its fair part (1)
            assert isinstance(mine[3], Ticket)
            mine[3].release()
            await eventually(lambda: order == ["a5"], "let in once A is within its part")
            assert sh.generations[A] == 1
            # B's generation ends: B stays active for linger_s, then A has its whole share again.
            other.release()
            assert sh.peer_share(A) == 1
            clock.now += 1.5
            assert sh.peer_share(A) == 4
            tickets["a5"].release()

    anyio.run(run)


def test_a_waiter_takes_the_share_an_address_gone_quiet_left_without_an_end_to_tell_it():
    async def run() -> None:
        clock = Clock()
        sh = _fair(clock)
        sh.linger_s = 0.05  # the waiter looks again this often (real time), and B's activity lasts this long
        b = await sh.enter(B, None)
        a1 = await sh.enter(A, None)
        order: list[str] = []
        async with anyio.create_task_group() as tg:
            await _enter_all(sh, tg, order, [(A, None, "a2")])
            await eventually(lambda: sh.waiting[A] == 1, "a2 waits: A holds its fair part")
            assert isinstance(b, Ticket)
            b.release()  # no waiter of B's to let in; A's share grows only once B is quiet
            clock.now += 1.0
            await eventually(lambda: order == ["a2"], "a2 let in as B went quiet")
            assert isinstance(a1, Ticket) and sh.generations[A] == 2
            tg.cancel_scope.cancel()

    anyio.run(run)


def test_with_no_line_past_its_fair_part_an_address_is_refused():
    async def run() -> None:
        sh = _fair(Clock(), waiting=0)
        await sh.enter(B, None)
        assert isinstance(await sh.enter(A, None), Ticket)
        refused = await sh.enter(A, None)
        assert isinstance(refused, tuple) and "its share: 1" in refused[0]

    anyio.run(run)


def test_a_socket_connection_is_a_client_beside_the_addresses():
    async def run() -> None:
        sh = _fair(Clock())
        conn = socket_peer(4321, 1)
        sock_ticket = await sh.enter(conn, None)
        assert isinstance(sock_ticket, Ticket)
        assert isinstance(await sh.enter(A, None), Ticket)
        assert sh.peer_share(A) == 1 and sh.peer_share(conn) == 1  # A and the connection: a slot each
        sock_ticket.release()
        assert sh.peer_share(A) == 1  # the connection is active for linger_s after its end

    anyio.run(run)


async def _socket_completions(tmp_path, n: int, **over) -> list[dict]:
    """`n` completions sent at once on one socket connection (a share of one generation)."""
    from actord.testing.models import write_tiny_llama
    from tests.frontends.test_jsonrpc_strict import Line, serving

    model = str(write_tiny_llama(tmp_path / "tiny.gguf", seed=1))
    async with serving(model, tmp_path, http_max_generations_per_peer=1, **over) as (_, path):
        async with await anyio.connect_unix(path) as stream:
            line = Line(stream)
            for i in range(n):
                await line.send(json.dumps({"jsonrpc": "2.0", "id": i + 1, "method": "completion",
                                            "params": {"prompt": f"a {i}", "n_predict": 4}}).encode() + b"\n")
            return sorted([await line.recv(60) for _ in range(n)], key=lambda r: r["id"])


@pytest.mark.anyio
async def test_a_socket_connection_past_its_share_waits_its_turn_and_gets_every_answer(tmp_path):
    got = await _socket_completions(tmp_path, 4, http_max_waiting_per_peer=8)
    assert [len(r["result"]["tokens"]) if "result" in r else r["error"] for r in got] == [4, 4, 4, 4]


@pytest.mark.anyio
async def test_a_socket_clients_line_is_held_by_the_sockets_own_bounds_not_the_http_ones(tmp_path):
    # One process with 300 connections generating at once (tests/frontends/test_hostile_clients.py)
    # is within the socket's bounds: its generations wait their turn, none is refused by the
    # HTTP front's line bound.
    got = await _socket_completions(tmp_path, 3, http_max_waiting_per_peer=0)
    assert [len(r["result"]["tokens"]) if "result" in r else r["error"] for r in got] == [4, 4, 4]


def test_a_clients_line_bound_is_the_callers_when_it_names_one():
    sh = _fair(Clock(), per_peer=1, waiting=0)
    sh.generations[A] = 1
    assert sh.refusal(A, None) is not None and sh.refusal(A, None, line=8) is None


# -- through a daemon: one slot, one address sending more at once than its share ------------


def test_one_address_sending_past_its_share_at_once_gets_every_answer(tmp_path):
    # llama.cpp's own server test sends 3 at once to 1 slot; a load tool at concurrency 16
    # sends 16: past the address's share (twice the slots, 2 here) they wait their turn.
    import concurrent.futures

    import httpx

    from actord.testing.models import write_tiny_llama
    from tests.frontends.test_openai_http import _metric, _start, _stop

    model = str(write_tiny_llama(tmp_path / "tiny.gguf", seed=1))
    proc, _, url = _start(model, tmp_path / "d", "--slots", "1", "--http-max-waiting-per-peer", "5")
    try:
        def one(i: int) -> httpx.Response:
            return httpx.post(url + "/completion", json={"prompt": f"a {i}", "n_predict": 8}, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, range(8)))
        codes = sorted(r.status_code for r in got)
        # 2 in flight and 5 waiting at most: of 8 at once, at least 7 answered (the eighth
        # may find the line full, its 429 naming the bound).
        assert codes.count(200) >= 7, [(r.status_code, r.text[:200]) for r in got]
        assert all(r.json()["tokens_predicted"] == 8 for r in got if r.status_code == 200)
        for r in got:
            if r.status_code == 429:
                assert "http_max_waiting_per_peer" in r.text
        assert _metric(url, 'http_refused_total{reason="peer_generations"}') == codes.count(429)
    finally:
        _stop(proc)


def test_a_waiting_generation_whose_client_hangs_up_leaves_the_line_at_once(tmp_path):
    import socket
    import threading

    import httpx

    from actord.testing.models import write_tiny_llama
    from tests.frontends.test_http_bounds import _addr
    from tests.frontends.test_openai_http import _metric, _start, _stop
    from tests.waits import wait_until

    model = str(write_tiny_llama(tmp_path / "tiny.gguf", seed=1))
    proc, _, url = _start(model, tmp_path / "d", "--slots", "1", "--http-max-generations-per-peer", "1",
                          "--http-max-waiting-per-peer", "1", "--http-metrics")
    started, done = threading.Event(), threading.Event()

    def long_one() -> None:  # holds the address's one generation until the test is done
        with httpx.Client(timeout=300) as c, c.stream(
                "POST", url + "/completion", json={"prompt": "a", "n_predict": 3000, "ignore_eos": True,
                                                    "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()
                if done.is_set():
                    break

    t = threading.Thread(target=long_one)
    t.start()
    try:
        assert started.wait(120)
        body = json.dumps({"prompt": "b", "n_predict": 2}).encode()
        s = socket.create_connection(_addr(url), timeout=60)
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: _metric(url, "generations_waiting") == 1, "the second waits its turn")
        s.close()  # hangs up while it waits
        wait_until(lambda: _metric(url, "generations_waiting") == 0, "it left the line")
        assert _metric(url, 'http_client_gone_total{phase="waiting"}') == 1
    finally:
        done.set()
        t.join(300)
        _stop(proc)
