"""A file in the page folder that is not a regular file (a FIFO, as a careless or hostile
user leaves one) is refused before it is read (issue 33): opened with O_NONBLOCK, then
fstat'ed, so neither the open nor a read blocks a worker thread, and a restore of it gets
a typed StorageError while the slot serves on. Before, the restore never answered and
SIGTERM no longer stopped the daemon."""

from __future__ import annotations

import os

import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import StorageError
from actord.service.system import ActorSystem
from actord.storage.osfs import OsFs


def test_a_fifo_is_refused_before_it_is_read(tmp_path):
    fifo = tmp_path / "ada.page"
    os.mkfifo(fifo)  # no writer: a plain open would block for ever
    with pytest.raises(StorageError) as e:
        OsFs().read_file(fifo)
    assert "not a regular file" in e.value.message and e.value.data["errno"] == 22


@pytest.mark.anyio
async def test_restoring_a_fifo_in_the_page_folder_is_a_typed_error_and_the_slot_serves_on(tiny_model, tmp_path):
    cfg = Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path / "pages"))
    async with ActorSystem(cfg) as s:
        os.makedirs(cfg.page_dir, exist_ok=True)
        os.mkfifo(os.path.join(cfg.page_dir, "ada.page"))
        with pytest.raises(StorageError, match="not a regular file"):
            await s.slot_restore(0, "ada.page")
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
