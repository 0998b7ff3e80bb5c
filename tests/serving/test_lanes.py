"""The actor kernel's two lanes: an actor's own messages are not queued behind a flood of
client messages, clients still get their turns, and a tell sent before answering a client
is still delivered before that client's next message (issue 19.3)."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from actord.serving.kernel import Actor, Dispatcher, Envelope
from tests.waits import eventually

pytestmark = pytest.mark.anyio


class Tick(msgspec.Struct, tag=True, frozen=True):
    n: int


class Call(msgspec.Struct, tag=True, frozen=True):
    n: int


class Busy(Actor[Tick | Call]):
    """Keeps itself busy like the scheduler (a Tick tells the next Tick) and answers Calls."""

    def __init__(self, dispatcher: Dispatcher, ticks: int) -> None:
        super().__init__(dispatcher, "busy", capacity=256)
        self.ticks = ticks
        self.log: list[str] = []

    async def handle(self, msg: Tick | Call, env: Envelope[Tick | Call]) -> None:
        match msg:
            case Tick(n=n):
                self.log.append("tick")
                if n + 1 < self.ticks:
                    self.tell_nowait(Tick(n=n + 1))
            case Call(n=n):
                self.log.append("call")
                if env.reply is not None:
                    env.reply.send(n)


async def test_an_actors_own_work_alternates_with_a_flood_of_client_calls_not_behind_it():
    disp = Dispatcher()
    a = Busy(disp, ticks=50)
    async with anyio.create_task_group() as tg:
        disp.bind(tg)
        answers: list[int] = []

        async def call(n: int) -> None:
            answers.append(await a.ask(Call(n=n)))

        for i in range(200):  # a flood: the client lane is full before the actor runs
            tg.start_soon(call, i)
        await anyio.wait_all_tasks_blocked()
        a.put_nowait(Envelope(Tick(n=0)))  # as an actor would tell it: the control lane
        disp.spawn(a)
        await eventually(lambda: len(answers) >= 200 and a.log.count("tick") >= 50, "every call answered, every tick run",
                         every=0.001)
        a.close()
    first_tick = a.log.index("tick")
    assert first_tick <= 1, "the actor's own message waited behind the flood"
    calls_between = [len(run) for run in "".join("t" if e == "tick" else "c" for e in a.log[first_tick:]).split("t")[1:]]
    # Every tick waited for at most one client call, never for the queue of them.
    assert max(calls_between[:-1]) <= 1, a.log
    assert sorted(answers) == list(range(200))


async def test_a_tell_sent_before_answering_a_client_is_delivered_before_its_next_message():
    disp = Dispatcher()
    target = Busy(disp, ticks=1)

    class Teller(Actor[Call]):
        async def handle(self, msg: Call, env: Envelope[Call]) -> None:
            target.tell_nowait(Tick(n=0))  # control lane, sent before the answer
            env.reply.send(msg.n)  # type: ignore[union-attr]

    teller = Teller(disp, "teller")
    async with anyio.create_task_group() as tg:
        disp.bind(tg)
        disp.spawn(target)
        disp.spawn(teller)
        for i in range(20):
            await teller.ask(Call(n=i))
            await target.ask(Call(n=i))  # the client's next message, on the client lane
        target.close()
        teller.close()
    assert target.log == ["tick", "call"] * 20
