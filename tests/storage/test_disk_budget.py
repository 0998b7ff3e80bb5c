"""The page folder's index and its disk budget (issue 34): a restart indexes the files from
names and sizes, the budget evicts the least recently used minds' files first and refuses
what cannot fit, and a removal is crash-safe like a publication."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from actord.vocabulary.errors import FileNotFound, PageDiskExceeded, StorageError
from actord.vocabulary.metrics import Metrics
from actord.storage.disk_index import scan
from actord.storage.files import PageFiles
from actord.storage.osfs import Fault, FaultyFs, OsFs, SimulatedCrash
from actord.storage.pagefile import PageImage
from actord.storage.publish import STAGE_PREFIX, RECORD_PREFIX, publish_generation, read_generation, remove_generation
from actord.policy.checkpoint_records import StoredCheckpoint


def image(n: int = 1000, ckpt: bool = False) -> PageImage:
    return PageImage(tokens=list(range(10)), state=b"S" * n, meta={"model": "fp"},
                     checkpoints=[StoredCheckpoint(pos=5, data=b"c" * 100)] if ckpt else [])


async def budgeted(root: Path, n_files: int, metrics: Metrics | None = None) -> PageFiles:
    """PageFiles whose budget holds `n_files` files of `image()` (their true size, plus
    less than the admission estimate's margin over it)."""
    probe = PageFiles(root.parent / "probe")
    one = (await probe.publish("p", image())).n_bytes
    files = PageFiles(root, disk_bytes=n_files * one + 600, metrics=metrics)
    await files.start()
    return files


def on_disk(root: Path, name: str) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.name == name or p.name.startswith(name + "."))


@pytest.mark.anyio
async def test_a_restart_indexes_every_page_file_with_its_sidecars_without_reading_one(tmp_path):
    files = PageFiles(tmp_path)
    await files.start()
    await files.publish("a.page", image(ckpt=True))
    await files.publish("sub/b.page", image(500))
    fs = FaultyFs()
    again = PageFiles(tmp_path, fs=fs)
    assert await again.start() == 2
    assert again.index.files == {"a.page": on_disk(tmp_path, "a.page"), "sub/b.page": on_disk(tmp_path / "sub", "b.page")}
    assert not [t for op, t in fs.trace if op == "read"]  # names and sizes: no file opened


@pytest.mark.anyio
async def test_the_disk_budget_evicts_the_least_recently_used_minds_files_first(tmp_path):
    m = Metrics()
    files = await budgeted(tmp_path / "pages", 3, m)
    tmp_path = tmp_path / "pages"
    for name in ("a.page", "b.page", "c.page"):
        await files.publish(name, image())
    await files.read("a.page")  # a is used again: b is now the oldest
    await files.publish("d.page", image())
    assert sorted(files.index.files) == ["a.page", "c.page", "d.page"]
    assert not (tmp_path / "b.page").exists()
    assert files.index.used <= files.index.budget
    snap = m.snapshot()
    assert snap["page_disk_evicted_total"] == 1 and snap["page_disk_files"] == 3
    assert snap["page_disk_bytes"] == files.index.used
    with pytest.raises(FileNotFound):
        read_generation(tmp_path, "b.page", OsFs())


@pytest.mark.anyio
async def test_a_file_the_budget_cannot_hold_is_refused_typed_and_nothing_is_evicted_or_written(tmp_path):
    m = Metrics()
    files = await budgeted(tmp_path / "pages", 2, m)
    tmp_path = tmp_path / "pages"
    one = files.index.budget // 2
    await files.publish("saved-by-a-client", image())  # not a mind's file: counted, never evicted
    await files.publish("a.page", image())
    with pytest.raises(PageDiskExceeded) as e:
        await files.publish("big.page", image(3 * one))
    assert e.value.data["budget"] == files.index.budget
    assert sorted(files.index.files) == ["a.page", "saved-by-a-client"] and not (tmp_path / "big.page").exists()
    await files.publish("b.page", image())  # a's file makes room for b's; the client's stays
    assert sorted(files.index.files) == ["b.page", "saved-by-a-client"]
    assert m.snapshot()["page_disk_refused_total"] == 1


@pytest.mark.anyio
async def test_a_file_being_published_or_held_is_not_evicted_for_another(tmp_path):
    files = await budgeted(tmp_path / "pages", 2)
    await files.publish("a.page", image())
    await files.publish("b.page", image())
    async with files.holding("a.page"):  # a spill holds a's file from its write to its drop
        await files.publish("c.page", image())
    assert sorted(files.index.files) == ["a.page", "c.page"]


def _dry_removal_trace(tmp_path: Path) -> list[str]:
    root = tmp_path / "dry"
    publish_generation(root, "m.page", image(ckpt=True), OsFs())
    fs = FaultyFs()
    remove_generation(root, "m.page", fs)
    return [op for op, _ in fs.trace]


@pytest.mark.timeout(60)
def test_a_removal_cut_short_at_any_step_leaves_the_generation_whole_or_gone_and_nothing_behind(tmp_path):
    ops = _dry_removal_trace(tmp_path)
    cases = sorted({(op, ops[: i + 1].count(op)) for i, op in enumerate(ops)})
    assert len(cases) > 10
    for k, (op, nth) in enumerate(cases):
        for action in ("crash", "fail"):
            root = tmp_path / f"{k}-{action}"
            publish_generation(root, "m.page", image(ckpt=True), OsFs())
            fs = FaultyFs([Fault(op, nth, action)])
            outcome = "ok"
            try:
                remove_generation(root, "m.page", fs)
            except StorageError as e:
                outcome = "committed" if e.data.get("committed") else "error"
            except SimulatedCrash:
                outcome = "crash"
            reader = FaultyFs(dead_pids=[os.getpid()]) if outcome == "crash" else OsFs()
            try:
                got = read_generation(root, "m.page", reader)
            except FileNotFound:
                got = None
            if outcome in ("ok", "committed"):
                assert got is None, (op, nth, action, outcome)
            elif outcome == "error":
                assert got is not None and bytes(got.state) == b"S" * 1000, (op, nth, action)
            assert got is None or (len(got.checkpoints) == 1 and bytes(got.state) == b"S" * 1000), (op, nth)
            left = [n for n in os.listdir(root) if n.startswith((STAGE_PREFIX, RECORD_PREFIX))]
            assert left == [], (op, nth, action, left)
            # what the next start indexes agrees with what a read finds
            assert [e[0] for e in scan(root, OsFs())] == ([] if got is None else ["m.page"])


def test_a_quiet_folder_is_not_listed_at_each_read_and_another_holder_makes_it_listed_again(tmp_path):
    """10,000 page files: a read or publication must not list the folder each time, yet a
    publication another process cut short is still completed by the next reader."""
    from actord.storage.paths import LOCK_NAME

    root = tmp_path / "pages"
    publish_generation(root, "m.page", image(), OsFs())
    read_generation(root, "m.page", OsFs())
    fs = FaultyFs()
    read_generation(root, "m.page", fs)
    publish_generation(root, "n.page", image(), fs)
    assert [op for op, _ in fs.trace if op == "listdir"] == []
    # Another process holds the lock (counting its hold) and dies leaving an orphan stage.
    with OsFs().lock(root / LOCK_NAME) as other:
        other.set_count(other.count() + 1)
        (root / f"{STAGE_PREFIX}999999999-dead").mkdir()
    fs = FaultyFs(dead_pids=[999999999])
    read_generation(root, "m.page", fs)
    assert [op for op, _ in fs.trace if op == "listdir"] != []
    assert not (root / f"{STAGE_PREFIX}999999999-dead").exists()


def kept_image() -> PageImage:
    from actord.storage.pagefile import KEPT_META

    img = image()
    return PageImage(tokens=img.tokens, state=img.state, meta={**img.meta, KEPT_META: True})


@pytest.mark.anyio
async def test_a_file_a_client_saved_under_a_minds_file_name_is_never_evicted_before_or_after_a_restart(tmp_path):
    root = tmp_path / "pages"
    files = await budgeted(root, 3)
    await files.publish("keep.page", kept_image())  # slot.save keep.page: a client's, by name
    for name in ("a.page", "b.page", "c.page"):  # the daemon's minds
        await files.publish(name, image())
    assert (root / "keep.page").exists() and "a.page" not in files.index.files
    again = PageFiles(root, disk_bytes=files.index.budget)
    await again.start()
    # Found at start, unread: which of the two each file is waits for the sweep, so none goes.
    with pytest.raises(PageDiskExceeded):
        await again.publish("d.page", image())
    await again.sweep()
    await again.publish("d.page", image())
    await again.publish("e.page", image())
    assert (root / "keep.page").exists() and sorted(again.index.files) == ["d.page", "e.page", "keep.page"]
    # The daemon writing that name as a mind's file makes it the daemon's: evictable again.
    assert "keep.page" not in list(again.index.victims(1 << 30, lambda v: False))
    await again.publish("keep.page", image())
    assert "keep.page" in list(again.index.victims(1 << 30, lambda v: False))
