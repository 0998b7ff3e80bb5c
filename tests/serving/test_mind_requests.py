"""Mind requests are served or wait; they do not fail because of what other clients do with
slots and pages, nor wait for requests that are not in their way (issue 19, point 8)."""

from __future__ import annotations

import anyio
import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import SlotBusy
from actord.service.system import ActorSystem
from tests.waits import eventually

pytestmark = pytest.mark.anyio


def _prompt(seed: int, n: int) -> list[int]:
    return [1] + [5 + (seed * 31 + i * 7) % 400 for i in range(n - 1)]


async def test_a_placement_waiting_for_a_busy_slot_does_not_hold_up_a_mind_already_in_its_slot(tiny_model, tmp_path):
    """Slot A runs a long slot-addressed request, slot B holds mind bo (busy with a turn).
    A new mind cy must wait for a slot; bo's next turn goes to her own slot meanwhile
    instead of queueing behind cy, which used to wait for the long request to end."""
    cfg = Config(model=tiny_model, slots=2, ctx=16384, batch=64, page_dir=str(tmp_path))
    async with ActorSystem(cfg) as s:
        await s.complete(prompt=_prompt(1, 8), n_predict=2, mind="bo", ignore_eos=True)
        bo_slot = next(i.id for i in await s.slot_list() if i.mind == "bo")
        done: dict[str, object] = {}
        started = {k: anyio.Event() for k in ("long", "bo1")}

        async def run(key: str, scope: anyio.CancelScope | None = None, **kw: object) -> None:
            with scope or anyio.CancelScope():
                done[key] = await s.complete(ignore_eos=True, stream=True, on_token=lambda _: started[key].set()
                                             if key in started else None, **kw)

        bo1 = anyio.CancelScope()
        with anyio.fail_after(120):  # a hang guard, not a measure
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: run("long", prompt=_prompt(2, 8), n_predict=14000, slot=1 - bo_slot))
                await started["long"].wait()
                tg.start_soon(lambda: run("bo1", bo1, prompt=_prompt(1, 8) + [3], n_predict=3000, mind="bo"))
                await started["bo1"].wait()
                n0 = s.placer.delivered
                tg.start_soon(lambda: run("cy", prompt=_prompt(3, 8), n_predict=4, mind="cy"))
                await eventually(lambda: s.placer.delivered >= n0 + 1, "the placer has cy's turn", every=0.01)
                tg.start_soon(lambda: run("bo2", prompt=_prompt(1, 8) + [3, 4], n_predict=4, mind="bo"))
                await eventually(lambda: s.placer.delivered >= n0 + 2, "the placer has bo's second turn", every=0.01)
                bo1.cancel()  # bo's slot is free for her next turn (and then for cy)
                await eventually(lambda: {"bo2", "cy"} <= set(done), "bo's and cy's turns answered", timeout=120,
                                 every=0.01)
                assert "long" not in done, "a mind's turn waited for an unrelated long request"
                tg.cancel_scope.cancel()


async def test_a_refused_page_in_leaves_the_scheduler_with_the_cells_the_slot_really_holds(tiny_model, tmp_path):
    cfg = Config(model=tiny_model, slots=2, ctx=512, batch=64, page_dir=str(tmp_path))
    async with ActorSystem(cfg) as s:
        await s.complete(prompt=_prompt(4, 150), n_predict=2, slot=1, ignore_eos=True)
        await s.page_out(1, "big")
        await s.complete(prompt=_prompt(5, 20), n_predict=2, slot=0, ignore_eos=True)
        held = (await s.slot_list())[0].n_tokens
        with pytest.raises(SlotBusy):  # slot 0 holds a sequence: the page-in is refused
            await s.page_in(0, "big")
        assert s.scheduler.held(0) == held
        assert [p.page for p in await s.page_list()] == ["big"]


async def test_a_mind_whose_page_file_is_corrupt_is_refused_once_and_starts_fresh(tiny_model, tmp_path):
    cfg = Config(model=tiny_model, slots=1, ctx=1024, batch=64, page_dir=str(tmp_path), page_ram_bytes=0)
    async with ActorSystem(cfg) as s:
        await s.complete(prompt=_prompt(6, 40), n_predict=2, mind="ada", ignore_eos=True)
        await s.complete(prompt=_prompt(7, 10), n_predict=2, mind="bo", ignore_eos=True)  # ada -> ada.page
        f = tmp_path / "ada.page"
        data = bytearray(f.read_bytes())
        data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # the second half zeroed
        f.write_bytes(bytes(data))
        r = await s.complete(prompt=_prompt(6, 40) + [3], n_predict=2, mind="ada", ignore_eos=True)
        assert r.n_cached == 0  # fresh, not an error
        assert s.metrics.snapshot()["mind_files_refused_total"] == 1
        r = await s.complete(prompt=_prompt(6, 40) + [3, 4], n_predict=2, mind="ada", ignore_eos=True)
        assert r.n_cached >= 40  # and from then on she is a mind like any other
        await s.complete(prompt=_prompt(7, 10) + [5], n_predict=2, mind="bo", ignore_eos=True)
        r = await s.complete(prompt=_prompt(6, 40) + [3, 4, 5], n_predict=2, mind="ada", ignore_eos=True)
        assert r.n_cached >= 40  # her new file (written over the corrupt one) restores
        assert s.metrics.snapshot()["mind_files_refused_total"] == 1


@pytest.mark.parametrize("n", [118, 119, 124, 128])
async def test_a_mind_name_too_long_for_its_page_file_is_refused_up_front(tiny_model, tmp_path, n):
    from actord.vocabulary.errors import InvalidParams

    cfg = Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path), page_ram_bytes=0)
    async with ActorSystem(cfg) as s:
        mind = "m" * n
        if n > 118:
            with pytest.raises(InvalidParams, match="at most 118"):
                await s.complete(prompt=[1, 2, 3], n_predict=1, mind=mind)
            return
        await s.complete(prompt=[1, 2, 3], n_predict=1, mind=mind, ignore_eos=True)
        # No page RAM: the next mind sends this one to its file, which must be writable.
        await s.complete(prompt=[1, 4, 5], n_predict=1, mind="other", ignore_eos=True)
        assert (tmp_path / f"{mind}.page").exists()


async def test_a_slot_request_on_a_slot_holding_a_mind_takes_its_name_away(tiny_model, tmp_path):
    """A request addressed to the slot is the client's own say over it (llama-server's slot
    semantics): it replaces her state there, which then no longer carries her name."""
    cfg = Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path))
    async with ActorSystem(cfg) as s:
        await s.complete(prompt=_prompt(9, 20), n_predict=2, mind="ada", ignore_eos=True)
        assert (await s.slot_list())[0].mind == "ada"
        await s.complete(prompt=_prompt(10, 20), n_predict=2, slot=0, ignore_eos=True)
        assert (await s.slot_list())[0].mind is None  # the state is no longer hers
        await s.complete(prompt=_prompt(11, 5), n_predict=2, mind="bo", ignore_eos=True)
        assert [p.page for p in await s.page_list()] == []  # nobody paged it out as "ada"


async def test_an_unnamed_request_on_a_minds_slot_pages_her_out_first_and_she_keeps_her_cache(tiny_model, tmp_path):
    """Issue 26: an unnamed request never writes over a named mind. Her state goes to her
    page as a copy (the slot keeps the sequence, nameless, for the request's own prefix), and
    her next turn pages it back in and decodes only what is new."""
    cfg = Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path))
    async with ActorSystem(cfg) as s:
        t1 = await s.complete(prompt=_prompt(9, 20), n_predict=2, mind="ada", ignore_eos=True)
        held = _prompt(9, 20) + list(t1.tokens)
        info = (await s.slot_list())[0]
        assert info.mind == "ada"
        n_kv = info.n_tokens  # her KV: the prompt and every sample but the last
        other = await s.complete(prompt=_prompt(9, 10) + [3, 4], n_predict=2, ignore_eos=True)
        assert other.n_cached >= 9  # it started from what it shares with her
        assert (await s.slot_list())[0].mind is None
        assert [(p.page, p.n_tokens) for p in await s.page_list()] == [("ada", n_kv)]
        back = await s.complete(prompt=held + [7], n_predict=2, mind="ada", ignore_eos=True)
        assert back.n_cached == n_kv


async def test_an_unnamed_request_is_refused_rather_than_write_over_a_mind_with_nowhere_to_go(tiny_model, tmp_path):
    """No page RAM and a page folder that refuses writes: the unnamed request that lands on
    her slot is refused, typed, and she keeps her slot and every token."""
    import errno

    from actord.vocabulary.errors import StorageError
    from actord.storage.osfs import Fault, FaultyFs

    cfg = Config(model=tiny_model, slots=1, ctx=512, batch=64, page_dir=str(tmp_path), page_ram_bytes=0)
    async with ActorSystem(cfg) as s:
        t1 = await s.complete(prompt=_prompt(9, 20), n_predict=2, mind="ada", ignore_eos=True)
        held = _prompt(9, 20) + list(t1.tokens)
        n_kv = (await s.slot_list())[0].n_tokens
        s.files.fs = FaultyFs([Fault("write", errno=errno.EROFS, times=0)])
        with pytest.raises(StorageError):
            await s.complete(prompt=_prompt(10, 20), n_predict=2, ignore_eos=True)
        info = (await s.slot_list())[0]
        assert (info.mind, info.n_tokens) == ("ada", n_kv)
        s.files.fs = FaultyFs()
        back = await s.complete(prompt=held + [7], n_predict=2, mind="ada", ignore_eos=True)
        assert back.n_cached == n_kv


async def test_a_mind_keeps_her_cache_through_ten_anonymous_requests_on_two_slots(tiny_model, tmp_path):
    cfg = Config(model=tiny_model, slots=2, ctx=2048, batch=64, page_dir=str(tmp_path))
    async with ActorSystem(cfg) as s:
        t1 = await s.complete(prompt=_prompt(5, 40), n_predict=4, mind="ada", ignore_eos=True)
        held = _prompt(5, 40) + list(t1.tokens)
        n_kv = len(held) - 1  # her KV: the prompt and every sample but the last
        kept = s.metrics.minds_kept_total.labels(to="page")
        for i in range(0, 10, 2):  # two at once, so both slots are needed; some share her prefix
            async with anyio.create_task_group() as tg:
                for j in (i, i + 1):
                    prompt = (_prompt(5, 20) if j % 2 else _prompt(20 + j, 30)) + [3 + j]
                    tg.start_soon(lambda p=prompt: s.complete(prompt=p, n_predict=8, ignore_eos=True))
        assert kept._value.get() >= 1  # her slot served an anonymous request: she went to her page first
        back = await s.complete(prompt=held + [7, 8], n_predict=2, mind="ada", ignore_eos=True)
        assert back.n_cached == n_kv


async def test_an_unnamed_request_takes_a_free_slot_rather_than_write_over_a_mind(tiny_model, tmp_path):
    """The mind's slot shares the unnamed prompt's longest prefix, but another slot is idle:
    the mind keeps her state, and her next turn decodes only what is new."""
    cfg = Config(model=tiny_model, slots=2, ctx=2048, batch=64, page_dir=str(tmp_path))
    async with ActorSystem(cfg) as s:
        turn1 = await s.complete(prompt=_prompt(5, 40), n_predict=4, mind="ada", ignore_eos=True)
        held = _prompt(5, 40) + list(turn1.tokens)
        await s.complete(prompt=_prompt(5, 40) + [7, 8], n_predict=2, ignore_eos=True)
        infos = {i.mind: i for i in await s.slot_list()}
        assert "ada" in infos and infos["ada"].n_tokens >= len(held) - 1
        turn2 = await s.complete(prompt=held + [9], n_predict=1, mind="ada", ignore_eos=True)
        assert turn2.n_cached >= len(held) - 1


async def test_a_new_mind_placed_together_with_a_slot_addressed_request_starts_on_the_idle_slot(tiny_model, tmp_path):
    """Both arrive at once: the placer has not heard yet that slot 0 is taken and starts the
    new mind there (Complete.fresh); the busy slot hands her back, and she runs on slot 1
    while the long request goes on, rather than waiting behind it."""
    cfg = Config(model=tiny_model, slots=2, ctx=16384, batch=64, page_dir=str(tmp_path))
    async with ActorSystem(cfg) as s:
        order: list[str] = []
        out: dict[str, object] = {}

        async def run(key: str, **kw: object) -> None:
            out[key] = await s.complete(ignore_eos=True, **kw)
            order.append(key)

        with anyio.fail_after(120):  # a hang guard, not a measure
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: run("long", prompt=_prompt(3, 8), n_predict=1000, slot=0))
                tg.start_soon(lambda: run("ada", prompt=_prompt(4, 8), n_predict=2, mind="ada"))
    assert out["ada"].slot == 1 and order == ["ada", "long"]  # type: ignore[attr-defined]
