"""Where the engine thread runs and how deep the pipeline is (actord/policy/cpus.py,
actord/policy/pipeline.py): the engine off the loop's CPU by default when its threads fit in
the rest; a named CPU list exactly, if this process may use it; depth 4 on a GPU and 2 on the
CPU unless asked; and a clear, typed error for anything else, at configuration time."""

from __future__ import annotations

import os

import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams
from actord.policy.cpus import choose_engine_cpus, parse_cpu_list


def test_auto_leaves_the_first_cpu_to_the_loop():
    c = choose_engine_cpus("auto", {0, 1, 2, 3}, threads=3)
    assert c.cpus == {1, 2, 3} and "loop" in c.reason
    assert choose_engine_cpus("auto", {4, 9}, threads=1).cpus == {9}  # the first this process may use


def test_auto_pins_nothing_on_one_cpu_or_when_the_threads_need_every_cpu():
    assert choose_engine_cpus("auto", {0}, threads=1).cpus is None
    assert choose_engine_cpus("auto", {0, 1}, threads=2).cpus is None


def test_off_pins_nothing():
    assert choose_engine_cpus("off", {0, 1, 2}, threads=1).cpus is None


def test_a_list_is_taken_as_given_and_a_foreign_cpu_is_refused():
    assert parse_cpu_list("1-3,6") == {1, 2, 3, 6}
    assert choose_engine_cpus("2,3", {0, 1, 2, 3}, threads=8).cpus == {2, 3}
    with pytest.raises(InvalidParams, match="may not use"):
        choose_engine_cpus("1,7", {0, 1, 2}, threads=1)


@pytest.mark.parametrize("bad", ["", "x", "3-1", "-2", "1,,2", "on"])
def test_a_bad_engine_cpus_is_a_typed_error_at_validation(bad):
    with pytest.raises(InvalidParams, match="engine_cpus"):
        Config(model="m.gguf", engine_cpus=bad).validate()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs and Linux affinity")
@pytest.mark.anyio
async def test_the_systems_engine_thread_keeps_off_the_loops_cpu(tiny_model):
    from actord.service.system import ActorSystem

    allowed = os.sched_getaffinity(0)
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=256, threads=1)) as s:
        engine = os.sched_getaffinity(s.engine._thread.native_id)
        assert engine == allowed - {min(allowed)}
        assert os.sched_getaffinity(0) == allowed  # the caller's thread is left as it was
        assert (await s.complete(prompt=[1, 2, 3], n_predict=4, ignore_eos=True)).tokens


def test_pipeline_depth_auto_is_deep_on_a_gpu_and_two_on_the_cpu_and_an_asked_depth_stands():
    from actord.policy.pipeline import pipeline_depth

    assert pipeline_depth(0, "CPU") == 2
    assert pipeline_depth(0, "CUDA") == 4
    assert pipeline_depth(3, "CPU") == 3 and pipeline_depth(1, "CUDA") == 1
    with pytest.raises(InvalidParams, match="pipeline_depth"):
        Config(model="m.gguf", pipeline_depth=9).validate()
