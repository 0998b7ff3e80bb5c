"""Minds outlive the system (issue 34): a graceful stop writes every mind to her page file,
write-behind writes the unchanged ones in the background, and a new system over the same
page folder resumes each mind with only her new tokens."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

N_MINDS = 6


def _cfg(tiny_model: str, tmp_path, **kw) -> Config:
    # 2 slots, a page RAM that holds about two minds: the rest spill to their files.
    return Config(model=tiny_model, slots=2, ctx=1024, batch=64, page_dir=str(tmp_path), page_ram_bytes=12_000,
                  **kw)


async def _turns(s: ActorSystem, history: dict[str, list[int]], rounds: int = 1) -> None:
    for _ in range(rounds):
        for mind, prompt in history.items():
            r = await s.complete(prompt=prompt, n_predict=4, mind=mind, ignore_eos=True)
            history[mind] = prompt + r.tokens + [5, 6]


async def _resume_each(s: ActorSystem, history: dict[str, list[int]]) -> dict[str, int]:
    """Each mind's next turn: how many prompt tokens it processed."""
    out = {}
    for mind, prompt in history.items():
        r = await s.complete(prompt=prompt, n_predict=2, mind=mind, ignore_eos=True)
        out[mind] = r.n_prompt_processed
    return out


def _history() -> dict[str, list[int]]:
    return {f"m{i}": [1, 10 + i, 20 + i, 30 + i, 40 + i, 50 + i, 60 + i, 70 + i] for i in range(N_MINDS)}


async def test_a_graceful_stop_writes_every_mind_and_a_restart_resumes_each_with_only_its_new_tokens(
        tiny_model, tmp_path):
    history = _history()
    async with ActorSystem(_cfg(tiny_model, tmp_path, write_behind_s=0)) as s:
        await _turns(s, history, rounds=2)
        tiers = {m.tier for m in (await s.memory()).minds}
        assert {"slot", "page", "file"} <= tiers  # minds spread over slots, RAM pages and files
        counts = await s.shutdown(0)
        assert counts["not_persisted"] == 0 and counts["persisted_slots"] == 2 and counts["persisted_pages"] >= 1
    async with ActorSystem(_cfg(tiny_model, tmp_path)) as s:
        files = {m.name for m in (await s.memory()).minds if m.tier == "file"}
        assert files == set(history)  # indexed at start, no file read
        processed = await _resume_each(s, history)
    # The last generated token is not in the cache yet, and [5, 6] are new: 3 tokens each.
    assert processed == {m: 3 for m in history}


async def test_without_a_graceful_stop_minds_written_behind_resume_with_only_their_new_tokens(tiny_model, tmp_path):
    """A kill -9 after the write-behind window: the system is left without its stop's
    persistence, and write-behind passes at chosen instants are all that wrote the minds."""
    history = _history()
    async with ActorSystem(_cfg(tiny_model, tmp_path, write_behind_s=2.0, persist_on_stop=False)) as s:
        await _turns(s, history, rounds=2)
        assert await s.write_behind_tick(100.0) == 0  # first seen now: not yet unchanged for the window
        written = await s.write_behind_tick(102.5)
        assert written >= 3  # the RAM pages and both slots' minds
        assert await s.write_behind_tick(105.0) == 0  # nothing changed since: nothing written again
        assert (await s.page_stats()).unpersisted == 0
        m = s.metrics.snapshot()
        assert m["minds_unpersisted"] == 0 and m["page_unpersisted_age_seconds"] == 0
        assert m["page_write_behind_total"] == written
    async with ActorSystem(_cfg(tiny_model, tmp_path)) as s:
        processed = await _resume_each(s, history)
    assert processed == {m: 3 for m in history}


async def test_write_behind_leaves_the_page_in_ram_and_reports_the_age_of_the_oldest_unwritten_change(
        tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path))) as s:
        await s.complete(prompt=[1, 2, 3, 4], n_predict=2, slot=0, ignore_eos=True)
        await s.page_out(0, "ada")
        await s.write_behind_tick(10.0)
        await s.write_behind_tick(11.5)
        assert s.metrics.snapshot()["page_unpersisted_age_seconds"] == 1.5
        assert await s.write_behind_tick(13.0) == 1
        assert [p.page for p in await s.page_list()] == ["ada"]  # still in RAM: the file is its backup
        assert (await s.page_stats()).unpersisted == 0
        assert s.files.index.files["ada.page"] > 0
        await s.page_in(0, "ada")  # a read never waits on the file, and takes the page from RAM
        assert (await s.page_stats()).pages == 0


async def test_a_stop_logs_a_page_whose_name_no_file_can_carry_and_keeps_the_rest(tiny_model, tmp_path):
    long = "p" * 125  # a valid page name, too long for "<name>.page" and its sidecars
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path))) as s:
        for name in (long, "bob"):
            await s.complete(prompt=[1, 2, 3, len(name)], n_predict=2, slot=0, ignore_eos=True)
            await s.page_out(0, name)
        counts = await s.shutdown(0)
        assert counts["not_persisted"] == 1 and counts["persisted_pages"] == 1
        assert s.metrics.snapshot()["minds_not_persisted_total"] == 1
    assert (tmp_path / "bob.page").exists()


async def test_page_list_and_memory_answer_a_page_of_minds_at_a_time(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path))) as s:
        for i in range(5):
            await s.complete(prompt=[1, 2, 3, 10 + i], n_predict=1, slot=0, ignore_eos=True)
            await s.page_out(0, f"m{i}")
        await s.page_spill("m0", "m0.page", drop=True)
        assert [p.page for p in await s.page_list(limit=2)] == ["m1", "m2"]
        assert [p.page for p in await s.page_list(after="m2", limit=2)] == ["m3", "m4"]
        assert [p.page for p in await s.page_list(after="m4")] == []
        seen, after = [], ""
        while True:
            view = await s.memory(after=after, limit=2)
            seen += [(m.name, m.tier) for m in view.minds]
            if view.next is None:
                break
            after = view.next
        assert seen == [("m0", "file"), ("m1", "page"), ("m2", "page"), ("m3", "page"), ("m4", "page")]


async def test_under_a_disk_budget_the_least_recently_used_minds_files_go_and_a_spill_too_large_is_refused(
        tiny_model, tmp_path):
    from actord.vocabulary.errors import PageDiskExceeded

    history = _history()
    async with ActorSystem(_cfg(tiny_model, tmp_path / "a", page_disk_bytes=20_000, write_behind_s=0)) as s:
        await _turns(s, history, rounds=2)
        m = s.metrics.snapshot()
        assert m["page_disk_evicted_total"] > 0 and 0 < m["page_disk_bytes"] <= 20_000
        assert s.files.index.used == sum(p.stat().st_size for p in (tmp_path / "a").iterdir() if p.is_file()
                                         and not p.name.startswith("."))
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path / "b"),
                                  page_disk_bytes=1000)) as s:
        await s.complete(prompt=[1, 2, 3, 4], n_predict=2, slot=0, ignore_eos=True)
        await s.page_out(0, "ada")
        with pytest.raises(PageDiskExceeded):
            await s.page_spill("ada", "ada.page", drop=True)
        assert [p.page for p in await s.page_list()] == ["ada"]  # nothing moved
        assert s.metrics.snapshot()["page_disk_refused_total"] == 1


async def test_a_crashed_slot_is_logged_and_skipped_and_the_other_minds_are_still_written(tiny_model, tmp_path):
    """Write-behind and a graceful stop ask every slot what it holds: a slot that crashed
    answers ActorFailed, which neither turns into a crash of the stop nor keeps the other
    slot's mind and the RAM pages from their files."""
    history = _history()
    async with ActorSystem(_cfg(tiny_model, tmp_path, write_behind_s=2.0)) as s:
        await _turns(s, history)
        held = {m.name: m.slot for m in (await s.memory()).minds if m.tier == "slot"}
        assert sorted(held.values()) == [0, 1]

        async def boom(msg, env):
            raise RuntimeError("planted")

        s.slots[1].handle = boom  # type: ignore[method-assign]
        await s.write_behind_tick(100.0)
        assert await s.write_behind_tick(102.5) >= 1  # slot 0's mind and the pages, slot 1 skipped
        assert s.slots[1].failed
        counts = await s.shutdown(0)
    assert counts["persisted_slots"] == 0  # slot 0's mind was written behind, unchanged since
    lost = next(m for m, slot in held.items() if slot == 1)
    assert {m for m in history if (tmp_path / f"{m}.page").exists()} == set(history) - {lost}
