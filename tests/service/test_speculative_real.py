"""A real draft for a real model: Gemma 3 270M (Q4_K_M) drafted by a layer-pruned copy of
itself (actord.testing.draft_models.write_pruned_draft), on natural text.

Greedy equality is checked at spec_n_max=2: a verify batch of at most 3 rows runs the same
ggml kernels as a single-token decode. From 4 rows on, the quantized matmuls take another
path whose logits differ by up to ~1.0 (measured on this model), as they do for 4 slots
decoding together without speculation (see docs/limits.md).
"""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = [pytest.mark.anyio, pytest.mark.real_model, pytest.mark.slow]

TEXT = (
    "The history of the Roman Empire spans more than a thousand years. It began when Augustus became the "
    "first emperor in 27 BC, and"
)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def pruned_draft(real_model, tmp_path_factory) -> str:
    from actord.testing.draft_models import write_pruned_draft

    # Gemma 3 270M's first blocks alone never agree with it (its first 4: 0 of 279 drafted
    # tokens accepted; its first 12 write "gradually gradually ..."), its first 10 + last 2
    # a few percent; its first 14 + last 2 about half of the drafted tokens at k=2.
    return str(write_pruned_draft(real_model, tmp_path_factory.mktemp("drafts") / "gemma-14+2.gguf", 14, 2))


def cfg(model, **kw):
    return Config(model=model, slots=1, ctx=1024, batch=256, threads=1, **kw)


async def test_a_pruned_gemma_drafts_for_gemma_with_identical_greedy_output(real_model, pruned_draft):
    async with ActorSystem(cfg(real_model)) as s:
        plain = await s.complete(prompt=TEXT, n_predict=32, slot=0, ignore_eos=True)
    async with ActorSystem(cfg(real_model, spec_draft_model=pruned_draft, spec_n_max=2)) as s:
        props = await s.props_dict()
        spec = await s.complete(prompt=TEXT, n_predict=32, slot=0, ignore_eos=True)
        steps = s.metrics.snapshot()["engine_steps_total"]
    assert spec.tokens == plain.tokens
    assert spec.timings.draft_n > 0 and spec.timings.draft_n_accepted > 0  # above zero on real text
    assert steps < 32 + 1  # fewer target forwards than tokens
    assert (props["spec"], props["spec_n_max"], props["draft_n_vocab"]) == ("draft", 2, props["n_vocab"])
