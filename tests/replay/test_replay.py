"""Deterministic scheduling: seeds reproduce bit for bit, daemon traces replay, bugs are found."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import anyio
import pytest

from actord.serving.page_store import PageStore
from actord.frontends.client import Client
from actord.testing.daemon import wait_until_serving
from actord.replay.replay import replay_file
from actord.replay.sim import InvariantViolated, simulate
from tests.replay.hunting import first_finding


@pytest.fixture(scope="session")
def sim_lora(tiny_model, models_dir):
    from actord.testing.models import write_tiny_lora

    return str(write_tiny_lora(models_dir / "sim-lora.gguf", tiny_model, seed=3))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_same_seed_gives_a_bit_identical_trace_ten_times_out_of_ten(tiny_model, sim_lora, backend):
    hashes = {anyio.run(simulate, 7, 6, tiny_model, sim_lora, backend=backend).trace_hash for _ in range(10)}
    assert len(hashes) == 1
    other = anyio.run(simulate, 8, 6, tiny_model, sim_lora, backend=backend).trace_hash
    assert other not in hashes


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_quiet_detection_needs_no_sleep_polling(tiny_model, sim_lora, backend, monkeypatch):
    """The dispatcher tells quiet from the loop's own state and from thread jobs' ends, never
    by sleeping and looking again: a run (a gene load, faults, a stop) sleeps not once."""
    real_sleep = anyio.sleep
    slept: list[float] = []

    async def sleep(delay, *args, **kwargs):
        if delay > 0:
            slept.append(delay)
        return await real_sleep(delay, *args, **kwargs)

    monkeypatch.setattr(anyio, "sleep", sleep)
    for seed in (1, 3, 7):  # 1 fails a disk op and stops mid-run, 3 crashes mid-publication, 7 fails a step
        anyio.run(simulate, seed, 6, tiny_model, [sim_lora], backend=backend)
    assert slept == []


@pytest.mark.slow
def test_a_few_hundred_seeds_keep_every_invariant(tiny_model, sim_lora):
    async def run():
        for seed in range(200):
            await simulate(seed, 5, tiny_model, sim_lora)

    anyio.run(run)


def test_a_planted_charge_bug_is_found_and_its_seed_reproduces(tiny_model, sim_lora, monkeypatch):
    real_commit = PageStore.commit

    def leaky_commit(self, reservation, page):  # the bug: replacing a page loses its charge
        old = self.names.get(page.name)
        info = real_commit(self, reservation, page)
        if old is not None:
            self.charged -= page.n_bytes
        return info

    monkeypatch.setattr(PageStore, "commit", leaky_commit)
    seed, found = first_finding(tiny_model, sim_lora, range(60), 8)
    with pytest.raises(InvariantViolated) as again:
        anyio.run(simulate, seed, 8, tiny_model, sim_lora)
    assert str(again.value) == found


@pytest.mark.slow
def test_a_daemon_trace_replays_and_an_edited_message_diverges_there(tiny_model, tmp_path):
    sock, trace = tmp_path / "s.sock", tmp_path / "trace.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "actord.cli", "serve", "--model", tiny_model, "--slots", "2", "--ctx", "512",
         "--batch", "32", "--socket", str(sock), "--page-dir", str(tmp_path / "pages"), "--trace", str(trace),
         "--log-level", "warning"], stderr=subprocess.PIPE)
    try:
        wait_until_serving(proc, sock, timeout_s=60)

        def client(slot):
            with Client(str(sock)) as c:
                for i in range(3):
                    c.complete([1, 5 + slot, 9, 13 + i], n_predict=6, slot=slot, ignore_eos=True)

        threads = [threading.Thread(target=client, args=(s,)) for s in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with Client(str(sock)) as c:
            c.call("page.out", {"slot": 0, "page": "a"})
            c.call("slot.erase", {"slot": 1})
            c.call("page.in", {"slot": 1, "page": "a"})
            c.call("page.out", {"slot": 1, "page": "b"})
            c.call("page.spill", {"page": "b", "file": "b.page", "drop": True})
            c.call("slot.restore", {"slot": 0, "file": "b.page"})
            c.complete([1, 2, 3], n_predict=4, mind="zed", ignore_eos=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    r = replay_file(trace, tiny_model)
    assert r.ok, r
    lines = trace.read_text().splitlines()
    idx = next(i for i, line in enumerate(lines) if i > 30 and json.loads(line)["type"] == "Deliver")
    ev = json.loads(lines[idx])
    ev["digest"] = "0" * 24
    lines[idx] = json.dumps(ev)
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join(lines) + "\n")
    r = replay_file(edited, tiny_model)
    assert not r.ok and r.position == idx + 1


def test_a_trace_with_chat_turns_replays(models_dir, tmp_path):
    """chat records its own input (its completion is not a second input): a replay
    re-executes the chat, templates, tokenization and all."""
    from actord.vocabulary.config import Config
    from actord.replay.replay import replay
    from actord.service.system import ActorSystem
    from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama

    model = str(write_tiny_llama(models_dir / "replay-chat.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE))
    events: list = []

    async def run():
        async with ActorSystem(Config(model=model, slots=2, ctx=512, page_dir=str(tmp_path / "p")),
                               trace=events) as s:
            msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
            r = await s.chat(messages=msgs, n_predict=5, mind="ada")
            msgs += [{"role": "assistant", "content": r.message.content}, {"role": "user", "content": "more"}]
            await s.chat(messages=msgs, n_predict=5, mind="ada")

    anyio.run(run)
    assert [e.method for e in events if type(e).__name__ == "Input"] == ["chat", "chat"]
    r = anyio.run(replay, events, model)
    assert r.ok, r


def test_a_trace_whose_thread_work_leaves_no_event_replays(tiny_model, sim_lora, tmp_path):
    """A gene file read and a client's chat template run on worker threads but are no events
    of their own: the replay must wait for them (they count as in flight), not find the
    system quiet with nothing ready and report a divergence."""
    from actord.vocabulary.config import Config
    from actord.replay.replay import replay
    from actord.service.system import ActorSystem

    events: list = []

    async def run():
        async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, page_dir=str(tmp_path / "p")),
                               trace=events) as s:
            gene = await s.gene_load(sim_lora)
            await s.complete(prompt=[1, 5, 9], n_predict=3, ignore_eos=True, genes=[{"id": gene.id}])
            await s.chat(messages=[{"role": "user", "content": "hello"}], n_predict=3,
                         template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")

    anyio.run(run)
    assert [e.method for e in events if type(e).__name__ == "Input"] == ["gene.load", "completion", "chat"]
    for backend in ("asyncio", "trio"):
        r = anyio.run(replay, events, tiny_model, backend=backend)
        assert r.ok, r


def test_an_actor_still_delivering_when_its_actors_close_ends_its_loop_at_the_gate():
    """The system's exit closes the actors while one is still in a delivery (a replay found
    the system quiet with it awaiting an ask). Back at its gate with its mailbox closed and
    empty, its loop ends: nobody steps any more to let it go, and the exit would otherwise
    wait out its deadline (shutdown_grace_s + 5 s: the 15 s this file's trace test took
    now and then)."""
    from actord.replay.dispatcher import DeterministicDispatcher, SeededPolicy
    from actord.serving.kernel.actor import Actor

    release = anyio.Event()
    handled: list[str] = []

    class Slow(Actor):
        async def handle(self, msg, env):
            handled.append(msg)
            await release.wait()

    async def main():
        disp = DeterministicDispatcher(SeededPolicy(0))
        with anyio.fail_after(60):  # a hang bound, not a speed: the loop must end at once
            async with anyio.create_task_group() as tg:
                disp.bind(tg)
                slow = Slow(disp, "slow")
                disp.spawn(slow)
                await slow.tell("one")
                while not handled:
                    await disp.step()
                slow.close()
                disp.close_actors()  # "slow" is in its delivery, not at its gate
                release.set()
        assert handled == ["one"]

    anyio.run(main)


@pytest.mark.slow
def test_a_trace_with_shared_prefixes_replays(tiny_model, tmp_path):
    """Minds that open alike share cells, stand their pages on a base and come back onto it:
    the recorded run replays with no divergence."""
    sock, trace = tmp_path / "s.sock", tmp_path / "trace.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "actord.cli", "serve", "--model", tiny_model, "--slots", "2", "--ctx", "1024",
         "--batch", "64", "--socket", str(sock), "--page-dir", str(tmp_path / "pages"), "--trace", str(trace),
         "--log-level", "warning"], stderr=subprocess.PIPE)
    system_prompt = [1] + [3 + (i * 37) % 500 for i in range(99)]
    try:
        wait_until_serving(proc, sock, timeout_s=60)
        with Client(str(sock)) as c:
            for turn in range(2):
                for m in range(4):
                    r = c.complete(system_prompt + [7 + m, 9 + turn], n_predict=4, mind=f"m{m}", ignore_eos=True)
                    assert r["n_cached"] >= (len(system_prompt) if m or turn else 0)
            stats = c.call("page.stats", {})
            assert stats["bases"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    r = replay_file(trace, tiny_model)
    assert r.ok, r
