"""Failures are contained (issue 15, point 5): an error while handling one request's step
output ends that request with a typed error, returns its slot to idle with its cells
accounted, and every other request goes on; every request gets exactly one final answer.

Each failure is injected where it happens in a real run: a step that fails in the engine,
a stop handler that raises, a checkpoint the budget cannot admit, a gene release that
fails, and a burst of 200 simultaneous requests on 2 slots (no AskCycle, all answered).
"""

from __future__ import annotations

import anyio
import pytest

from actord.serving.checkpoint_budget import AdmitCheckpoint
from actord.serving.gene_residency import Finish as GeneFinish
from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.engine.engine import Engine
from actord.engine.step import Stepper
from actord.vocabulary.errors import ActordError, EngineError, InternalError
from actord.service.system import ActorSystem
from tests.waits import eventually

pytestmark = pytest.mark.anyio


def prompt(n: int, salt: int = 0) -> list[int]:
    return [1] + [5 + (i * 7 + salt) % 300 for i in range(n - 1)]


async def both(s: ActorSystem, doomed, healthy) -> dict[str, object]:
    """Run two requests at once; each gets exactly one final answer (a value or an error)."""
    got: dict[str, object] = {}

    async def one(key: str, call) -> None:
        try:
            got[key] = await call()
        except ActordError as e:
            got[key] = e

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "doomed", doomed)
            tg.start_soon(one, "healthy", healthy)
    return got


async def assert_idle_and_usable(s: ActorSystem, slot: int) -> None:
    info = (await s.slot_list())[slot]
    assert info.state == "idle" and info.deferred == 0
    assert s.scheduler.held(slot) == info.n_tokens  # its cells are what its sequence holds
    r = await s.complete(prompt=prompt(9, 3), n_predict=4, slot=slot, ignore_eos=True)
    assert r.stop_reason == "length" and len(r.tokens) == 4


class _FailsOnSeq0Once(Stepper):
    """A real engine's stepper whose first decode step holding sequence 0 after a few steps fails."""

    armed = True

    def _step(self, job: J.Step) -> J.StepOut:
        if _FailsOnSeq0Once.armed and self.step_no > 3 and any(e.seq == 0 for e in job.entries):
            _FailsOnSeq0Once.armed = False
            self.step_no += 1
            raise EngineError("injected decode failure")
        return super()._step(job)


async def test_a_failing_step_ends_its_requests_typed_and_the_slot_serves_the_next(tiny_model, tmp_path):
    _FailsOnSeq0Once.armed = True
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=1024, page_dir=str(tmp_path)),
                           engine_factory=lambda c: Engine(c, stepper=_FailsOnSeq0Once)) as s:
        got = await both(
            s, lambda: s.complete(prompt=prompt(10), n_predict=60, slot=0, ignore_eos=True),
            lambda: s.complete(prompt=prompt(12, 1), n_predict=60, slot=1, ignore_eos=True))
        # The step held both slots' tokens: both end with the engine's error, nobody hangs.
        assert isinstance(got["doomed"], EngineError)
        assert isinstance(got["healthy"], EngineError) or got["healthy"].stop_reason == "length"
        await assert_idle_and_usable(s, 0)
        await assert_idle_and_usable(s, 1)
        assert (await s.health())["failed_actors"] == []


async def test_a_stop_handler_that_raises_ends_only_its_request(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=1024, page_dir=str(tmp_path))) as s:
        class Broken:
            def push(self, piece: bytes):
                raise RuntimeError("planted stop-scan failure")

            def finish(self) -> str:
                return ""

        async def doomed():
            out: dict[str, object] = {}

            async def sabotage() -> None:
                await eventually(lambda: any(r.slot == 0 for r in s.scheduler.core.reqs.values()), "enrolled")
                [r] = [r for r in s.scheduler.core.reqs.values() if r.slot == 0]
                r.text = Broken()

            async with anyio.create_task_group() as tg:
                tg.start_soon(sabotage)
                try:
                    out["value"] = await s.complete(prompt=prompt(200), n_predict=400, slot=0, ignore_eos=True,
                                                    stop=["zz"])
                except ActordError as e:
                    out["error"] = e
            if "error" in out:
                raise out["error"]
            return out["value"]

        got = await both(s, doomed, lambda: s.complete(prompt=prompt(12, 1), n_predict=30, slot=1, ignore_eos=True))
        assert isinstance(got["doomed"], InternalError)
        assert got["healthy"].stop_reason == "length" and len(got["healthy"].tokens) == 30
        await assert_idle_and_usable(s, 0)


async def test_a_checkpoint_the_budget_cannot_admit_leaves_the_request_and_slot_whole(tiny_swa_model, tmp_path):
    cfg = Config(model=tiny_swa_model, slots=2, ctx=1024, page_dir=str(tmp_path), swa_full="off",
                 checkpoint_policy="divergence", checkpoint_every=32, ctx_checkpoints_bytes=1 << 24)
    async with ActorSystem(cfg) as s:
        real = s.ckpt_budget.handle
        refused = []

        async def refuse(msg, env):
            if isinstance(msg, AdmitCheckpoint):
                refused.append(msg.pos)
                raise InternalError("planted: the budget cannot admit")
            return await real(msg, env)

        s.ckpt_budget.handle = refuse  # type: ignore[method-assign]
        got = await both(s, lambda: s.complete(prompt=prompt(300), n_predict=8, slot=0, ignore_eos=True),
                         lambda: s.complete(prompt=prompt(40, 1), n_predict=8, slot=1, ignore_eos=True))
        assert refused, "no checkpoint was offered: the test proves nothing"
        assert got["doomed"].stop_reason == "length" and got["healthy"].stop_reason == "length"
        assert (await s.slot_list())[0].n_checkpoints == 0
        await assert_idle_and_usable(s, 0)


async def test_a_gene_release_that_fails_still_answers_and_frees_the_slot(tiny_model, models_dir, tmp_path):
    from actord.testing.models import write_tiny_lora

    lora = str(write_tiny_lora(models_dir / "fail-lora.gguf", tiny_model, seed=77))
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=1024, page_dir=str(tmp_path))) as s:
        gid = (await s.gene_load(lora)).id
        real = s.residency.handle

        async def crash_on_release(msg, env):
            if isinstance(msg, GeneFinish) and msg.slot == 0:
                raise RuntimeError("planted release failure")
            return await real(msg, env)

        s.residency.handle = crash_on_release  # type: ignore[method-assign]
        r = await s.complete(prompt=prompt(20), n_predict=6, slot=0, ignore_eos=True, genes=[{"id": gid}])
        assert r.stop_reason == "length" and len(r.tokens) == 6
        await eventually(lambda: s.residency.failed, "the residency crashed on the release")
        info = (await s.slot_list())[0]
        assert info.state == "idle" and s.scheduler.held(0) == info.n_tokens
        # The residency is gone: what needs it is refused, typed, and the slot stays idle;
        # a slot that never held genes serves on.
        with pytest.raises(ActordError):
            await s.complete(prompt=prompt(9, 2), n_predict=3, slot=0, ignore_eos=True, genes=[{"id": gid}])
        assert (await s.slot_list())[0].state == "idle"
        assert (await s.complete(prompt=prompt(9, 2), n_predict=3, slot=1, ignore_eos=True)).stop_reason == "length"


async def test_a_burst_of_200_requests_on_2_slots_is_answered_without_an_ask_cycle(tiny_model, tmp_path):
    cfg = Config(model=tiny_model, slots=2, ctx=2048, page_dir=str(tmp_path), page_ram_bytes=1 << 26,
                 request_timeout_s=120)
    async with ActorSystem(cfg) as s:
        answers: list[str] = []

        async def client(i: int) -> None:
            where = ({"slot": i % 2} if i % 3 == 0 else {"mind": f"m{i % 7}"} if i % 3 == 1 else {})
            try:
                r = await s.complete(prompt=prompt(8 + i % 13, i), n_predict=2 + i % 5, ignore_eos=True, **where)
                answers.append(r.stop_reason)
            except ActordError as e:
                answers.append(e.type)

        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(client, i)
        assert len(answers) == 200
        assert answers.count("length") == 200, {a: answers.count(a) for a in set(answers)}
        assert s.dispatcher.cycles == [] and not any(a.failed for a in s.actors())


async def test_a_crashed_slot_answers_its_request_and_gives_its_cells_back(tiny_model, tmp_path):
    from actord.serving.messages import CheckpointTaken

    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=1024, page_dir=str(tmp_path))) as s:
        await s.complete(prompt=prompt(300), n_predict=2, slot=0, ignore_eos=True)
        assert s.scheduler.held(0) > 0
        real = s.slots[0].handle

        async def crash(msg, env):
            if isinstance(msg, CheckpointTaken):
                raise RuntimeError("planted slot crash")
            return await real(msg, env)

        s.slots[0].handle = crash  # type: ignore[method-assign]
        s.slots[0].tell_nowait(CheckpointTaken(rid=0, pos=1, data=bytearray()))
        await eventually(lambda: s.slots[0].failed and s.scheduler.held(0) == 0, "cells given back")
        r = await s.complete(prompt=prompt(900, 5), n_predict=4, slot=1, ignore_eos=True)  # needs slot 0's cells
        assert r.stop_reason == "length"
        assert (await s.health())["failed_actors"] == ["slot0"]
