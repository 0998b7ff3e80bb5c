"""A file in the page folder that is not a regular file (a FIFO, as a careless or hostile
user leaves one) is refused before it is read (issue 33): opened with O_NONBLOCK, then
fstat'ed, so neither the open nor a read blocks a worker thread, and a restore of it gets
a typed NotARegularFile (a 403, as every refused path: the client's doing, not the disk's) while the slot serves
on. Before, the restore never answered and SIGTERM no longer stopped the daemon. A mind
whose page file is a folder, or not a page file at all, is refused once and starts fresh,
before the bulk of such a file is read."""

from __future__ import annotations

import os

import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import NotARegularFile
from actord.service.system import ActorSystem
from actord.storage.osfs import OsFs


def _cfg(model: str, tmp_path) -> Config:
    """One slot over a page folder that exists before the system starts."""
    os.makedirs(tmp_path / "pages", exist_ok=True)
    return Config(model=model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path / "pages"))


def test_a_fifo_is_refused_before_it_is_read(tmp_path):
    fifo = tmp_path / "ada.page"
    os.mkfifo(fifo)  # no writer: a plain open would block for ever
    with pytest.raises(NotARegularFile) as e:
        OsFs().read_file(fifo)
    assert "not a regular file" in e.value.message and e.value.http_status == 403
    assert str(tmp_path) not in e.value.message  # the daemon's folders are not the client's to learn


@pytest.mark.anyio
async def test_restoring_a_fifo_in_the_page_folder_is_a_typed_error_and_the_slot_serves_on(tiny_model, tmp_path):
    cfg = _cfg(tiny_model, tmp_path)
    async with ActorSystem(cfg) as s:
        os.mkfifo(os.path.join(cfg.page_dir, "ada.page"))
        os.mkdir(os.path.join(cfg.page_dir, "bob.page"))
        for name in ("ada.page", "bob.page"):
            with pytest.raises(NotARegularFile, match="not a regular file"):
                await s.slot_restore(0, name)
        r = await s.complete(prompt=[1, 17, 40, 99], n_predict=3, slot=0)
        assert len(r.tokens) == 3


@pytest.mark.anyio
async def test_forgetting_a_mind_removes_its_page_file_generation_whole(tiny_model, tmp_path):
    cfg = Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path / "pages"))
    async with ActorSystem(cfg) as s:
        await s.complete(prompt=[1, 17, 40, 99, 7], n_predict=3, slot=0)
        await s.slot_save(0, "ada.page")
        assert any(n.startswith("ada.page") for n in os.listdir(cfg.page_dir))
        assert await s.forget_mind("ada") > 0
        assert not any(n.startswith("ada.page") for n in os.listdir(cfg.page_dir))
        assert await s.forget_mind("ada") == 0  # nothing left: nothing to free


class _Reads(OsFs):
    """The real file system, counting the bytes each read asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int | None] = []

    def read_file(self, path, limit=None):
        self.asked.append(limit)
        return super().read_file(path, limit)


@pytest.mark.anyio
async def test_a_mind_whose_page_file_is_a_folder_or_no_page_file_starts_fresh_once_refused(tiny_model, tmp_path):
    cfg = _cfg(tiny_model, tmp_path)
    async with ActorSystem(cfg) as s:
        os.mkdir(os.path.join(cfg.page_dir, "bob.page"))
        with open(os.path.join(cfg.page_dir, "eve.page"), "wb") as f:
            f.truncate(64 << 20)  # sparse: zeros, no page file's magic
        for mind in ("bob", "eve", "bob", "eve"):  # each refused once, then served as any new mind
            r = await s.complete(prompt=[1, 17, 40, 99], n_predict=2, mind=mind)
            assert len(r.tokens) == 2
        assert s.metrics.registry.get_sample_value("mind_files_refused_total") == 2


def test_a_file_that_is_not_a_page_file_is_refused_from_its_header_not_read_whole(tmp_path):
    from actord.storage.pagefile import MAIN, load_generation
    from actord.vocabulary.errors import CorruptPageFile

    big = tmp_path / "eve.page"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    fs = _Reads()
    with pytest.raises(CorruptPageFile, match="bad magic"):
        load_generation(fs, {MAIN: big})
    assert fs.asked == [4096]  # its first 4 KiB, never its gigabyte
