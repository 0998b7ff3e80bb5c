"""A page folder that refuses writes (full, read-only, EIO) never costs a mind its state.

Through the OS adapter's fault seam (`storage.osfs.FaultyFs`): a spill with drop whose write,
fsync, rename or directory sync fails keeps the RAM page; the placer's automatic spills and a
slot's eviction (KV pressure) keep every mind where it was and refuse the work with the
disk's typed error instead of dropping the state. (tests/frontends/test_failing_disk_daemon.py
does the same on a real full or read-only tmpfs.)
"""

from __future__ import annotations

import errno

import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import ContextFull, StorageError
from actord.storage.osfs import Fault, FaultyFs
from actord.service.system import ActorSystem
from tests.waits import eventually

pytestmark = pytest.mark.anyio

DISK_FAULTS = [
    pytest.param(Fault("write", errno=errno.ENOSPC, times=0), id="write-ENOSPC"),
    pytest.param(Fault("write", errno=errno.EROFS, times=0), id="write-EROFS"),
    pytest.param(Fault("fsync", errno=errno.EIO, times=0), id="fsync-EIO"),
    pytest.param(Fault("rename", errno=errno.EIO, times=0), id="rename-EIO"),
    pytest.param(Fault("dirsync", errno=errno.EIO, times=0), id="dirsync-EIO"),
]


def _prompt(seed: int, n: int) -> list[int]:
    return [1] + [5 + (seed * 31 + i * 7) % 400 for i in range(n - 1)]


@pytest.mark.parametrize("fault", DISK_FAULTS)
async def test_a_spill_with_drop_into_a_failing_page_folder_keeps_the_ram_page(tiny_model, tmp_path, fault):
    cfg = Config(model=tiny_model, slots=1, ctx=1024, batch=64, page_dir=str(tmp_path))
    async with ActorSystem(cfg) as s:
        await s.complete(prompt=_prompt(1, 40), n_predict=4, slot=0, ignore_eos=True)
        await s.page_out(0, "ada")
        before = {p.page: (p.n_tokens, p.n_bytes) for p in await s.page_list()}
        s.files.fs = FaultyFs([fault])
        with pytest.raises(StorageError):
            await s.page_spill("ada", "ada.page", drop=True)
        assert {p.page: (p.n_tokens, p.n_bytes) for p in await s.page_list()} == before
        assert (await s.page_stats()).charged == before["ada"][1]
        # The page is whole: it pages in and resumes with only the new suffix.
        await s.page_in(0, "ada")
        r = await s.complete(prompt=_prompt(1, 40) + [7, 8], n_predict=2, slot=0, ignore_eos=True)
        assert r.n_cached >= 40
        # Once the disk writes again, the same spill drops the page after the file is durable.
        await s.page_out(0, "ada")
        s.files.fs = FaultyFs()
        assert (await s.page_spill("ada", "ada.page", drop=True))["dropped"] is True
        assert await s.page_list() == []
        assert s.metrics.snapshot()["page_failed_total"] >= 1


@pytest.mark.parametrize("fault", DISK_FAULTS[:3])
async def test_a_mind_with_no_page_ram_and_a_failing_disk_keeps_its_state_and_the_other_is_refused_typed(
        tiny_model, tmp_path, fault):
    # No page RAM at all: a displaced mind can only go to its page file.
    cfg = Config(model=tiny_model, slots=1, ctx=1024, batch=64, page_dir=str(tmp_path), page_ram_bytes=0)
    async with ActorSystem(cfg) as s:
        ra = await s.complete(prompt=_prompt(2, 60), n_predict=4, mind="ada", ignore_eos=True)
        held = (await s.slot_list())[0]
        s.files.fs = FaultyFs([fault])
        with pytest.raises(StorageError):
            await s.complete(prompt=_prompt(3, 20), n_predict=4, mind="bo", ignore_eos=True)
        info = (await s.slot_list())[0]
        assert (info.mind, info.n_tokens) == ("ada", held.n_tokens)
        r = await s.complete(prompt=_prompt(2, 60) + ra.tokens + [9], n_predict=2, mind="ada", ignore_eos=True)
        assert r.n_cached >= 60  # nothing of ada was lost
        # The disk is back: bo is placed, ada goes to her file and comes back from it whole.
        s.files.fs = FaultyFs()
        await s.complete(prompt=_prompt(3, 20), n_predict=4, mind="bo", ignore_eos=True)
        r = await s.complete(prompt=_prompt(2, 60) + ra.tokens + [9, 10], n_predict=2, mind="ada", ignore_eos=True)
        assert r.n_cached >= 60


async def test_the_placers_spill_of_an_older_mind_that_fails_keeps_every_mind(tiny_model, tmp_path):
    """Three minds over one slot, page RAM for one page, a read-only page folder: the third
    mind is refused (typed), the first keeps its page in RAM, the second its slot."""
    cfg = Config(model=tiny_model, slots=1, ctx=1024, batch=64, page_dir=str(tmp_path), page_ram_bytes=30_000)
    async with ActorSystem(cfg) as s:
        a = await s.complete(prompt=_prompt(4, 100), n_predict=4, mind="ada", ignore_eos=True)
        await s.complete(prompt=_prompt(5, 30), n_predict=4, mind="bo", ignore_eos=True)  # ada -> her page
        pages = [(p.page, p.n_tokens) for p in await s.page_list()]
        assert [p for p, _ in pages] == ["ada"]
        s.files.fs = FaultyFs([Fault("write", errno=errno.EROFS, times=0)])
        with pytest.raises(StorageError) as e:
            await s.complete(prompt=_prompt(6, 10), n_predict=4, mind="cy", ignore_eos=True)
        assert e.value.data.get("errno") == errno.EROFS
        assert [(p.page, p.n_tokens) for p in await s.page_list()] == pages
        assert (await s.slot_list())[0].mind == "bo"
        s.files.fs = FaultyFs()
        r = await s.complete(prompt=_prompt(4, 100) + a.tokens + [3], n_predict=2, mind="ada", ignore_eos=True)
        assert r.n_cached >= 100


async def test_kv_pressure_does_not_evict_a_mind_that_has_nowhere_durable_to_go(tiny_model, tmp_path):
    """The scheduler needs a mind's cells for another slot; the mind's page RAM is full and
    its file cannot be written: the eviction is refused, the mind keeps every token, and the
    request that wanted the cells gives way (ContextFull) instead."""
    cfg = Config(model=tiny_model, slots=2, ctx=256, batch=64, page_dir=str(tmp_path), page_ram_bytes=0)
    async with ActorSystem(cfg) as s:
        await s.complete(prompt=_prompt(7, 150), n_predict=2, mind="ada", ignore_eos=True)
        ada_slot = next(i for i in await s.slot_list() if i.mind == "ada")
        s.files.fs = FaultyFs([Fault("fsync", errno=errno.EIO, times=0)])
        other = 1 - ada_slot.id
        with pytest.raises(ContextFull):
            await s.complete(prompt=_prompt(8, 150), n_predict=2, slot=other, ignore_eos=True)
        kept = (await s.slot_list())[ada_slot.id]
        assert (kept.mind, kept.n_tokens) == ("ada", ada_slot.n_tokens)
        m = s.metrics.snapshot()
        assert m.get("slot_evictions_refused_total{reason=kv}", 0) >= 1
        assert not any(k.startswith("slot_evictions_total") and "how=dropped" in k and v for k, v in m.items())
        # With the disk back, the same request gets its cells: ada goes to her file first.
        s.files.fs = FaultyFs()
        await s.complete(prompt=_prompt(8, 150), n_predict=2, slot=other, ignore_eos=True)
        r = await s.complete(prompt=_prompt(7, 150) + [4], n_predict=2, mind="ada", ignore_eos=True)
        assert r.n_cached >= 150


async def test_device_pressure_does_not_evict_a_mind_that_has_nowhere_durable_to_go(tiny_model, tmp_path, models_dir):
    """A gene load needs device room that only an idle mind's slot can give; its state has no
    durable place to go: the slot refuses once, is not asked again and again, and the load is
    refused (DeviceBudgetExceeded) with the mind whole."""
    from actord.vocabulary.errors import DeviceBudgetExceeded
    from actord.testing.models import write_tiny_lora

    lora = str(write_tiny_lora(models_dir / "disk-lora.gguf", tiny_model, seed=41))
    cfg = Config(model=tiny_model, slots=2, ctx=1024, batch=64, page_dir=str(tmp_path), page_ram_bytes=0,
                 device_bytes=50_000)
    async with ActorSystem(cfg) as s:
        await s.complete(prompt=_prompt(9, 100), n_predict=2, mind="ada", ignore_eos=True)
        held = next(i for i in await s.slot_list() if i.mind == "ada")
        s.files.fs = FaultyFs([Fault("write", errno=errno.ENOSPC, times=0)])
        with pytest.raises(DeviceBudgetExceeded):
            await s.gene_load(lora)
        kept = (await s.slot_list())[held.id]
        assert (kept.mind, kept.n_tokens) == ("ada", held.n_tokens)
        assert s.metrics.snapshot().get("slot_evictions_refused_total{reason=device}", 0) == 1
        s.files.fs = FaultyFs()
        assert (await s.gene_load(lora)).resident  # the disk is back: ada goes to her file
        r = await s.complete(prompt=_prompt(9, 100) + [4], n_predict=2, mind="ada", ignore_eos=True)
        assert r.n_cached >= 100


async def test_a_slot_that_refuses_its_eviction_does_not_leave_the_device_over_budget(tiny_model, tmp_path):
    """Over the device budget once two turns end: the coldest idle slot holds a mind whose
    state has nowhere to go (page RAM too small, the disk refusing writes), so it refuses
    to be evicted; the residency asks the other idle slot instead, and the budget holds."""
    from actord.testing.models import write_tiny_lora

    lora = str(write_tiny_lora(tmp_path / "fd-lora.gguf", tiny_model, seed=50))
    probe = Config(model=tiny_model, slots=2, ctx=1024, batch=64, page_dir=str(tmp_path / "p0"),
                   device_bytes=1 << 30)
    async with ActorSystem(probe) as s:  # what one gene and one slot's state weigh here
        gene = await s.gene_load(lora)
        await s.complete(prompt=_prompt(2, 60), n_predict=4, slot=1, ignore_eos=True)
        state = s.residency.slot_bytes[1]
        gene_bytes = gene.n_bytes
    cfg = Config(model=tiny_model, slots=2, ctx=1024, batch=64, page_dir=str(tmp_path / "p1"),
                 page_ram_bytes=1024, device_bytes=gene_bytes + state + state // 2)
    async with ActorSystem(cfg) as s:
        gid = (await s.gene_load(lora)).id
        s.files.fs = FaultyFs([Fault("write", errno=errno.ENOSPC, times=0)])
        await s.complete(prompt=_prompt(1, 60), n_predict=4, mind="ada", ignore_eos=True)
        ada = next(i.id for i in await s.slot_list() if i.mind == "ada")
        await s.complete(prompt=_prompt(2, 60), n_predict=4, slot=1 - ada, ignore_eos=True,
                         genes=[{"id": gid, "scale": 1.0}])
        res = s.residency
        await eventually(lambda: not (res.statistics().queued or res.evicting or res.device_bytes() > cfg.device_bytes),
                         "the device budget comes back by itself", every=0.005)
        infos = {i.id: i for i in await s.slot_list()}
        assert infos[ada].mind == "ada" and infos[ada].n_tokens >= 60  # the mind kept her state
        assert infos[1 - ada].n_tokens == 0
