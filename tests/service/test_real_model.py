"""The real Gemma 3 270M (Q4_K_M, SWA 512) from the registry package: pages and checkpoints.

Greedy comparisons pair runs with the same batch shapes (a quantized model's logits depend
on the ubatch split, and a unified KV cache's on where cells sit), and use natural text,
where argmax margins are wide.
"""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = [pytest.mark.anyio, pytest.mark.real_model, pytest.mark.slow]

TEXT = (
    "The harbour town of Veln sits between two cliffs. Its lighthouse has burned for three hundred years, "
    "tended by one family at a time. Fishing boats leave at dawn and return at dusk, and the market square "
    "fills with the smell of salt, bread and tar. "
)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # one backend is enough for the slow real model


def cfg(model, tmp_path, **kw):
    base = dict(model=model, slots=2, ctx=4096, batch=256, threads=1, page_dir=str(tmp_path),
                checkpoint_every=256, ctx_checkpoints=4)
    base.update(kw)
    return Config(**base)


async def test_paged_mind_resumes_with_the_suffix_and_matches_a_slot_that_never_paged(real_model, tmp_path):
    prompt = "Q: Describe the town.\n" + TEXT * 3 + "\nA:"
    async with ActorSystem(cfg(real_model, tmp_path)) as s:
        first = await s.complete(prompt=prompt, n_predict=12, slot=0)
        nxt = prompt + first.content + "\nQ: And the lighthouse?\nA:"
        stay = await s.complete(prompt=nxt, n_predict=12, slot=0)  # never paged
        await s.slot_erase(0)
        await s.complete(prompt=prompt, n_predict=12, slot=0)
        await s.page_out(0, "veln")
        await s.page_in(1, "veln")
        moved = await s.complete(prompt=nxt, n_predict=12, slot=1)
        assert moved.n_prompt_processed == stay.n_prompt_processed < 30
        assert moved.tokens == stay.tokens
        await s.page_out(1, "veln")
        await s.page_spill("veln", "veln.page", drop=True)
    async with ActorSystem(cfg(real_model, tmp_path)) as s:  # a restart, then the file
        await s.slot_restore(0, "veln.page")
        again = await s.complete(prompt=nxt + moved.content + " Yes.", n_predict=4, slot=0)
        assert again.n_prompt_processed < 10


async def test_gemma_resumes_from_a_checkpoint_when_the_window_has_moved_on(real_model, tmp_path):
    # ~1900 tokens: past the window and the SWA cache's cells (3 x 512 + a ubatch: two slots
    # and the engine's scratch sequence), so the cache no longer holds what attention from
    # position ~500 would need.
    long = TEXT * 35
    async with ActorSystem(cfg(real_model, tmp_path, swa_full="off")) as s:
        await s.complete(prompt=long, n_predict=2, slot=0)
        cut = len(long) * 3 // 10
        diverged = long[:cut] + " Then the ferry stopped running. " + long[cut:cut + 200]
        r = await s.complete(prompt=diverged, n_predict=6, slot=0)
        assert r.resumed_from_checkpoint and 0 < r.n_cached <= r.n_prompt_tokens
        assert r.n_prompt_processed < r.n_prompt_tokens - 200


async def test_the_same_request_twice_answers_the_same_on_quantized_kernels(real_model, tmp_path):
    """A one-token batch rounds differently from the prompt's batch on this model's CPU kernels
    (Q4_K, flash attention): decoding the prompt's last token alone again took the second
    answer elsewhere within 128 tokens. The slot keeps that cell and the engine its logits."""
    async with ActorSystem(cfg(real_model, tmp_path, threads=2)) as s:
        prompt = "I believe the meaning of life is"
        first = await s.complete(prompt=prompt, n_predict=128, slot=0)
        again = await s.complete(prompt=prompt, n_predict=128, slot=0)
        assert again.n_prompt_processed == 1
        assert again.tokens == first.tokens
