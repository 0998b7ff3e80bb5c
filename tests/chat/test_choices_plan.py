"""The pure parts of n choices (actord/chat/choices.py): which choice runs where, the seeds,
the usage arithmetic, the bound on n, and the HTTP merge of n results into one answer."""

from __future__ import annotations

import pytest

from actord.vocabulary.types import CompletionResult, Timings
from actord.chat.choices import check_n, choice_seed, merge_usage, plan, with_index
from actord.vocabulary.errors import InvalidParams
from tests.waits import eventually


def result(n_out: int, slot: int = 0, n_prompt: int = 40, cached: int = 0, stop: str = "length") -> CompletionResult:
    return CompletionResult(content="x" * n_out, tokens=list(range(n_out)), n_prompt_tokens=n_prompt,
                            n_prompt_processed=1, n_cached=cached, slot=slot, stop_reason=stop,
                            timings=Timings(prompt_ms=0, predicted_ms=0, prompt_per_second=0, predicted_per_second=0))


def test_each_choice_gets_a_fork_then_the_rest_queue_round_robin_with_choice_0_last():
    assert plan(1, 2, []) == {2: [0]}
    assert plan(3, 0, [1, 2]) == {0: [0], 1: [1], 2: [2]}
    assert plan(3, 1, []) == {1: [1, 2, 0]}
    assert plan(5, 0, [3]) == {0: [2, 4, 0], 3: [1, 3]}
    every = plan(8, 0, [1, 2])
    assert sorted(i for ids in every.values() for i in ids) == list(range(8)) and every[0][-1] == 0


def test_choice_i_samples_with_seed_plus_i_modulo_2_32():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(0xFFFFFFFF, 1) == 0 and choice_seed(-1, 1) == 0


def test_usage_counts_the_prompt_once_and_sums_the_completions():
    u = merge_usage([result(5, cached=39), result(7), result(0)])
    assert u == {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52, "cached_tokens": 39}


@pytest.mark.parametrize("n", [0, -1, 9, True, 2.5, "3", None])
def test_n_outside_one_to_the_bound_is_a_400_naming_n(n):
    with pytest.raises(InvalidParams) as e:
        check_n(n, 8)
    assert e.value.data["param"] == "n" and e.value.http_status == 400


def test_a_choices_chunks_carry_its_index():
    got: list[dict] = []
    sink = with_index(got.append, 2)
    sink({"content": "a"})
    assert got == [{"content": "a", "index": 2}] and with_index(None, 1) is None


# -- the fan-out against a stand-in system: one final answer, whatever a choice does --------------


class _System:
    """What complete_choices uses of its ChatHost (actord/service/protocol.py); choice i
    (seed 7 + i) fails when i is `fail`, else ends at once (`hang`: waits until cancelled)."""

    def __init__(self, fail: int = -1, hang: bool = False) -> None:
        from types import SimpleNamespace

        from actord.vocabulary.types import RequestLimits
        from actord.vocabulary.config import Config

        self._limits, self.config = RequestLimits(), Config(model="m", max_n=8, seed=0)
        self.props = SimpleNamespace(kv_cells=1024, spec_rollback="")
        self.fail, self.hang = fail, hang
        self.placed: dict[int, int | None] = {}
        self.cancelled: list[int] = []

    def check_open(self) -> None:
        pass

    def request_limits(self):
        return self._limits

    def model_props(self):
        return self.props

    async def fork_prefix(self, source, prefix, want):  # 4 idle slots: the source's prefix forked into the others
        assert source == 0 and len(prefix) == 3
        return [1, 2, 3][:want]

    async def complete(self, req, on_token=None, _input=True, _cached=True):
        import anyio

        if req.n_predict == 0:  # the prefill: the prompt but its last token, on slot 0
            assert req.prompt == [1, 2, 3] and not req.stream
            return result(0, slot=0, n_prompt=3)
        i = req.seed - 7
        self.placed[i] = req.slot
        try:
            await anyio.lowlevel.checkpoint()  # the choices run side by side, as on real slots
            if i == self.fail:
                from actord.vocabulary.errors import ContextFull

                raise ContextFull("no cells for this choice")
            if self.hang:
                await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(i)
            raise
        if on_token is not None:
            on_token({"content": f"c{i}"})
        return result(i + 1, slot=req.slot, n_prompt=4, cached=3)


def _req(**kw):
    from actord.vocabulary.types import CompletionRequest

    return CompletionRequest(prompt=[1, 2, 3, 4], n_predict=5, seed=7, temperature=1.0, **kw)


@pytest.mark.anyio
async def test_the_fan_out_answers_by_index_with_the_prefill_on_choice_0():
    from actord.chat.choices import complete_choices

    s, seen = _System(), []
    rs = await complete_choices(s, _req(stream=True), 3, seen.append)
    assert [len(r.tokens) for r in rs] == [1, 2, 3] and s.placed == {0: 0, 1: 1, 2: 2}
    assert sorted((c["index"], c["content"]) for c in seen) == [(0, "c0"), (1, "c1"), (2, "c2")]
    assert rs[0].n_cached == 0 and rs[0].n_prompt_processed == 1 + 1  # the prefill's and its own
    assert rs[1].n_cached == 3 and merge_usage(rs)["completion_tokens"] == 6


@pytest.mark.anyio
async def test_one_failing_choice_fails_the_request_once_and_cancels_the_others():
    from actord.chat.choices import complete_choices
    from actord.vocabulary.errors import ContextFull

    s = _System(fail=1, hang=True)
    with pytest.raises(ContextFull):
        await complete_choices(s, _req(), 3)
    assert sorted(s.cancelled) == [0, 2]


@pytest.mark.anyio
async def test_a_cancelled_caller_cancels_every_choice():
    import anyio

    from actord.chat.choices import complete_choices

    s = _System(hang=True)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def caller() -> None:
                await complete_choices(s, _req(), 4)

            tg.start_soon(caller)
            await eventually(lambda: len(s.placed) == 4, "all four choices placed")
            scope.cancel()
    assert sorted(s.cancelled) == [0, 1, 2, 3]
