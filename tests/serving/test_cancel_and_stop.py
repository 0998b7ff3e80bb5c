"""Abandoned work through the embedded API, and the per-token stop scan (issue 10).

A host that cancels the scope around `complete` gets the same as a socket client that
hangs up: the slot ends the request at its next step ("cancelled"), frees, and serves the
next request. Stop strings are searched in the new tail only; the result must be the same
as searching the whole text: cut at the first occurrence, however the tokens split it.
"""

from __future__ import annotations

import anyio
import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem
from tests.waits import eventually, slot_in

pytestmark = pytest.mark.anyio

CANCELLED = 'requests_total{outcome=cancelled}'


def cfg(model: str) -> Config:
    return Config(model=model, slots=2, ctx=4096, batch=64, threads=1)


async def _deferred(s: ActorSystem, slot: int) -> int:
    return (await s.slot_list())[slot].deferred


async def _none_deferred(s: ActorSystem, slot: int) -> bool:
    return await _deferred(s, slot) == 0


async def test_a_cancelled_caller_scope_cancels_the_request_at_the_next_step(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        started = anyio.Event()
        with anyio.move_on_after(30):
            with anyio.CancelScope() as scope:
                def on_token(chunk: dict) -> None:
                    started.set()
                    scope.cancel()

                await s.complete(prompt=[1, 2, 3], n_predict=4000, ignore_eos=True, slot=0, stream=True,
                                 on_token=on_token)
        assert started.is_set() and scope.cancelled_caught
        await eventually(lambda: slot_in(s, 0, "idle"), "slot 0 idle again", every=0.01)
        m = s.metrics.snapshot()
        assert m[CANCELLED] == 1 and m["predicted_tokens_total"] < 100
        r = await s.complete(prompt=[1, 2, 3], n_predict=8, ignore_eos=True, slot=0)
        assert len(r.tokens) == 8


async def test_a_cancelled_request_waiting_behind_another_never_runs(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: s.complete(prompt=[1, 2], n_predict=1000, ignore_eos=True, slot=1))
            await eventually(lambda: slot_in(s, 1, "processing"), "slot 1 runs the first request", every=0.001)
            with anyio.CancelScope() as waiting:  # deferred behind the first, then abandoned
                async def abandon_once_deferred() -> None:
                    await eventually(lambda: _deferred(s, 1), "the second request deferred", every=0.001)
                    waiting.cancel()

                tg.start_soon(abandon_once_deferred)
                await s.complete(prompt=[5, 6], n_predict=4000, ignore_eos=True, slot=1)
            assert waiting.cancelled_caught
            await eventually(lambda: _none_deferred(s, 1), "nothing deferred on slot 1", every=0.001)
        m = s.metrics.snapshot()
        assert m["requests_deferred_total"] == 1 and m["predicted_tokens_total"] == 1000


async def _text(s: ActorSystem, n: int) -> str:
    return (await s.complete(prompt="hello there", n_predict=n, ignore_eos=True, slot=0)).content


async def test_stop_strings_cut_at_the_first_occurrence_whatever_the_token_split(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        full = await _text(s, 120)
        assert len(full) > 40
        for start, length in [(5, 3), (17, 9), (30, 1), (len(full) - 6, 6)]:
            stop = full[start:start + length]
            if not stop.strip():
                continue
            first = full.find(stop)
            chunks: list[str] = []
            r = await s.complete(prompt="hello there", n_predict=120, ignore_eos=True, slot=0,
                                 stop=["never-there-" * 3, stop], stream=True,
                                 on_token=lambda ch: chunks.append(ch["content"]))
            assert r.stop_reason == "stop" and r.content == full[:first], (stop, r.content, full)
            assert "".join(chunks) == r.content  # nothing past the stop string was streamed


async def test_streamed_text_equals_the_result_without_stops(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        chunks: list[str] = []
        r = await s.complete(prompt="hello there", n_predict=200, ignore_eos=True, slot=0, stream=True,
                             on_token=lambda ch: chunks.append(ch["content"]))
        assert "".join(chunks) == r.content and len(chunks) > 10
