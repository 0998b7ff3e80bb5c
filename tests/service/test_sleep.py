"""The idle daemon sleeps (service/sleep.py, engine/sleep.py): minds page out, the engine
frees its model and context, and the next request loads them again with nothing lost."""

from __future__ import annotations

import anyio
import pytest

from actord.engine import jobs as J
from actord.vocabulary.config import Config
from actord.service.sleep import IdleClock
from actord.service.system import ActorSystem
from actord.testing.fake_engine import FakeEngine
from actord.vocabulary.errors import SlotBusy
from tests.waits import eventually, wait_until


def prompt(n: int, salt: int = 0) -> list[int]:
    return [1] + [5 + (i * 7 + salt) % 300 for i in range(n - 1)]


@pytest.fixture(scope="session")
def lora(tiny_model, models_dir):
    from actord.testing.models import write_tiny_lora

    return str(write_tiny_lora(models_dir / "sleep-lora.gguf", tiny_model, seed=77))


@pytest.mark.anyio
async def test_a_sleeping_daemon_pages_her_out_frees_the_model_and_she_comes_back_whole(tiny_model, lora, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=1024, page_dir=str(tmp_path))) as s:
        g = (await s.gene_load(lora)).id
        genes = [{"id": g, "scale": 1.0}]
        first = await s.complete(prompt=prompt(300), n_predict=4, mind="ada", ignore_eos=True, genes=genes)
        twin = await s.complete(prompt=prompt(300), n_predict=4, slot=1, ignore_eos=True, genes=genes)
        assert twin.tokens == first.tokens
        assert await IdleClock(s, 1.0).sleep()
        assert s.asleep
        assert [i.n_tokens for i in await s.slot_list()] == [0, 0]
        assert [p.page for p in await s.page_list()] == ["ada"]
        # What needs no engine does not wake it: props, the template, the step records.
        await s.engine.run(J.ModelInfo())
        await s.chat_info()
        await s.engine.run(J.StepRecords())
        assert s.asleep
        again = await s.complete(prompt=prompt(300) + first.tokens + [9], n_predict=4, mind="ada", ignore_eos=True,
                                 genes=genes)
        assert not s.asleep
        assert again.n_cached >= 300, "she came back from her page, not by re-prefill"
        # The gene resident before the sleep is resident after it, and decodes as before.
        await s.slot_erase(1)
        assert (await s.complete(prompt=prompt(300), n_predict=4, slot=1, ignore_eos=True, genes=genes)).tokens \
            == first.tokens


@pytest.mark.anyio
async def test_sleep_is_refused_while_a_request_runs_and_the_request_is_untouched(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=1024, page_dir=str(tmp_path))) as s:
        clock = IdleClock(s, 1.0)
        out: dict[str, object] = {}
        first_token = anyio.Event()

        async def gen() -> None:
            out["r"] = await s.complete(prompt=prompt(40), n_predict=300, slot=0, ignore_eos=True,
                                        on_token=lambda chunk: first_token.set())

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(gen)
                await first_token.wait()
                assert not await clock.sleep()
        assert not s.asleep
        assert len(out["r"].tokens) == 300  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_the_idle_clock_sleeps_after_the_quiet_time_and_a_request_wakes_it(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=1024, page_dir=str(tmp_path))) as s:
        await s.complete(prompt=prompt(30), n_predict=2, slot=0, ignore_eos=True)
        clock = IdleClock(s, 0.3)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(clock.run)
                await eventually(lambda: s.asleep, "the idle daemon sleeps", every=0.02)
                r = await s.complete(prompt=prompt(30), n_predict=2, slot=0, ignore_eos=True)
                assert r.stop_reason == "length" and not s.asleep
                await eventually(lambda: clock.sleeps == 2, "it sleeps again after the request", every=0.02)
                tg.cancel_scope.cancel()
        assert s.metrics.snapshot()["sleeps_total"] == 2


def test_the_stand_in_engine_refuses_to_sleep_over_held_cells_as_the_real_one_does():
    from types import SimpleNamespace

    fake = FakeEngine(SimpleNamespace(ctx=64, batch=16, slots=2, device_bytes=0, prompt_logits_memo=True))
    fake.held[1] = 5
    with pytest.raises(SlotBusy):
        fake.handle(J.Sleep())
    fake.held[1] = 0
    assert fake.handle(J.Sleep()) is True


@pytest.mark.slow
def test_the_daemon_sleeps_when_idle_and_props_says_so_until_a_request_wakes_it(tiny_model, tmp_path):
    import httpx

    from tests.frontends.test_openai_http import _start, _stop

    proc, _, url = _start(tiny_model, tmp_path / "d", "--sleep-idle-s", "0.3")
    try:
        def sleeping() -> bool:
            return httpx.get(url + "/props", timeout=10).json()["is_sleeping"]

        wait_until(sleeping, "the idle daemon sleeps", timeout=30)
        assert httpx.get(url + "/health", timeout=10).status_code == 200 and sleeping()
        r = httpx.post(url + "/completion", json={"prompt": "Hello", "n_predict": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
        assert not sleeping()
    finally:
        _stop(proc)
