"""Page files share bases (issue 34, part 3): pages on a shared prefix spill as their own part
plus a reference to one content-addressed base file, which goes with its last referrer, and
a crash in the middle of its removal leaves neither a dangling reference nor an orphan after
the next start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem
from actord.storage import bases as B
from actord.storage.osfs import Fault, FaultyFs, SimulatedCrash

pytestmark = pytest.mark.anyio

PREFIX = [1] + [3 + (i * 37) % 500 for i in range(299)]
OWN = 128  # each mind's own tokens after the shared prefix: 70% of 428


def own(k: int) -> list[int]:
    return [5 + (k * 131 + i * 17) % 490 for i in range(OWN)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def cfg(model: str, folder: Path, **kw) -> Config:
    return Config(model=model, slots=3, ctx=2048, batch=256, threads=1, page_dir=str(folder), write_behind_s=0,
                  **kw)


async def paged_minds(s: ActorSystem, n: int) -> dict[str, list[int]]:
    """n minds on one prefix, each paged out after its turn (a base in RAM from the second)."""
    history = {}
    for k in range(n):
        prompt = PREFIX + own(k)
        r = await s.complete(prompt=prompt, n_predict=2, slot=k % 2, ignore_eos=True)
        history[f"m{k}"] = prompt + r.tokens + [5, 6]
        await s.page_out(k % 2, f"m{k}")
    return history


def base_files(folder: Path) -> list[Path]:
    return sorted((folder / B.BASE_DIR).glob("*" + B.BASE_SUFFIX)) if (folder / B.BASE_DIR).exists() else []


def mind_bytes(folder: Path, mind: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(f"{mind}.page*"))


async def test_minds_on_a_shared_prefix_keep_it_once_on_disk_and_resume_from_their_files(tiny_model, tmp_path):
    shared, whole = tmp_path / "shared", tmp_path / "whole"
    for folder, on in ((shared, True), (whole, False)):
        async with ActorSystem(cfg(tiny_model, folder, page_file_bases=on)) as s:
            history = await paged_minds(s, 3)
            for m in ("m1", "m2"):  # on the base (m0's page was whole when it was made)
                await s.page_spill(m, f"{m}.page", drop=True)
    assert len(base_files(shared)) == 1 and base_files(whole) == []
    ratio = mind_bytes(shared, "m2") / mind_bytes(whole, "m2")
    assert ratio < 0.8, ratio  # its own part (128 of 428 tokens) and a reference
    async with ActorSystem(cfg(tiny_model, shared, page_file_bases=True)) as s:
        for m in ("m1", "m2"):
            r = await s.complete(prompt=history[m], n_predict=1, mind=m, ignore_eos=True)
            assert r.n_prompt_processed == 3, (m, r)


async def test_a_base_file_goes_with_its_last_referrer(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, page_file_bases=True)) as s:
        await paged_minds(s, 3)
        for m in ("m1", "m2"):
            await s.page_spill(m, f"{m}.page", drop=True)
        await s.files.sweep()  # the references are known (a start runs it)
        await s.files.remove("m1.page")
        assert len(base_files(tmp_path)) == 1  # m2 still names it
        await s.files.remove("m2.page")
        assert base_files(tmp_path) == []
        assert not [n for n in s.files.index.files if B.is_base(n)]


@pytest.mark.parametrize("nth", [1, 2], ids=["in_the_referrers_removal", "in_the_bases_removal"])
async def test_a_crash_in_the_middle_of_a_base_removal_leaves_no_dangling_reference_nor_orphan(
        tiny_model, tmp_path, nth):
    async with ActorSystem(cfg(tiny_model, tmp_path, page_file_bases=True)) as s:
        await paged_minds(s, 3)
        for m in ("m1", "m2"):
            await s.page_spill(m, f"{m}.page", drop=True)
        await s.files.sweep()
        await s.files.remove("m1.page")
        assert len(base_files(tmp_path)) == 1
        # The last referrer's removal is durable; the process dies in its base's removal.
        s.files.fs = FaultyFs([Fault("step", nth, action="crash", match="removal_placed")])
        with pytest.raises(SimulatedCrash):
            await s.files.remove("m2.page")
        s.files.fs = FaultyFs(dead_pids=[os.getpid()])
    async with ActorSystem(cfg(tiny_model, tmp_path, page_file_bases=True)) as s:
        await s.files.sweep()
        assert base_files(tmp_path) == [] and not (tmp_path / "m2.page").exists()
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".actord-commit")]
    # A crash between a referrer's removal and its base's (the base never touched): the
    # start's sweep removes the orphan.
    async with ActorSystem(cfg(tiny_model, tmp_path / "b", page_file_bases=True)) as s:
        await paged_minds(s, 2)
        await s.page_spill("m1", "m1.page", drop=True)
    (tmp_path / "b" / "m1.page").unlink()
    async with ActorSystem(cfg(tiny_model, tmp_path / "b", page_file_bases=True)) as s:
        await s.files.sweep()  # as the start's own, in the background
        assert base_files(tmp_path / "b") == []


async def test_a_new_mind_starts_from_a_base_file_when_no_slot_nor_page_holds_the_prefix(tiny_model, tmp_path):
    """Issue 32: a base in a page file is a start too, under the whole identity. Its greedy
    output is a fresh prefill's, token for token, and `n_cached` counts the base."""
    folder = tmp_path / "pages"
    new = PREFIX + own(7)
    async with ActorSystem(cfg(tiny_model, tmp_path / "fresh")) as s:
        fresh = await s.complete(prompt=new, n_predict=8, mind="newbie", ignore_eos=True, temperature=0.0)
    assert fresh.n_cached == 0

    async with ActorSystem(cfg(tiny_model, folder, page_file_bases=True)) as s:
        await paged_minds(s, 3)
        for m in ("m0", "m1", "m2"):
            await s.page_spill(m, f"{m}.page", drop=True)
        assert len(base_files(folder)) == 1
        assert (await s.page_stats()).bases == 0  # its last page went: no base in RAM
        assert all(i.n_tokens == 0 for i in await s.slot_list())  # nor a slot's cells
        r = await s.complete(prompt=new, n_predict=8, mind="newbie", ignore_eos=True, temperature=0.0)
        assert r.n_cached == len(PREFIX) and r.tokens == fresh.tokens
        assert f'prefix_hit_tokens_total{{source="file_base"}} {float(len(PREFIX))}' in s.metrics_text()
        salted = await s.complete(prompt=new, n_predict=1, mind="other", ignore_eos=True, cache_salt="mine")
        assert salted.n_cached == 0  # another scope: not hers to start from

    # After a restart the base files are known from their headers (the start's sweep).
    async with ActorSystem(cfg(tiny_model, folder, page_file_bases=True)) as s:
        await s.files.sweep()
        r = await s.complete(prompt=new, n_predict=8, mind="second", ignore_eos=True, temperature=0.0)
        assert r.n_cached == len(PREFIX) and r.tokens == fresh.tokens
