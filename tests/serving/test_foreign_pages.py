"""A page file knows its model by a digest of its weights: another model's file is refused
with ForeignPage and nothing else changes, even when every shape matches."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import ForeignPage
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

PROMPT = [1] + [3 + (i * 37) % 500 for i in range(200)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def twin(models_dir) -> str:
    """A second tiny Qwen3.5 of another seed: same architecture, shapes and vocab."""
    from actord.testing.models import write_tiny_qwen35

    return str(write_tiny_qwen35(models_dir / "tiny-qwen35-twin.gguf", seed=4, mtp=False))


def cfg(model: str, tmp_path, **kw) -> Config:
    return Config(model=model, slots=2, ctx=1024, batch=64, page_dir=str(tmp_path), threads=1, **kw)


async def test_a_file_from_a_same_shaped_model_is_refused_and_nothing_else_is_lost(tiny_hybrid_model, twin, tmp_path):
    async with ActorSystem(cfg(tiny_hybrid_model, tmp_path)) as s:
        await s.complete(prompt=PROMPT, n_predict=4, slot=0, ignore_eos=True)
        await s.slot_save(0, "a.page")
        digest = s.props.weights_digest
        await s.page_out(0, "ada")
        await s.page_spill("ada", "ada.page", drop=True)
    async with ActorSystem(cfg(twin, tmp_path)) as s:
        p = s.props
        assert p.desc and p.weights_digest != digest  # same description, other weights
        mine = await s.complete(prompt=PROMPT, n_predict=4, slot=1, ignore_eos=True)
        other = await s.complete(prompt=PROMPT[:50], n_predict=4, slot=0, ignore_eos=True)
        before = await s.slot_list()
        with pytest.raises(ForeignPage) as e:
            await s.slot_restore(1, "a.page")
        assert e.value.data["differs"] == ["weights"]
        after = await s.slot_list()
        assert [(i.n_tokens, i.n_checkpoints) for i in after] == [(i.n_tokens, i.n_checkpoints) for i in before]
        again = await s.complete(prompt=PROMPT + mine.tokens, n_predict=4, slot=1, ignore_eos=True)
        assert again.n_prompt_processed == 1  # slot 1 kept its own sequence
        assert (await s.complete(prompt=PROMPT[:50], n_predict=4, slot=0, ignore_eos=True)).tokens == other.tokens
        # A mind whose file is foreign: its request is refused with the same type. (The placer
        # frees a slot for the mind before it reads the file, as it does for any mind.)
        with pytest.raises(ForeignPage):
            await s.complete(prompt=PROMPT + [9], n_predict=4, mind="ada", ignore_eos=True)
        assert (await s.files.exists("a.page")) and (await s.files.exists("ada.page"))  # the files stay


async def test_the_own_models_file_still_restores(tiny_hybrid_model, tmp_path):
    async with ActorSystem(cfg(tiny_hybrid_model, tmp_path)) as s:
        first = await s.complete(prompt=PROMPT, n_predict=4, slot=0, ignore_eos=True)
        await s.slot_save(0, "a.page")
    async with ActorSystem(cfg(tiny_hybrid_model, tmp_path)) as s:
        await s.slot_restore(1, "a.page")
        r = await s.complete(prompt=PROMPT + first.tokens, n_predict=4, slot=1, ignore_eos=True)
        assert r.n_prompt_processed == 1


def test_a_file_without_a_weights_digest_cannot_prove_its_model():
    from actord.serving.slot_pages import check_fingerprint, model_fingerprint
    from actord.engine.jobs import ModelProps
    from actord.storage.pagefile import PageImage

    props = ModelProps(n_ctx=512, n_batch=64, n_seq_max=2, n_vocab=512, n_ctx_train=4096, n_swa=0, recurrent=False,
                       hybrid=True, needs_checkpoints=True, bos=1, eos=2, desc="qwen35 ?B all F32",
                       weights_digest="ab" * 16)
    old = {k: v for k, v in model_fingerprint(props).items() if k != "weights"}
    with pytest.raises(ForeignPage):
        check_fingerprint(PageImage(tokens=[1], state=b"", meta=old), props, "old.page")
    check_fingerprint(PageImage(tokens=[1], state=b"", meta=model_fingerprint(props)), props, "new.page")
