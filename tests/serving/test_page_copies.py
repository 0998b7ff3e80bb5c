"""Each page move copies the state once, between libllama and the page's own buffer.

Counted at the libllama boundary: the calls that copy a whole sequence's state, and the
address each is handed. page_out: one `llama_state_seq_get_data_ext`, writing straight into
the buffer the page then holds (no second copy into the store); page_in: one
`llama_state_seq_set_data_ext`, reading that buffer in place; and a page_out after a
page_in writes into the buffer the page_in let go of (the pool: no fresh memory).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from actord.vocabulary.config import Config
from actord.engine.llama import lib
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

PROMPT = [1] + list(range(300, 400))


@pytest.fixture
def state_copies(monkeypatch):
    calls: list[tuple[str, int, int]] = []  # (which, address, bytes) of whole-state copies

    def spy(name: str, addr_arg: int, size_arg: int) -> None:
        orig = getattr(lib, name)  # the guarded function: the thread check still runs

        def wrapper(*args):
            flags = args[-1]
            if flags == 0:  # a whole sequence, not a partial (checkpoint) copy
                calls.append((name.split("_")[3], ctypes.cast(args[addr_arg], ctypes.c_void_p).value, args[size_arg]))
            return orig(*args)

        monkeypatch.setattr(lib, name, wrapper)

    spy("llama_state_seq_get_data_ext", 1, 2)
    spy("llama_state_seq_set_data_ext", 1, 2)
    return calls


def address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


async def test_page_out_and_in_copy_once_through_the_page_buffer(tiny_model, tmp_path, state_copies):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, batch=64, page_dir=str(tmp_path))) as s:
        await s.complete(prompt=PROMPT, n_predict=4, slot=0, ignore_eos=True)
        state_copies.clear()
        await s.page_out(0, "m")
        page = s.pages.gens[s.pages.names["m"]].page
        assert state_copies == [("get", address(page.state), page.state.nbytes)]

        state_copies.clear()
        await s.page_in(1, "m")
        assert state_copies == [("set", address(page.state), page.state.nbytes)]

        state_copies.clear()
        await s.complete(prompt=PROMPT + [7, 8], n_predict=1, slot=1, ignore_eos=True)
        await s.page_out(1, "m")
        again = s.pages.gens[s.pages.names["m"]].page
        # Into the very buffer the page_in let go of: warm memory, and still one copy, with
        # no size query first (libllama writes at most the buffer's capacity).
        assert state_copies == [("get", address(page.state), again.state.obj.nbytes)]
        assert again.state.obj is page.state.obj
        assert again.state.nbytes < again.state.obj.nbytes


async def test_a_page_moved_through_pooled_buffers_round_trips_bit_exact(tiny_model, tmp_path):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, batch=64, page_dir=str(tmp_path))) as s:
        ref = await s.complete(prompt=PROMPT, n_predict=4, slot=0, ignore_eos=True)
        await s.page_out(0, "m")
        first = s.pages.gens[s.pages.names["m"]].page
        image, buf = bytes(first.state), first.state.obj
        for _ in range(3):  # each page_out writes into the buffer the page_in before let go of
            await s.page_in(0, "m")
            await s.page_out(0, "m")
            page = s.pages.gens[s.pages.names["m"]].page
            assert page.state.obj is buf
            assert bytes(page.state) == image
        await s.page_in(0, "m")
        assert (await s.slot_list())[0].n_tokens == len(PROMPT) + len(ref.tokens) - 1
        await s.slot_erase(1)
        again = await s.complete(prompt=PROMPT + ref.tokens + [9], n_predict=3, slot=0, ignore_eos=True)
        fresh = await s.complete(prompt=PROMPT + ref.tokens + [9], n_predict=3, slot=1, ignore_eos=True)
        assert again.n_prompt_processed == 2  # the paged state was used...
        assert again.tokens == fresh.tokens  # ...and decodes as a fresh prefill does


async def test_a_restore_reads_the_file_image_in_place(tiny_model, tmp_path, state_copies):
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, batch=64, page_dir=str(tmp_path))) as s:
        await s.complete(prompt=PROMPT, n_predict=4, slot=0, ignore_eos=True)
        await s.slot_save(0, "m.page")
        state_copies.clear()
        r = await s.slot_restore(1, "m.page")
        assert [(c[0], c[2]) for c in state_copies] == [("set", r["n_bytes"])]
