"""Minds named by requests are placed by the daemon: page out, spill, page in, restore."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio


async def test_more_minds_than_slots_resume_with_only_their_suffix(tiny_model, tmp_path):
    cfg = Config(model=tiny_model, slots=2, ctx=1024, batch=64, page_dir=str(tmp_path), page_ram_bytes=12_000)
    history = {f"m{i}": [1, 10 + i, 20 + i, 30 + i, 40 + i, 50 + i, 60 + i, 70 + i] for i in range(4)}
    seen: list[tuple[list[int], list[int]]] = []
    async with ActorSystem(cfg) as s:
        for rnd in range(3):
            for mind, prompt in history.items():
                r = await s.complete(prompt=prompt, n_predict=6, mind=mind, ignore_eos=True)
                if rnd > 0:  # displaced since its last turn, yet only the new suffix is decoded
                    assert r.n_prompt_processed == 3, (mind, rnd, r)
                seen.append((list(prompt), r.tokens))
                history[mind] = prompt + r.tokens + [5, 6]
        m = s.metrics.snapshot()
        assert m["page_out_total"] > 0 and m["page_in_total"] > 0 and m["page_spill_total"] > 0
        assert {i.mind for i in await s.slot_list()} <= set(history)
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=1024, batch=64)) as ref:
        for prompt, tokens in seen:  # a slot that never moved gives the same tokens
            assert (await ref.complete(prompt=prompt, n_predict=6, slot=0, ignore_eos=True)).tokens == tokens
            await ref.slot_erase(0)


async def test_a_mind_file_with_no_header_yet_is_restored_only_once_its_cells_are_held(tiny_model, tmp_path):
    """A file the placer could not size (a publication cut short: the restore's own read
    completes it) is refused by the slot before anything moves, then sized again and
    restored with its cells held; the mind still resumes with only her new tokens."""
    from actord.serving.messages import RestoreSlot

    cfg = Config(model=tiny_model, slots=2, ctx=1024, batch=64, page_dir=str(tmp_path))
    prompt = [1, 10, 20, 30, 40, 50, 60, 70]
    async with ActorSystem(cfg) as s:
        r = await s.complete(prompt=prompt, n_predict=6, mind="ada", ignore_eos=True)
        assert (await s.shutdown(0))["not_persisted"] == 0
    nxt = prompt + r.tokens + [5, 6]
    async with ActorSystem(cfg) as s:
        sizes, asked = [], []
        n_tokens, ask = s.files.n_tokens, s.slots[0].ask

        async def unsized_once(name):
            n = await n_tokens(name)
            sizes.append(n)
            return None if len(sizes) == 1 else n

        async def noting(msg, *a, **kw):
            if isinstance(msg, RestoreSlot):
                asked.append(msg.room_cells)
            return await ask(msg, *a, **kw)

        s.placer.files.n_tokens = unsized_once
        s.slots[0].ask = noting
        out = await s.complete(prompt=nxt, n_predict=2, mind="ada", ignore_eos=True)
        assert asked == [0, sizes[1]] and sizes[1] == len(prompt) + 5
        assert out.n_prompt_processed == 3


async def test_a_mind_file_larger_than_the_whole_cache_is_refused_and_kept(tiny_model, tmp_path):
    from actord.vocabulary.errors import PageDoesNotFit

    prompt = [1] + [5 + i for i in range(400)]
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=1024, batch=64, page_dir=str(tmp_path))) as s:
        await s.complete(prompt=prompt, n_predict=2, mind="big", ignore_eos=True)
        assert (await s.shutdown(0))["not_persisted"] == 0
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=128, batch=64, page_dir=str(tmp_path))) as s:
        with pytest.raises(PageDoesNotFit) as e:
            await s.complete(prompt=prompt[:4], n_predict=2, mind="big", ignore_eos=True)
        assert e.value.data["n_tokens"] > e.value.data["n_cells"]  # ctx 128 is raised to 256, still short
        assert (await s.slot_list())[0].n_tokens == 0
    assert (tmp_path / "big.page").exists()
