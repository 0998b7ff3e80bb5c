"""Save, restore and spill through crash-safe page files, across a restart of the system."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import CorruptPageFile, FileNotFound, PageNotFound, PathRefused
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

PROMPT = [1, 44, 55, 66, 77, 88, 99, 110, 121, 132, 143, 154]


def cfg(model: str, page_dir, **kw) -> Config:
    return Config(model=model, slots=2, ctx=512, batch=64, page_dir=str(page_dir), **kw)


async def _turn(s, slot, prompt, n=8):
    return await s.complete(prompt=prompt, n_predict=n, slot=slot, ignore_eos=True)


async def test_spill_then_restart_then_restore_resumes_with_only_the_suffix(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        first = await _turn(s, 0, PROMPT)
        await s.page_out(0, "mind")
        out = await s.page_spill("mind", "mind.page", drop=True)
        assert out["dropped"] is True and await s.page_list() == []
        assert (await s.page_stats()).charged == 0
    nxt = PROMPT + first.tokens + [3, 4]
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        r = await s.slot_restore(1, "mind.page")
        assert r["n_tokens"] == len(PROMPT) + 7
        resumed = await _turn(s, 1, nxt)
        assert resumed.n_prompt_processed == 3
        fresh = await _turn(s, 0, nxt)
        assert resumed.tokens == fresh.tokens


async def test_save_and_restore_a_slot(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        first = await _turn(s, 0, PROMPT)
        saved = await s.slot_save(0, "sub/a.page")
        assert saved["n_bytes"] > 0 and (tmp_path / "sub" / "a.page").exists()
        await s.slot_erase(0)
        await s.slot_restore(0, "sub/a.page")
        again = await _turn(s, 0, PROMPT + first.tokens)
        assert again.n_prompt_processed == 1


async def test_spill_without_drop_keeps_the_page_and_a_newer_generation_survives_drop(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        await _turn(s, 0, PROMPT)
        await s.page_out(0, "m")
        out = await s.page_spill("m", "m.page")
        assert out["dropped"] is False and [p.page for p in await s.page_list()] == ["m"]
        with pytest.raises(PageNotFound):
            await s.page_spill("nope", "x.page")


async def test_file_names_are_confined_to_the_page_folder(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path / "pages")) as s:
        await _turn(s, 0, PROMPT)
        for bad in ("../escape.page", "/etc/passwd", "a/../../b", ""):
            with pytest.raises(PathRefused):
                await s.slot_save(0, bad)
        (tmp_path / "outside").mkdir()
        (tmp_path / "pages").mkdir(exist_ok=True)
        (tmp_path / "pages" / "link").symlink_to(tmp_path / "outside")
        with pytest.raises(PathRefused):
            await s.slot_save(0, "link/x.page")
        assert list((tmp_path / "outside").iterdir()) == []


async def test_corrupt_or_missing_files_are_typed_and_the_system_serves_on(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        first = await _turn(s, 0, PROMPT)
        await s.slot_save(0, "a.page")
        with pytest.raises(FileNotFound):
            await s.slot_restore(1, "missing.page")
        data = bytearray((tmp_path / "a.page").read_bytes())
        for mutate in (lambda d: d[: len(d) // 2], lambda d: d[:10], lambda d: bytes([d[0] ^ 0xFF]) + d[1:]):
            (tmp_path / "b.page").write_bytes(bytes(mutate(data)))
            with pytest.raises(CorruptPageFile):
                await s.slot_restore(1, "b.page")
        assert (await s.slot_list())[1].n_tokens == 0
        again = await _turn(s, 0, PROMPT + first.tokens)
        assert again.n_prompt_processed == 1


async def test_restoring_a_file_saved_from_another_model_is_refused(tiny_model, tiny_swa_model, tmp_path):
    from actord.vocabulary.errors import ForeignPage

    async with ActorSystem(cfg(tiny_swa_model, tmp_path)) as s:
        await _turn(s, 0, PROMPT)
        await s.slot_save(0, "swa.page")
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        with pytest.raises(ForeignPage):
            await s.slot_restore(0, "swa.page")
        assert (await _turn(s, 0, PROMPT)).n_prompt_processed == len(PROMPT)


async def test_a_restore_holds_its_cells_first_as_a_page_in_does(tiny_model, tmp_path):
    """The file's header says how many cells it needs; they are made free (an idle slot's
    cache goes) and held for the move, so the scheduler never counts more than the cache."""
    from actord.vocabulary.config import Config
    from actord.service.system import ActorSystem

    cfg = Config(model=tiny_model, slots=2, ctx=256, batch=64, page_dir=str(tmp_path))
    async with ActorSystem(cfg) as s:
        first = [1] + [5 + i % 300 for i in range(149)]
        await s.complete(prompt=first, n_predict=2, slot=0, ignore_eos=True)
        held = next(i.n_tokens for i in await s.slot_list() if i.id == 0)
        await s.slot_save(0, "a.page")
        assert await s.files.n_tokens("a.page") == held
        await s.slot_erase(0)
        await s.complete(prompt=[1] + [7 + i % 300 for i in range(179)], n_predict=2, slot=1, ignore_eos=True)
        out = await s.slot_restore(0, "a.page")  # 150 + 182 > 256: slot 1's idle cache makes room
        assert out["n_tokens"] == held
        infos = {i.id: i.n_tokens for i in await s.slot_list()}
        assert infos[0] == held and sum(infos.values()) <= 256
        assert sum(s.scheduler.held(i) for i in (0, 1)) <= 256
