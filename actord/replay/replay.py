"""Replay a recorded trace under the deterministic dispatcher and report the first divergence.

The trace's external inputs are re-executed in their recorded positions, and every event
(delivery, engine result, worker completion, input) must be the next one the trace says;
engine and worker results must have the recorded digests. At the end, the final state's
digest must equal the footer's. The first event that cannot be matched is reported with
its position (line in the trace file) and both sides.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec

from actord.service import tenancy
from actord.vocabulary.config import Config
from actord.vocabulary.errors import ActordError
from actord.replay.dispatcher import DeterministicDispatcher, EngineOrder, RecordedPolicy, ReplayDiverged, SeededPolicy
from actord.vocabulary.trace import EngineDone, Event, Footer, Header, Input, digest, read_trace, rebase
from actord.frontends.rpc.methods import METHODS
from actord.service.system import ActorSystem


@dataclass
class ReplayResult:
    ok: bool
    events: int
    position: int | None = None  # 1-based line in the trace file of the first divergence
    expected: Any = None
    got: Any = None
    message: str = ""


async def replay(events: list[Event], model: str, *, page_dir: str | None = None) -> ReplayResult:
    header = events[0]
    assert isinstance(header, Header), "a trace starts with its header"
    footer = next((e for e in events if isinstance(e, Footer)), None)
    tmp = tempfile.TemporaryDirectory(prefix="actord-replay-") if page_dir is None else None
    pages = page_dir or tmp.name  # type: ignore[union-attr]
    here = [("<model-dir>/", str(Path(model).parent) + "/"), ("<page-dir>/", pages + "/")]

    def local(obj: Any) -> Any:  # the recorded relative paths, under this run's folders
        return rebase(obj, here)

    cfg_dict = local(dict(header.config))
    cfg_dict.pop("model_digest", None)
    cfg_dict.update(model=model, page_dir=pages)
    cfg = msgspec.convert(cfg_dict, Config)
    lines = {id(e): i + 1 for i, e in enumerate(events)}
    policy = RecordedPolicy(events)
    while isinstance(policy.peek(), EngineDone) and policy.peek().job == "ModelInfo":  # type: ignore[union-attr]
        policy.i += 1  # start-up ran before recording could be ordered
    disp = DeterministicDispatcher(policy)
    disp.order = EngineOrder(events)
    new_events: list[Event] = []
    system = ActorSystem(cfg, dispatcher=disp, trace=new_events)
    result: ReplayResult | None = None

    async def call(ev: Input) -> None:
        method = METHODS[ev.method]
        if ev.tenant is not None:  # asked as the tenant the front vouched for (a page verb's scope)
            tenancy.enter(ev.tenant)
        try:
            await method.call(system, msgspec.convert(local(ev.params), method.params), None)
        except ActordError:
            pass  # a refusal is part of the recorded behaviour; its events are checked

    try:
        async with system:
            disp.live = True
            async with anyio.create_task_group() as tg:
                spawned = -1
                while not policy.done:
                    want = policy.peek()
                    if isinstance(want, Input) and spawned < policy.i:
                        spawned = policy.i
                        tg.start_soon(call, want)
                    try:
                        if not await disp.step():
                            raise ReplayDiverged(disp.position, want, [])
                    except ReplayDiverged as d:
                        result = ReplayResult(False, policy.i, lines.get(id(want)), want, d.available,
                                              f"divergence at trace line {lines.get(id(want))}")
                        tg.cancel_scope.cancel()
                        break
            if result is not None:  # let whatever is in flight finish in any order, then stop
                disp.policy = SeededPolicy(0)
                disp.any_queued = False
                while await disp.step():
                    pass
            disp.close_actors()
    finally:
        if tmp is not None:
            tmp.cleanup()
    if result is not None:
        return result
    state = digest(system.final_state())
    if footer is not None and footer.state != state:
        return ReplayResult(False, policy.i, len(events), footer.state, state, "final state differs")
    return ReplayResult(True, policy.i)


def replay_file(path: str | Path, model: str, backend: str = "asyncio") -> ReplayResult:
    return anyio.run(replay, read_trace(path), model, backend=backend)
