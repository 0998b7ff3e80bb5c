"""A slot that refuses its eviction as busy is waited for, not yielded to.

The scheduler needs cells an idle-looking slot holds; that slot answers `SlotBusy` because
its request is between the scheduler and itself (just enrolled, or just ended and not yet
told so). Yielding then ended the waiting request with `ContextFull` although the cells
were about to be free (issue 28's peer run: a 503 on a 512-cell daemon while a slot held
511 cells of the previous prompt). The scheduler parks instead, and the slot's next tell
wakes it; a refusal for any other reason still yields at once.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from actord.serving.kernel import Actor, Dispatcher, Envelope
from actord.serving.messages import Cells, Ended, Enroll, Evict
from actord.serving.scheduler import Scheduler
from actord.vocabulary.errors import ContextFull, PageRamExceeded, SlotBusy
from actord.vocabulary.metrics import Metrics
from actord.testing.fake_engine import FakeEngine

N_CTX = 256


class InlineEngine:
    """The stand-in engine answered in the caller's task (no engine thread needed here)."""

    def __init__(self) -> None:
        self.fake = FakeEngine(SimpleNamespace(ctx=N_CTX, batch=64, slots=2, device_bytes=0, prompt_logits_memo=True))

    def _do(self, job: Any) -> tuple[bool, Any]:
        try:
            return True, self.fake.handle(job)
        except Exception as e:  # noqa: BLE001  (handed to wait(), as the engine thread does)
            return False, e

    def submit(self, job: Any) -> tuple[bool, Any]:
        return self._do(job)

    async def wait(self, p: tuple[bool, Any]) -> Any:
        ok, v = p
        if not ok:
            raise v
        return v

    async def run(self, job: Any) -> Any:
        return await self.wait(self._do(job))


class Holder(Actor[Any]):
    """Slot 0: holds `cells` idle-looking cells and refuses its first eviction with `refusal`;
    with `tell_after` it then tells its count, as a slot whose request just ended does."""

    def __init__(self, dispatcher: Dispatcher, cells: int, refusal: Exception, tell_after: bool) -> None:
        super().__init__(dispatcher, "slot-0", 64)
        self.cells, self.refusal, self.tell_after = cells, refusal, tell_after
        self.scheduler: Scheduler | None = None
        self.asked = 0
        self.engine_held: dict[int, int] = {}

    async def handle(self, msg: Any, env: Envelope[Any]) -> None:
        if isinstance(msg, Evict) and env.reply is not None:
            self.asked += 1
            assert self.scheduler is not None
            if self.asked == 1:
                env.reply.fail(self.refusal)
                if self.tell_after:
                    self.scheduler.tell_nowait(Cells(slot=0, n=self.cells, seq=1))
                return
            freed, self.cells = self.cells, 0
            self.engine_held.pop(0, None)  # as the slot's SeqRm would
            env.reply.send((freed, 2))


class Relay(Actor[Any]):
    """A slot as the scheduler sees it at a request's end: the answer handed on (slot 1
    here; test_engine_time_budget.py's slots)."""

    async def handle(self, msg: Any, env: Envelope[Any]) -> None:
        if isinstance(msg, Ended) and env.reply is not None:
            if isinstance(env.answer, BaseException):
                env.reply.fail(env.answer)
            else:
                env.reply.send(env.answer)


async def _run(refusal: Exception, tell_after: bool) -> tuple[Any, Holder]:
    disp = Dispatcher()
    eng = InlineEngine()
    holder = Holder(disp, N_CTX, refusal, tell_after)  # every cell: nothing runs until it gives
    slot1 = Relay(disp, "slot-1", 64)
    sched = Scheduler(disp, eng, [holder, slot1], n_batch=64, metrics=Metrics(), n_ctx=N_CTX, depth=1)
    holder.scheduler = sched
    result: Any = None
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            disp.bind(tg)
            for a in (holder, slot1, sched):
                disp.spawn(a)
            sched.tell_nowait(Cells(slot=0, n=N_CTX))
            eng.fake.held[0] = N_CTX
            eng.fake.samplers.add(1)
            holder.engine_held = eng.fake.held
            try:
                result = await sched.ask(Enroll(rid=1, slot=1, seq=1, prompt=[1] + [5 + i % 300 for i in range(99)],
                                                pos0=0, n_predict=2, ignore_eos=True))
            except ContextFull as e:
                result = e
            for a in (holder, slot1, sched):
                a.close()
    return result, holder


@pytest.mark.anyio
async def test_a_victim_busy_for_a_moment_is_waited_for_and_the_request_gets_its_cells():
    result, holder = await _run(SlotBusy("slot 0 has work in flight", slot=0), tell_after=True)
    assert not isinstance(result, ContextFull), result
    assert result.stop_reason == "length" and len(result.tokens) == 2
    assert holder.asked == 2  # asked again once it told, not in a loop meanwhile


@pytest.mark.anyio
async def test_a_victim_that_refuses_for_good_still_ends_the_request_with_context_full():
    result, holder = await _run(PageRamExceeded("no room for her page", mind="ada"), tell_after=False)
    assert isinstance(result, ContextFull)
    assert holder.asked == 1
