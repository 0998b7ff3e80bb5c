"""A long generation gives its slot up to a mind waiting for one and goes on after her
(policy/yielding.py): the waiting mind is served before the long one ends, the long one's
answer is the one it would have given in one part, and the client sees one stream."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from actord.policy.yielding import continuation, merged, to_yield, yieldable
from actord.service.system import ActorSystem
from actord.vocabulary.config import Config
from actord.vocabulary.types import CompletionRequest, CompletionResult, Timings

pytestmark = pytest.mark.anyio

LONG = [1] + [3 + (i * 7) % 400 for i in range(40)]
SHORT = [1] + [5 + (i * 11) % 400 for i in range(30)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def cfg(model: str, tmp_path, **kw) -> Config:
    return Config(model=model, **{"slots": 1, "ctx": 1024, "batch": 32, "threads": 1, "page_dir": str(tmp_path),
                                  "yield_after_tokens": 16, **kw})


async def one_part(model: str, tmp_path, prompt: list[int], n: int) -> list[int]:
    async with ActorSystem(cfg(model, tmp_path / "ref", yield_after_tokens=0)) as s:
        return (await s.complete(prompt=prompt, n_predict=n, ignore_eos=True, mind="ref")).tokens


@pytest.fixture(params=["tiny_model", "tiny_swa_model", "tiny_hybrid_model", "tiny_recurrent_model"])
def any_memory(request) -> str:
    return request.getfixturevalue(request.param)


async def test_a_mind_waiting_for_the_only_slot_is_served_before_a_long_generation_ends(any_memory, tmp_path):
    """On every memory kind: the long one's rest feeds only the last token it wrote (its KV
    holds the others: no cut back, which sliding-window and recurrent memory could not make)."""
    tiny_model = any_memory
    order: list[str] = []
    chunks: list[dict] = []
    started = anyio.Event()

    def sink(chunk):
        chunks.append(chunk)
        started.set()

    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        async def long():
            r = await s.complete(prompt=LONG, n_predict=300, ignore_eos=True, mind="ada", stream=True, on_token=sink)
            order.append("ada")
            return r

        async def short():
            await started.wait()  # ada holds the slot
            r = await s.complete(prompt=SHORT, n_predict=4, ignore_eos=True, mind="bo")
            order.append("bo")
            return r

        out: dict[str, CompletionResult] = {}

        async def run(name, f):
            out[name] = await f()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "ada", long)
            tg.start_soon(run, "bo", short)
        yielded = s.metrics.registry.get_sample_value("generations_yielded_total")
    assert order == ["bo", "ada"] and yielded >= 1
    ada = out["ada"]
    assert ada.tokens == await one_part(tiny_model, tmp_path, LONG, 300)
    assert ada.stop_reason == "length" and len(ada.tokens) == 300
    assert ada.timings.engine_ms > 0  # one account over her parts (request_engine_s)
    assert ada.n_prompt_tokens == len(LONG)
    # Her rest resumed from her page (a memory copy), not a prefill of what she wrote.
    assert ada.n_prompt_processed == len(LONG) + yielded, (ada.n_prompt_processed, yielded)
    # One stream: every token once, in order, and the prompt's placement told once.
    assert [t for c in chunks for t in c["tokens"]] == ada.tokens
    assert "".join(c["content"] for c in chunks) == ada.content
    assert sum("n_prompt" in c for c in chunks) == 1


async def test_a_generation_whose_sampler_carries_state_keeps_its_slot(tiny_model, tmp_path):
    order: list[str] = []
    started = anyio.Event()
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        async def long():
            await s.complete(prompt=LONG, n_predict=80, ignore_eos=True, mind="ada", repeat_penalty=1.1, stream=True,
                             on_token=lambda c: started.set())
            order.append("ada")

        async def short():
            await started.wait()
            await s.complete(prompt=SHORT, n_predict=4, ignore_eos=True, mind="bo")
            order.append("bo")

        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            tg.start_soon(short)
        assert s.metrics.registry.get_sample_value("generations_yielded_total") == 0
    assert order == ["ada", "bo"]


async def test_a_client_gone_while_its_rest_waits_ends_it_and_the_slot_serves_on(tiny_model, tmp_path):
    started = anyio.Event()
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        async def long():
            await s.complete(prompt=LONG, n_predict=400, ignore_eos=True, mind="ada", stream=True,
                             on_token=lambda c: started.set())

        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            await started.wait()
            bo = await s.complete(prompt=SHORT, n_predict=200, ignore_eos=True, mind="bo")
            tg.cancel_scope.cancel()  # ada's client hangs up: her rest waits behind bo, or runs
        assert len(bo.tokens) == 200
        again = await s.complete(prompt=SHORT, n_predict=2, ignore_eos=True, mind="cy")
        assert len(again.tokens) == 2
        assert s.metrics.registry.get_sample_value("requests_in_flight") == 0


def test_only_requests_a_new_sampler_goes_on_exactly_may_yield():
    base = CompletionRequest(prompt=[1, 2], mind="m")
    assert yieldable(base) and yieldable(base.__class__(prompt=[1], mind="m", temperature=0.8))
    for kw in ({"mind": None}, {"grammar": "root ::= \"a\""}, {"stop": ["x"]}, {"repeat_penalty": 1.1},
               {"presence_penalty": 0.5}, {"seed": 7, "temperature": 0.8}, {"return_progress": True},
               {"timings_per_token": True}, {"thought_budget": {"budget": 4, "start": [5], "end": [6]}}):
        assert not yieldable(CompletionRequest(prompt=[1, 2], **{"mind": "m", **kw})), kw


def test_the_rest_of_a_request_is_its_prompt_and_output_with_the_tokens_left():
    t = Timings(prompt_ms=10.0, predicted_ms=20.0, prompt_per_second=1.0, predicted_per_second=1.0)
    a = CompletionResult(content="ab", tokens=[7, 8], n_prompt_tokens=3, n_prompt_processed=3, n_cached=0, slot=0,
                         stop_reason="yield", timings=t)
    b = CompletionResult(content="c", tokens=[9], n_prompt_tokens=5, n_prompt_processed=1, n_cached=4, slot=1,
                         stop_reason="length", timings=msgspec.structs.replace(t, engine_ms=7.0))
    rest = continuation(CompletionRequest(prompt="abc", mind="m", n_predict=3), [1, 2, 3], [a])
    assert rest.prompt == [1, 2, 3, 7, 8] and rest.n_predict == 1
    one = merged([a, b])
    assert (one.content, one.tokens, one.n_prompt_tokens, one.n_cached, one.stop_reason, one.slot) == (
        "abc", [7, 8, 9], 3, 0, "length", 1)
    assert one.n_prompt_processed == 4 and one.timings.predicted_ms == 50.0
    assert one.timings.engine_ms == 7.0  # the last part's account holds the parts before it


def test_the_generation_that_wrote_most_gives_way_once_past_the_bound():
    assert to_yield([(1, 10), (2, 30), (3, 20)], 16) == 2
    assert to_yield([(1, 10)], 16) is None and to_yield([(1, 50)], 0) is None
