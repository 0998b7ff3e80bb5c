"""Floods of control calls through the daemon (issue 19, points 1 and 3): eight connections
each keeping 60 calls of one method in flight. Nothing crashes, every call gets exactly
one answer, and another client's completions complete meanwhile (how fast is measured by
bench/control_flood.py, never asserted)."""

from __future__ import annotations

import collections
import json
import threading
from typing import Any

import pytest

from tests.frontends.daemons import Daemon, request

pytestmark = pytest.mark.slow  # daemons flooded by many clients


class Flood:
    """`connections` raw connections, each keeping `in_flight` calls of `method` in flight."""

    def __init__(self, d: Daemon, method: str, params: Any = None, connections: int = 8, in_flight: int = 60):
        self.counts: collections.Counter = collections.Counter()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.threads = [threading.Thread(target=self._one, args=(d, method, params, in_flight), daemon=True)
                        for _ in range(connections)]
        for t in self.threads:
            t.start()

    def _one(self, d: Daemon, method: str, params: Any, in_flight: int) -> None:
        s = d.raw(timeout=300)
        f = s.makefile("rb")
        outstanding = 0
        try:
            s.sendall(b"".join(request(i, method, params) for i in range(in_flight)))
            outstanding = in_flight
            with self.lock:
                self.sent += in_flight
            while outstanding:
                msg = json.loads(f.readline())
                outstanding -= 1
                with self.lock:
                    self.counts[msg["error"]["data"]["type"] if "error" in msg else "ok"] += 1
                if not self.stop.is_set():
                    s.sendall(request(0, method, params))
                    outstanding += 1
                    with self.lock:
                        self.sent += 1
        finally:
            f.close()
            s.close()

    def answered(self) -> int:
        with self.lock:
            return sum(self.counts.values())

    def end(self) -> collections.Counter:
        self.stop.set()
        for t in self.threads:
            t.join(300)
        assert not any(t.is_alive() for t in self.threads), "a flood call was never answered"
        assert self.answered() == self.sent  # exactly one answer each
        return self.counts


@pytest.fixture
def daemons(tmp_path):
    started: list[Daemon] = []

    def start(model: str, *extra: str, **kw: Any) -> Daemon:
        d = Daemon(model, tmp_path, *extra, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


def _wait_answers(flood: Flood, n: int) -> None:
    from tests.waits import wait_until

    wait_until(lambda: flood.answered() >= n, f"{n} answers to the flood", timeout=300)


def test_a_gene_list_flood_leaves_the_residency_alive_and_every_kind_of_completion_served(
        daemons, tiny_model, models_dir):
    from actord.testing.models import write_tiny_lora

    gene = str(write_tiny_lora(models_dir / "flood-lora.gguf", tiny_model, seed=71))
    d = daemons(tiny_model, "--gene", gene, "--device-bytes", "400000")
    flood = Flood(d, "gene.list")
    _wait_answers(flood, 200)
    with d.client(timeout=300) as c:
        for params in ({"slot": 0}, {"mind": "ada"}, {}, {"mind": "bo"}, {"mind": "ada"}):
            r = c.complete([1, 2, 3, 4], n_predict=8, ignore_eos=True, **params)
            assert len(r["tokens"]) == 8
    counts = flood.end()
    assert set(counts) == {"ok"}
    with d.client() as c:
        assert c.call("health")["status"] == "ok"
    d.assert_clean_log()


def test_completions_complete_while_page_in_calls_flood_the_scheduler(daemons, tiny_model):
    d = daemons(tiny_model)
    with d.client() as c:
        # A page in RAM and a slot that holds a sequence: every page.in asks the scheduler
        # for room (MakeRoom) and is then refused by the slot (SlotBusy).
        c.complete([1] + list(range(5, 300)), n_predict=1, slot=1, ignore_eos=True)
        c.call("page.out", {"slot": 1, "page": "p"})
        c.complete([1, 9, 9, 9], n_predict=1, slot=1, ignore_eos=True)
    flood = Flood(d, "page.in", {"slot": 1, "page": "p"})
    _wait_answers(flood, 200)
    with d.client(timeout=300) as c:
        for i in range(3):
            assert len(c.complete([1, 2, 3, 4 + i], n_predict=8, slot=0, ignore_eos=True)["tokens"]) == 8
        assert flood.answered() < flood.sent  # the flood was still on while they ran
    counts = flood.end()
    assert set(counts) == {"SlotBusy"}
    with d.client() as c:
        assert [p["page"] for p in c.call("page.list")] == ["p"]
        assert c.call("health")["status"] == "ok"
    d.assert_clean_log()


def test_a_connections_control_calls_beyond_its_turns_wait_and_are_all_answered(daemons, tiny_model):
    d = daemons(tiny_model, "--max-control-in-flight", "2", "--max-control-total", "3")
    flood = Flood(d, "slot.list", connections=3, in_flight=60)
    _wait_answers(flood, 500)
    counts = flood.end()
    assert set(counts) == {"ok"}  # waited their turn: nothing refused
    d.assert_clean_log()
