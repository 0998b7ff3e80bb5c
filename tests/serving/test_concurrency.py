"""Several clients at once: no ask cycle, no stall, KV pressure handled, a bounded stop.

These pin what issue 9 found with two or more clients: the residency and a slot awaiting
each other (deadlock), "KV cache full" while idle slots held the cells, a scheduler that
stopped for everyone when one slot failed, and a start that leaked its engine thread.
"""

from __future__ import annotations

import threading

import anyio
import pytest

from actord.serving.kernel import Actor, Dispatcher
from actord.vocabulary.config import Config
from actord.vocabulary.errors import (
    ActordError, AskCycle, AskOrderViolated, AskTimeout, ContextFull, DeviceBudgetExceeded, FileNotFound, InternalError,
    ShuttingDown,
)
from actord.service.system import ActorSystem
from tests.waits import eventually


@pytest.fixture(scope="session")
def loras(tiny_model, models_dir):
    from actord.testing.models import write_tiny_lora

    return [str(write_tiny_lora(models_dir / f"cc-lora{i}.gguf", tiny_model, seed=40 + i)) for i in range(4)]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [1] + [5 + (i * 7 + salt) % 300 for i in range(n - 1)]


# ---- the deadlock of issue 9 ------------------------------------------------------------


@pytest.mark.anyio
async def test_gene_miss_needing_a_slot_that_just_got_a_request_answers_both(tiny_model, loras, tmp_path):
    """Slot 1 needs a paged-out gene whose room is slot 0's state, while slot 0 starts a
    request: the residency used to ask slot 0 to page out while slot 0 asked the residency."""
    cfg = Config(model=tiny_model, slots=2, ctx=2048, device_bytes=330_000, gene=loras[:2],
                 page_dir=str(tmp_path), ask_timeout_s=20)
    async with ActorSystem(cfg) as s:
        c = (await s.gene_load(loras[2])).id
        await s.gene_page_out(c)
        await s.complete(prompt=prompt(900), n_predict=1, slot=0, ignore_eos=True)
        out: dict[str, object] = {}

        async def on(slot: int, genes: list[dict]) -> None:  # slot 0 goes on from its 900 tokens
            out[f"slot{slot}"] = await s.complete(prompt=prompt(920 if slot == 0 else 40, slot), n_predict=4,
                                                  slot=slot, ignore_eos=True, genes=genes)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(on, 1, [{"id": c, "scale": 1.0}])
                tg.start_soon(on, 0, [])
            assert len(out["slot0"].tokens) == 4 and len(out["slot1"].tokens) == 4  # type: ignore[attr-defined]
            assert len(await s.slot_list()) == 2 and len(await s.gene_list()) == 3
        assert s.residency.device_bytes() <= cfg.device_bytes
        assert s.dispatcher.cycles == []
        m = s.metrics.snapshot()
        assert m["lora_page_in_on_demand_total"] == 1
        assert m["slot_evictions_total{how=dropped,reason=device}"] >= 1  # slot 0's idle state made the room


@pytest.mark.anyio
async def test_six_clients_with_mixed_gene_sets_under_a_tight_device_budget_all_get_answers(tiny_model, loras,
                                                                                           tmp_path):
    cfg = Config(model=tiny_model, slots=3, ctx=2048, device_bytes=150_000, page_dir=str(tmp_path),
                 ask_timeout_s=20)
    async with ActorSystem(cfg) as s:
        ids = [(await s.gene_load(p)).id for p in loras]
        answers: list[str] = []
        refused: list[dict] = []

        async def client(c: int) -> None:
            for turn in range(6):
                genes = [{"id": ids[(c + turn + k) % 4], "scale": 1.0} for k in range(1 + (c + turn) % 2)]
                params = dict(prompt=prompt(60 + 37 * c, c), n_predict=3, ignore_eos=True, genes=genes,
                              **({"mind": f"m{c}"} if c % 2 else {"slot": c % 3}))
                try:
                    answers.append((await s.complete(**params)).stop_reason)
                except DeviceBudgetExceeded:
                    answers.append("refused")
                    refused.append(params)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for c in range(6):
                    tg.start_soon(client, c)
        assert len(answers) == 36
        # How many contend away depends on the interleaving; what does not: most succeed, and
        # every refusal was contention, not a state left broken (each, alone, succeeds).
        assert answers.count("length") + answers.count("refused") == 36 and answers.count("length") >= 18, answers
        for params in refused:
            assert (await s.complete(**params)).stop_reason == "length"
        # The budget holds once nothing runs: the residency has taken every slot's Finish (told
        # just before each answer, so a client hears back first), the evictions it starts and
        # the page-outs its handler may still be awaiting (no queue shows those): a budget that
        # never comes back fails the deadline.
        res = s.residency
        await eventually(lambda: not (res.statistics().queued or res.running or res.pending or res.evicting
                                      or any(x.statistics().queued for x in s.slots)
                                      or res.device_bytes() > cfg.device_bytes),
                         "nothing queued or moving, and the device budget holds", every=0.005)
        assert s.dispatcher.cycles == [] and not any(a.failed for a in s.actors())


# ---- KV pressure ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_kv_pressure_evicts_the_idle_slot_and_the_new_request_succeeds(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=2048, page_dir=str(tmp_path))) as s:
        await s.complete(prompt=prompt(1500), n_predict=2, slot=0, ignore_eos=True)
        r = await s.complete(prompt=prompt(700, 1), n_predict=4, slot=1, ignore_eos=True)
        assert r.stop_reason == "length" and len(r.tokens) == 4
        infos = await s.slot_list()
        assert infos[0].n_tokens == 0 and infos[1].n_tokens == 700 + 3
        # A request naming no slot, with the cache held again by an idle slot.
        await s.complete(prompt=prompt(1500, 2), n_predict=1, slot=0, ignore_eos=True)
        r = await s.complete(prompt=prompt(900, 3), n_predict=2, ignore_eos=True)
        assert r.stop_reason == "length"
        m = s.metrics.snapshot()
        assert m["kv_evictions_total"] >= 2 and m.get('requests_total{outcome=error}', 0) == 0


@pytest.mark.anyio
async def test_kv_pressure_pages_an_idle_mind_out_under_its_name_and_it_comes_back(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=2048, page_dir=str(tmp_path))) as s:
        first = await s.complete(prompt=prompt(1400), n_predict=2, mind="ada", ignore_eos=True)
        await s.complete(prompt=prompt(900, 1), n_predict=2, mind="bob", ignore_eos=True)
        assert [p.page for p in await s.page_list()] == ["ada"]
        again = await s.complete(prompt=prompt(1400) + first.tokens + [9], n_predict=2, mind="ada", ignore_eos=True)
        assert again.n_cached >= 1400, "ada came back by page-in, not by re-prefill"


@pytest.mark.anyio
async def test_generation_past_the_window_stops_with_context(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, page_dir=str(tmp_path))) as s:
        r = await s.complete(prompt=prompt(20), n_predict=5000, slot=0, ignore_eos=True)
        assert r.stop_reason == "context" and 20 + len(r.tokens) <= 512


@pytest.mark.anyio
async def test_two_generations_that_outgrow_the_shared_cache_end_with_context_not_an_engine_error(tiny_model,
                                                                                                  tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, page_dir=str(tmp_path))) as s:
        out = []

        async def gen(slot: int) -> None:
            out.append(await s.complete(prompt=prompt(30, slot), n_predict=1000, slot=slot, ignore_eos=True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(gen, 0)
            tg.start_soon(gen, 1)
        assert sorted(r.stop_reason for r in out) == ["context", "context"]
        lengths = sorted(30 + len(r.tokens) for r in out)
        # The younger stopped when the two filled the cache; the other then took its cells.
        assert lengths[0] <= 512 // 2 + 1 and lengths[1] <= 512 and lengths[1] > 512 // 2 + 1


@pytest.mark.anyio
async def test_a_prompt_that_cannot_get_cells_from_a_running_request_fails_with_context_full(tiny_model, tmp_path):
    """Slot 0 generates; slot 1's prompt needs cells slot 0 holds and cannot give: slot 1 (the
    younger) gets ContextFull, nothing is stuck, and slot 0 goes on into slot 1's cells."""
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=1024, batch=64, page_dir=str(tmp_path))) as s:
        res: dict[int, object] = {}

        async def go(slot: int, n_prompt: int, n_predict: int) -> None:
            try:
                res[slot] = await s.complete(prompt=prompt(n_prompt, slot), n_predict=n_predict, slot=slot,
                                             ignore_eos=True)
            except ContextFull as e:
                res[slot] = e

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(go, 0, 30, 600)  # the live count is the scheduler core's
                await eventually(lambda: s.scheduler.held(0) >= 40, "slot 0 holds 40 cells", every=0.001)
                tg.start_soon(go, 1, 1000, 2)
        assert isinstance(res[1], ContextFull), res
        assert res[0].stop_reason == "length" and len(res[0].tokens) == 600  # type: ignore[attr-defined]
        assert (await s.complete(prompt=prompt(50, 9), n_predict=2, slot=1, ignore_eos=True)).stop_reason == "length"


# ---- one failing request never wedges its slot or its neighbours ------------------------


@pytest.mark.anyio
async def test_a_sink_that_raises_ends_its_request_alone_and_frees_its_slot(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=1024, page_dir=str(tmp_path))) as s:
        def bad_sink(chunk):
            raise RuntimeError("planted sink failure")

        got: dict[str, object] = {}
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                async def doomed() -> None:
                    try:
                        await s.complete(prompt=prompt(10), n_predict=50, slot=0, ignore_eos=True, stream=True,
                                         on_token=bad_sink)
                    except ActordError as e:
                        got["doomed"] = e

                tg.start_soon(doomed)
                r = await s.complete(prompt=prompt(12, 1), n_predict=30, slot=1, ignore_eos=True)
        assert r.stop_reason == "length" and len(r.tokens) == 30
        assert isinstance(got["doomed"], InternalError)
        info = (await s.slot_list())[0]
        assert info.state == "idle" and info.n_tokens > 0
        again = await s.complete(prompt=prompt(10), n_predict=5, slot=0, ignore_eos=True)
        assert again.stop_reason == "length" and again.n_cached > 0
        assert (await s.health())["failed_actors"] == []


# ---- the wait-for detector --------------------------------------------------------------


class _Pinger(Actor[object]):
    """A test actor outside the order: it asks its peer whatever it is told to."""

    peer: "_Pinger"

    async def handle(self, msg, env):
        if msg == "ping-peer":
            env.reply.send(await self.peer.ask("echo"))
        else:
            env.reply.send(msg)


@pytest.mark.anyio
async def test_the_wait_for_detector_refuses_the_ask_that_closes_a_cycle():
    d = Dispatcher()
    a, b = _Pinger(d, "a"), _Pinger(d, "b")
    a.peer, b.peer = b, a

    async def b_handle(msg, env):
        if msg == "echo":  # b, asked by a, asks a back: the cycle a -> b -> a
            env.reply.send(await a.ask("echo"))
        else:
            await _Pinger.handle(b, msg, env)

    b.handle = b_handle  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        d.bind(tg)
        d.spawn(a)
        d.spawn(b)
        with anyio.fail_after(5), pytest.raises(AskCycle) as e:
            await a.ask("ping-peer")
        a.close()
        b.close()
    assert e.value.data["cycle"] == ["b", "a", "b"]
    assert d.cycles == [["b", "a", "b"]] and d.waits == {}


@pytest.mark.anyio
async def test_an_upward_ask_is_refused_at_once_by_the_order(tiny_model, tmp_path):
    from actord.serving.messages import Info

    async with ActorSystem(Config(model=tiny_model, slots=1, page_dir=str(tmp_path))) as s:
        async def residency_asks_a_slot(msg, env):
            env.reply.send(await s.slots[0].ask(Info()))

        s.residency.handle = residency_asks_a_slot  # type: ignore[method-assign]
        with pytest.raises(AskOrderViolated):
            await s.residency.ask("anything")


@pytest.mark.anyio
async def test_an_unanswered_ask_is_a_typed_timeout_naming_the_wait_chain():
    d = Dispatcher()
    mute = _Pinger(d, "mute")

    async def never(msg, env):
        await anyio.sleep_forever()

    mute.handle = never  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        d.bind(tg)
        d.spawn(mute)
        with pytest.raises(AskTimeout) as e:
            await mute.ask("hello", timeout=0.2)
        tg.cancel_scope.cancel()
    assert e.value.data["chain"][:2] == ["client", "mute"]


# ---- start and stop ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_failed_default_gene_at_start_leaves_no_engine_thread_running(tiny_model, tmp_path):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(FileNotFound, match="missing.gguf"):
        async with ActorSystem(Config(model=tiny_model, slots=1, gene=[str(tmp_path / "missing.gguf")],
                                      page_dir=str(tmp_path))):
            pass
    await eventually(lambda: "actord-engine" not in {t.name for t in threading.enumerate()} - before,
                     "the engine thread ended")
    async with ActorSystem(Config(model=tiny_model, slots=1, page_dir=str(tmp_path))) as s:  # libllama is free again
        assert (await s.complete(prompt=prompt(5), n_predict=1, slot=0)).n_prompt_tokens == 5


@pytest.mark.anyio
async def test_shutdown_cancels_requests_past_the_grace_and_refuses_new_ones(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=4096, page_dir=str(tmp_path))) as s:
        results: list[object] = []

        async def long(**where) -> None:
            results.append(await s.complete(prompt=prompt(10), n_predict=3000, ignore_eos=True, **where))

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: long(slot=0))
            tg.start_soon(lambda: long(mind="ada"))
            await eventually(lambda: len(s.inflight) == 2, "both requests in flight")
            with anyio.fail_after(10):
                counts = await s.shutdown(grace_s=0.2)
        assert counts["finished"] == 0 and counts["cancelled"] == 2  # then the minds were persisted
        assert sorted(r.stop_reason for r in results) == ["cancelled", "cancelled"]
        with pytest.raises(ShuttingDown):
            await s.complete(prompt=prompt(5), n_predict=1, slot=0)


@pytest.mark.anyio
async def test_concurrent_requests_naming_no_slot_spread_over_the_idle_slots(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=3, ctx=2048, page_dir=str(tmp_path))) as s:
        got: list[int] = []

        async def one(i: int) -> None:
            got.append((await s.complete(prompt=prompt(20, i), n_predict=30, ignore_eos=True)).slot)

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
        assert sorted(got) == [0, 1, 2]


@pytest.mark.anyio
async def test_when_the_cache_disagrees_with_the_cell_count_the_step_makes_room_and_retries(tiny_model, tmp_path):
    """Our count said it fits, libllama said KV full: idle cells are freed and the step runs."""
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, page_dir=str(tmp_path))) as s:
        s.scheduler.n_ctx = 100_000  # a wrong count: only the engine's refusal can tell
        await s.complete(prompt=prompt(400), n_predict=1, slot=0, ignore_eos=True)
        r = await s.complete(prompt=prompt(300, 1), n_predict=3, slot=1, ignore_eos=True)
        assert r.stop_reason == "length" and (await s.slot_list())[0].n_tokens == 0
        assert s.metrics.snapshot()["kv_evictions_total"] >= 1
