"""Slot pages in host RAM: moves keep the cache, the ceiling refuses cleanly, nothing is half-moved."""

from __future__ import annotations

import anyio
import pytest

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.vocabulary.errors import EngineError, PageDoesNotFit, PageNotFound, PageRamExceeded, SlotBusy, SlotEmpty
from actord.service.system import ActorSystem
from tests.waits import eventually, slot_in

pytestmark = pytest.mark.anyio

PROMPT = [1, 50, 61, 72, 83, 94, 105, 116, 127, 138, 149, 160, 171, 182]


def cfg(model: str, **kw) -> Config:
    return Config(model=model, slots=kw.pop("slots", 2), ctx=kw.pop("ctx", 512), batch=kw.pop("batch", 64), **kw)


async def _turn(s, slot, prompt, n=8):
    return await s.complete(prompt=prompt, n_predict=n, slot=slot, ignore_eos=True)


async def test_paged_slot_resumes_in_another_slot_with_only_the_suffix(tiny_model):
    async with ActorSystem(cfg(tiny_model, slots=3)) as s:
        first = await _turn(s, 0, PROMPT)
        out = await s.page_out(0, "mind-a")
        assert out["n_bytes"] > 0 and out["n_tokens"] == len(PROMPT) + 7
        assert (await s.slot_list())[0].n_tokens == 0
        assert [p.page for p in await s.page_list()] == ["mind-a"]
        await s.page_in(2, "mind-a")
        assert await s.page_list() == []
        nxt = PROMPT + first.tokens + [9, 8, 7]
        paged = await _turn(s, 2, nxt)
        assert paged.n_prompt_processed == 4  # the last output token (never fed) + 3 new
        fresh = await _turn(s, 1, nxt)
        assert paged.tokens == fresh.tokens
        assert (await s.page_stats()).charged == 0


async def test_refused_page_out_leaves_slot_intact(tiny_model):
    async with ActorSystem(cfg(tiny_model, page_ram_bytes=1000)) as s:
        first = await _turn(s, 0, PROMPT)
        with pytest.raises(PageRamExceeded):
            await s.page_out(0, "too-big")
        info = (await s.slot_list())[0]
        assert info.n_tokens == len(PROMPT) + 7
        again = await _turn(s, 0, PROMPT + first.tokens)
        assert again.n_prompt_processed == 1
        m = s.metrics.snapshot()
        assert (m["page_refused_total"], m["page_failed_total"]) == (1, 0)  # a refusal, not a failure
        assert (await s.page_stats()).charged == 0


async def test_failed_page_out_copy_cancels_its_reservation(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        await _turn(s, 0, PROMPT)
        real_run = s.engine.run

        async def failing_run(job):
            if isinstance(job, J.StateGet):
                return await real_run(J.Fail(reason="copy"))
            return await real_run(job)

        s.engine.run = failing_run  # the slot's view of the engine
        for sl in s.slots:
            sl.memory.engine = s.engine
        with pytest.raises(EngineError, match="injected engine failure"):
            await s.page_out(0, "m")
        s.engine.run = real_run
        assert (await s.page_stats()).charged == 0 and await s.page_list() == []
        assert (await s.slot_list())[0].n_tokens == len(PROMPT) + 7


async def test_a_page_out_whose_commit_fails_puts_the_taken_state_back(tiny_model):
    """page_out's copy also removes the sequence (one engine round trip): should the store
    then refuse the page, the state goes back into the slot from the copy, bit for bit."""
    from actord.serving.page_store import Commit
    from actord.vocabulary.errors import InvalidParams

    async with ActorSystem(cfg(tiny_model)) as s:
        first = await _turn(s, 0, PROMPT)
        store = s.slots[0].peers.pages
        real_ask = store.ask

        async def failing_ask(msg):
            if isinstance(msg, Commit):
                raise InvalidParams("planted")
            return await real_ask(msg)

        store.ask = failing_ask
        try:
            with pytest.raises(InvalidParams):
                await s.page_out(0, "m")
        finally:
            del store.ask
        assert await s.page_list() == []
        assert (await s.page_stats()).charged == 0
        assert (await s.slot_list())[0].n_tokens == len(PROMPT) + 7
        nxt = PROMPT + first.tokens + [9, 8]
        again = await _turn(s, 0, nxt)
        assert again.n_prompt_processed == 3  # the state was put back: only the suffix
        fresh = await _turn(s, 1, nxt)
        assert again.tokens == fresh.tokens


async def test_failed_page_in_leaves_the_page_in_the_store(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        await _turn(s, 0, PROMPT)
        out = await s.page_out(0, "m")
        real_run = s.engine.run

        async def failing_run(job):
            if isinstance(job, J.StateSet):
                raise PageDoesNotFit("planted")
            return await real_run(job)

        for sl in s.slots:
            # page_in submits the copy and waits for it after the checkpoints' bookkeeping
            sl.memory.engine = type("E", (), {"run": staticmethod(failing_run), "submit": staticmethod(lambda job: job),
                                       "wait": staticmethod(failing_run)})()
        with pytest.raises(PageDoesNotFit):
            await s.page_in(1, "m")
        for sl in s.slots:
            sl.memory.engine = s.engine
        assert [p.page for p in await s.page_list()] == ["m"]
        assert (await s.page_stats()).charged == out["n_bytes"]
        assert (await s.slot_list())[1].n_tokens == 0
        await s.page_in(1, "m")
        assert (await s.slot_list())[1].n_tokens == out["n_tokens"]


async def test_typed_errors_for_empty_slot_unknown_page_and_occupied_target(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        with pytest.raises(SlotEmpty):
            await s.page_out(0, "m")
        with pytest.raises(PageNotFound):
            await s.page_in(0, "nope")
        with pytest.raises(PageNotFound):
            await s.page_drop("nope")
        await _turn(s, 0, PROMPT)
        await _turn(s, 1, PROMPT[:5])
        await s.page_out(0, "m")
        with pytest.raises(SlotBusy):
            await s.page_in(1, "m")
        assert [p.page for p in await s.page_list()] == ["m"]


async def test_page_out_of_a_processing_slot_waits_until_it_is_idle(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        results = {}

        async def gen():
            results["gen"] = await s.complete(prompt=PROMPT, n_predict=40, slot=0, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(gen)
            await eventually(lambda: slot_in(s, 0, "processing"), "slot 0 runs the generation", every=0)
            results["page"] = await s.page_out(0, "m")
        assert results["page"]["n_tokens"] == len(PROMPT) + 39
        assert s.metrics.snapshot()["requests_deferred_total"] >= 1


async def test_replacing_a_page_subtracts_the_old_one_only_when_the_store_owns_it_alone(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        await _turn(s, 0, PROMPT)
        a = await s.page_out(0, "m")
        await _turn(s, 0, PROMPT[:6])
        b = await s.page_out(0, "m")  # replaces: old one was solely the store's
        st = await s.page_stats()
        assert st.charged == b["n_bytes"] and st.pages == 1 and a["n_bytes"] != b["n_bytes"]


async def test_a_page_or_file_larger_than_the_cells_held_for_it_is_refused_before_anything_moves(tiny_model,
                                                                                                 tmp_path):
    """A page-in or restore sized by one look and carried out after the page or file was
    replaced by a larger one (simulation seed 625: a page published between the page.in
    verb's look and the slot's turn moved 135 cells in with none held, 270 of 256 charged)."""
    from actord.serving.messages import PageInSlot, RestoreSlot
    from actord.vocabulary.errors import ContextFull

    async with ActorSystem(cfg(tiny_model, slots=3, page_dir=str(tmp_path))) as s:
        await _turn(s, 0, [1] + list(range(5, 55)))
        await s.slot_save(0, "big.page")
        await s.page_out(0, "big")
        for msg in (PageInSlot(page="big", room_cells=10), RestoreSlot(file="big.page", room_cells=10)):
            with pytest.raises(ContextFull):
                await s.slots[2].ask(msg)
            assert (await s.slot_list())[2].n_tokens == 0
        with pytest.raises(PageNotFound):  # no page of that name when the verb looks: not asked of a slot
            await s.page_in(2, "not-yet")
        assert "big" in [p.page if not isinstance(p, dict) else p["page"] for p in await s.page_list()]


@pytest.mark.parametrize("move", ["page", "file"])
async def test_a_regenerate_after_a_move_on_a_full_swa_cache_decodes_only_the_last_prompt_token(
        tiny_swa_model, tmp_path, move):
    """A page or file of a full sliding-window cache holds only its last window of those
    layers: a turn that cuts back (a regenerate: the same prompt again, its reply dropped)
    re-prefilled the whole history after a move. The page keeps the window at the last
    prompt's end less one, and the turn starts there, answering as the first time."""
    prompt = [1] + [3 + (i * 37) % 500 for i in range(300)]
    async with ActorSystem(cfg(tiny_swa_model, slots=1, ctx=1024, page_dir=str(tmp_path))) as s:
        assert s.props.swa_full and 0 < s.props.n_swa < len(prompt)
        first = await s.complete(prompt=prompt, n_predict=20, mind="ada", ignore_eos=True)
        if move == "file":
            await s.page_out(0, "ada")
            await s.page_spill("ada", "ada.page", drop=True)
        await s.complete(prompt=[1] + list(range(7, 107)), n_predict=2, mind="bob", ignore_eos=True)
        again = await s.complete(prompt=prompt, n_predict=20, mind="ada", ignore_eos=True)
        assert again.n_prompt_processed == 1 and again.resumed_from_checkpoint
        assert again.tokens == first.tokens
        assert (await s.slot_list())[0].n_checkpoints == 0  # used: the move's checkpoint goes


async def test_without_swa_window_pages_a_full_swa_caches_page_holds_no_checkpoint(tiny_swa_model):
    prompt = [1] + [3 + (i * 37) % 500 for i in range(300)]
    for on in (True, False):
        async with ActorSystem(cfg(tiny_swa_model, slots=1, ctx=1024, page_swa_window=on)) as s:
            await s.complete(prompt=prompt, n_predict=8, slot=0, ignore_eos=True)
            assert (await s.page_out(0, "ada"))["n_checkpoints"] == int(on)


async def test_a_restore_verb_that_could_not_size_its_file_moves_no_cells_without_room(tiny_model, tmp_path):
    """The verb's twin of the placer's rule: a file whose header it could not read (a
    publication cut short, completed by the restore's own read) holds cells it did not hold
    room for, so the slot refuses it, typed, before anything moves."""
    from actord.vocabulary.errors import ContextFull

    async with ActorSystem(cfg(tiny_model, slots=2, page_dir=str(tmp_path))) as s:
        await _turn(s, 0, PROMPT)
        await s.slot_save(0, "a.page")

        async def unsized(name):
            return None

        s.files.n_tokens = unsized
        with pytest.raises(ContextFull):
            await s.slot_restore(1, "a.page")
        assert (await s.slot_list())[1].n_tokens == 0


async def test_a_page_or_file_whose_name_no_mind_may_bear_moves_in_as_a_slots_state_not_a_mind(tiny_model, tmp_path):
    """A page name may be longer than a mind's (119-128 characters), and a file may sit in a
    folder: moved into a slot, neither becomes a mind whose state could never be written to
    her file (write-behind and a stop would fail on it for ever)."""
    long = "p" * 120
    async with ActorSystem(cfg(tiny_model, page_dir=str(tmp_path))) as s:
        await _turn(s, 0, PROMPT)
        await s.page_out(0, long)
        await s.page_in(1, long)
        assert (await s.slot_list())[1].mind is None and (await s.slot_list())[1].n_tokens > 0
        await s.page_out(1, "ada")
        await s.page_in(0, "ada")
        assert (await s.slot_list())[0].mind == "ada"  # a name a mind may bear is hers
        await s.slot_save(0, "sub/ada.page")
        await s.slot_restore(1, "sub/ada.page")
        assert (await s.slot_list())[1].mind is None
        await s.slot_save(0, "bo.page")
        await s.slot_erase(0)
        await s.slot_restore(0, "bo.page")
        assert (await s.slot_list())[0].mind == "bo"
