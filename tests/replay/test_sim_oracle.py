"""The simulation's output oracle (replay/sim_oracle.py): where an answer may part from a
fresh prefill's, and where it may not."""

from __future__ import annotations

from actord.replay.sim_oracle import TIE, Answered, parted
from actord.vocabulary.types import CompletionResult, Timings, TokenLogprob, TopLogprob


def ref(tokens: list[int], tops: list[list[tuple[int, float]]] | None) -> CompletionResult:
    lps = None if tops is None else [
        TokenLogprob(token=t, text="", bytes=[], logprob=top[0][1] if top else 0.0,
                     top=[TopLogprob(token=k, text="", bytes=[], logprob=v) for k, v in top])
        for t, top in zip(tokens, tops)]
    return CompletionResult(content="", tokens=tokens, n_prompt_tokens=1, n_prompt_processed=1, n_cached=0, slot=0,
                            stop_reason="length", timings=Timings(0.0, 0.0, 0.0, 0.0), logprobs=lps)


def test_the_same_tokens_agree():
    assert parted((5, 6, 7), ref([5, 6, 7], None)) is None


def test_a_parting_at_a_near_tie_is_the_models_answer_either_way():
    r = ref([5, 6, 7], [[(5, -0.1)], [(6, -0.70), (9, -0.70 - TIE / 2)], [(7, -0.1)]])
    assert parted((5, 9, 1), r) is None  # what follows a near tie is not compared


def test_a_parting_beyond_the_tie_is_named_with_its_margin():
    r = ref([5, 6, 7], [[(5, -0.1)], [(6, -0.5), (9, -0.5 - 3 * TIE)], [(7, -0.1)]])
    why = parted((5, 9, 7), r)
    assert why is not None and why.startswith("token 1: 9 where a fresh prefill gives 6")


def test_a_token_outside_the_references_top_is_a_parting():
    r = ref([5, 6], [[(5, -0.1), (8, -3.0)], [(6, -0.1)]])
    assert "beyond the top" in parted((4, 6), r)


def test_a_parting_where_the_reference_kept_no_log_probabilities_is_a_parting():
    assert "forced" in parted((5, 9), ref([5, 6], None))


def test_an_answer_longer_than_the_references_is_a_parting():
    assert parted((5, 6, 7), ref([5, 6], [[(5, 0.0)], [(6, 0.0)]])) is not None


def test_an_answer_that_parts_is_found_beside_one_that_agrees_with_the_same_question(tiny_model):
    """One ask of the reference per question; each distinct answer to it is checked."""
    import anyio
    from actord.replay.sim_oracle import output_problem
    from actord.vocabulary.config import Config

    cfg = Config(model=tiny_model, slots=2, ctx=256, batch=32, threads=1)

    async def run():
        from actord.service.system import ActorSystem

        async with ActorSystem(cfg) as s:
            right = (await s.complete(prompt=[1, 5, 9, 13], n_predict=4, ignore_eos=True)).tokens
        ok = Answered(prompt=(1, 5, 9, 13), genes=(), n_predict=4, tokens=tuple(right), n_cached=0, how="completion")
        bad = Answered(prompt=(1, 5, 9, 13), genes=(), n_predict=4, tokens=(right[0], right[1], 3, 3), n_cached=2,
                       how="completion")
        assert await output_problem(cfg, [ok, ok]) is None
        return await output_problem(cfg, [ok, bad])

    found = anyio.run(run)
    assert found is not None and "2 cached" in found and "token 2: 3" in found
