"""Pages on shared prefixes (issue 25): a prefix two minds share is stored once, as a base;
a page on it is charged its own part, a page-in moves only that part when a peer slot holds
the base, and output is the same as if the mind had never been paged."""

from __future__ import annotations

import pytest

from actord.engine import jobs as J
from actord.vocabulary.config import Config
from actord.vocabulary.errors import CorruptPageFile, EngineError, PageRamExceeded
from actord.service.system import ActorSystem
from actord.storage.pagefile import MAIN, PageImage, decode_main, encode_generation

pytestmark = pytest.mark.anyio

PREFIX = [1] + [3 + (i * 37) % 500 for i in range(599)]
A = PREFIX + [7, 8, 9, 10, 11]
B = PREFIX + [90, 91, 92, 93, 94]
N_BASE = 600  # the prefix the minds share: a base ends where they part


@pytest.fixture
def anyio_backend():
    return "asyncio"


def cfg(model: str, **kw) -> Config:
    return Config(model=model, slots=kw.pop("slots", 3), ctx=2048, batch=256, threads=1, **kw)


async def turn(s: ActorSystem, slot: int, prompt: list[int]) -> list[int]:
    return (await s.complete(prompt=prompt, n_predict=4, slot=slot, ignore_eos=True)).tokens


async def two_minds_paged(s: ActorSystem) -> tuple[list[int], list[int], int]:
    """Minds a and b on slots 0 and 1, paged out; their tokens, and one whole page's bytes."""
    await turn(s, 0, A)
    await turn(s, 1, B)
    ka, kb = list(s.slots[0].kv_tokens), list(s.slots[1].kv_tokens)
    whole = await s.engine.run(J.StateSize(seq=0)) + 4 * len(ka)
    a = await s.page_out(0, "a")  # slot 1's sequence shares the prefix: a base is made
    b = await s.page_out(1, "b")  # and b stands on it
    assert a["n_base"] == b["n_base"] == N_BASE
    return ka, kb, whole


async def fresh(s: ActorSystem, slot: int, prompt: list[int]) -> list[int]:
    await s.slot_erase(slot)
    return await turn(s, slot, prompt)


async def test_a_second_mind_on_a_shared_prefix_is_charged_its_own_part(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        _, _, whole = await two_minds_paged(s)
        st = await s.page_stats()
        assert st.bases == 1 and st.pages == 2 and st.base_bytes > 0.8 * whole
        assert st.charged < 1.3 * whole  # two whole pages: 2.0x
        assert st.shared_bytes == st.base_bytes and s.metrics.snapshot()["prefix_shared_bytes"] == st.shared_bytes
        assert {p.page: p.n_base for p in await s.page_list()} == {"a": N_BASE, "b": N_BASE}


async def test_page_ins_from_a_base_and_from_a_peers_cells_decode_as_never_paged(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        ka, kb, _ = await two_minds_paged(s)
        a_in = await s.page_in(0, "a")  # no slot holds the prefix: the base's bytes
        assert a_in["base_from"] == "bytes" and a_in["n_tokens"] == len(ka)
        b_in = await s.page_in(1, "b")  # slot 0 does now: only b's own part moves
        assert b_in["base_from"] == "cells" and b_in["base_slot"] == 0 and b_in["n_bytes"] < a_in["n_bytes"] / 5
        assert (await s.page_stats()).charged == 0  # both pages gone, and their base with them
        na, nb = ka + [5, 6], kb + [5, 6]
        ra = await s.complete(prompt=na, n_predict=6, slot=0, ignore_eos=True)
        rb = await s.complete(prompt=nb, n_predict=6, slot=1, ignore_eos=True)
        assert ra.n_cached == len(ka) and rb.n_cached == len(kb)
        want_a = (await s.complete(prompt=na, n_predict=6, slot=2, ignore_eos=True)).tokens
        await s.slot_erase(2)
        want_b = (await s.complete(prompt=nb, n_predict=6, slot=2, ignore_eos=True)).tokens
        assert (ra.tokens, rb.tokens) == (want_a, want_b)


async def test_a_base_lives_until_its_last_page_goes(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        ka, _, _ = await two_minds_paged(s)
        index = s.built.index  # placements read pages and bases there: it follows every change
        assert index.base_for(ka + [1], "") == N_BASE and index.page_tokens("a") == len(ka)
        assert index.base_for(ka + [1], "another scope") == 0  # a base is its scope's alone
        await s.page_drop("a")
        st = await s.page_stats()
        assert (st.bases, st.pages, st.shared_bytes) == (1, 1, 0) and st.charged > st.base_bytes
        assert index.page_tokens("a") is None and index.base_for(ka + [1], "") == N_BASE
        await s.page_drop("b")
        st = await s.page_stats()
        assert (st.charged, st.bases, st.generations, st.reservations) == (0, 0, 0, 0)
        assert index.page_tokens("b") is None and index.base_for(ka + [1], "") == 0


async def test_a_base_the_ceiling_refuses_leaves_a_whole_page(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        store = s.pages
        admit = store.admit

        def refuse_bases(name: str, n_bytes: int) -> int:
            if not name:
                raise PageRamExceeded("test: no room for a base", n_bytes=n_bytes)
            return admit(name, n_bytes)

        store.admit = refuse_bases
        await turn(s, 0, A)
        await turn(s, 1, B)
        out = await s.page_out(0, "a")
        assert "n_base" not in out
        st = await s.page_stats()
        assert (st.bases, st.pages) == (0, 1) and [p.n_base for p in await s.page_list()] == [0]


async def test_a_spilled_page_on_a_base_restores_and_decodes_the_same(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, page_dir=str(tmp_path))) as s:
        _, kb, _ = await two_minds_paged(s)
        await s.page_spill("b", "b.page", drop=True)
        st = await s.page_stats()
        assert (st.bases, st.pages) == (1, 1)  # a still stands on the base
        await s.page_drop("a")
        assert (await s.page_stats()).charged == 0
        r = await s.slot_restore(2, "b.page")
        assert r["n_tokens"] == len(kb)
        nxt = kb + [5, 6]
        got = await s.complete(prompt=nxt, n_predict=6, slot=2, ignore_eos=True)
        assert got.n_cached == len(kb)
        assert got.tokens == (await s.complete(prompt=nxt, n_predict=6, slot=0, ignore_eos=True)).tokens


def test_a_page_file_base_section_that_is_corrupt_or_missing_is_typed():
    image = PageImage(tokens=list(range(40)), state=b"rest" * 10, base=b"base" * 50, n_base=32,
                      meta={"model": "m"})
    body = b"".join(bytes(p) for p in encode_generation(image, b"g" * 16)[MAIN])
    m = decode_main(body)
    assert bytes(m.base) == b"base" * 50 and m.meta["n_base"] == 32
    flipped = bytearray(body)
    flipped[-3] ^= 0xFF  # inside the base section, the last one
    with pytest.raises(CorruptPageFile, match="base state"):
        decode_main(flipped)
    no_base = PageImage(tokens=list(range(40)), state=b"rest" * 10, meta={"model": "m", "n_base": 32})
    with pytest.raises(CorruptPageFile, match="no base section"):
        decode_main(b"".join(bytes(p) for p in encode_generation(no_base, b"g" * 16)[MAIN]))
    plain = encode_generation(PageImage(tokens=[1, 2], state=b"s", meta={}), b"g" * 16)[MAIN]
    assert decode_main(b"".join(bytes(p) for p in plain)).base is None  # the old format reads as before


@pytest.mark.parametrize("fail_on", ["base", "rest"])
async def test_a_failed_page_out_on_a_base_leaves_the_slot_intact(tiny_model, fail_on):
    async with ActorSystem(cfg(tiny_model)) as s:
        await turn(s, 0, A)
        await turn(s, 1, B)
        held = list(s.slots[0].kv_tokens)
        real_run = s.engine.run

        async def failing_run(job):
            if isinstance(job, J.StateGet) and (job.p1 > 0 if fail_on == "base" else job.p0 > 0):
                return await real_run(J.Fail(reason="copy"))
            return await real_run(job)

        s.slots[0].engine.run = failing_run
        with pytest.raises(EngineError, match="injected engine failure"):
            await s.page_out(0, "a")
        s.slots[0].engine.run = real_run
        st = await s.page_stats()
        assert (st.charged, st.bases, st.reservations) == (0, 0, 0) and await s.page_list() == []
        assert s.slots[0].kv_tokens == held
        again = await s.complete(prompt=held + [5], n_predict=2, slot=0, ignore_eos=True)
        assert again.n_cached == len(held)


async def test_recurrent_hybrid_and_windowed_models_keep_whole_pages(tiny_recurrent_model, tiny_hybrid_model,
                                                                      tiny_swa_model):
    # A windowed cache (SWA, swa_full off) has no cells left below its window: a base made
    # from a sequence far past it, under a short rest, would lack the window's cells.
    windowed = Config(model=tiny_swa_model, slots=2, ctx=2048, batch=64, threads=1, swa_full="off")
    for config in (cfg(tiny_recurrent_model, slots=2), cfg(tiny_hybrid_model, slots=2), windowed):
        async with ActorSystem(config) as s:
            await turn(s, 0, A)
            await turn(s, 1, B)
            out = await s.page_out(0, "a")
            assert "n_base" not in out and (await s.page_stats()).bases == 0


async def test_under_the_ceiling_a_whole_page_spills_before_pages_on_a_shared_base(tiny_model, tmp_path):
    """The placer makes page RAM by spilling the oldest page, except that pages standing on
    a base other pages share go last: their spill would free only their own part."""
    system_prompt = [1] + [3 + (i * 37) % 500 for i in range(299)]

    def alone(k: int) -> list[int]:
        return [1] + [5 + (k * 53 + i * 29) % 490 for i in range(299)]

    minds = [("a", system_prompt + [7]), ("b", system_prompt + [8]), ("c", system_prompt + [9]),
             ("d", system_prompt + [10]), ("z", alone(1)), ("w", alone(2)), ("v", alone(3)), ("u", alone(4))]

    async def run(ceiling: int) -> list[str]:
        async with ActorSystem(Config(model=tiny_model, slots=2, ctx=2048, batch=128, page_ram_bytes=ceiling,
                                      page_dir=str(tmp_path / str(ceiling)))) as s:
            for mind, prompt in minds:
                await s.complete(prompt=prompt, n_predict=2, mind=mind, ignore_eos=True)
            pages = await s.page_list()
            assert all(p.n_base for p in pages if p.page in "abcd")
            return sorted(p.page for p in pages), (await s.page_stats()).charged

    pages, charged = await run(1 << 30)
    assert pages == ["a", "b", "c", "d", "w", "z"]
    # Room for the base, a-d's own parts and one whole page, not two: w's page-out spills.
    pages, _ = await run(charged - 40_000)
    assert pages == ["a", "b", "c", "d", "w"]  # z, whole and newer than a-d, went to its file
    assert (tmp_path / str(charged - 40_000) / "z.page").exists()


async def test_four_new_minds_on_one_prefix_over_two_slots_prefill_it_once(tiny_model, tmp_path):
    """The third mind displaces the first, whose page-out makes the base just then (the
    page store knew of none when the placer asked), while the fourth displaces the second,
    whose cells the third could have shared: she starts from that base all the same."""
    import anyio

    prefix = [1] + [3 + (i * 37) % 500 for i in range(299)]
    out: dict[int, object] = {}
    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=2048, batch=256, page_dir=str(tmp_path),
                                  seed=1)) as s:
        async def one(k: int) -> None:
            own = [5 + (k * 131 + i * 17) % 490 for i in range(20)]
            out[k] = await s.complete(prompt=prefix + own, n_predict=8, mind=f"s{k}", ignore_eos=True)

        async with anyio.create_task_group() as tg:
            for k in range(4):
                tg.start_soon(one, k)
    processed = sorted(r.n_prompt_processed for r in out.values())  # type: ignore[attr-defined]
    assert processed == [20, 20, 20, 320], processed


async def test_a_mind_on_a_base_of_a_full_swa_cache_cut_back_past_its_window_decodes_as_a_fresh_prefill(
        tiny_swa_model):
    """A page on a base is set as two parts, each written without its SWA-masked cells: the
    sliding-window layers hold the base's last window and the rest's, with a hole between,
    which libllama's pos_min does not show. A turn that parts from her history further back
    than a window (an earlier message edited) must not attend across the hole: it was cut
    there and answered other tokens than a fresh prefill (seen with the prompt cache). It
    starts from the base instead, rather than prefilling the whole prompt again."""
    async with ActorSystem(cfg(tiny_swa_model, slots=1, prefix_sharing=True)) as s:
        history = {m: PREFIX + [5 + k * 50 + i for i in range(120)] for k, m in enumerate("ab")}
        for _ in range(2):  # two minds over one slot: each is paged out, the second on a base
            for m in "ab":
                r = await s.complete(prompt=history[m], n_predict=4, mind=m, ignore_eos=True)
                history[m] = history[m] + r.tokens + [9, 10, 11]
        assert (await s.page_stats()).bases == 1
        edited = history["a"][:N_BASE + 40] + [400, 401, 402]  # parts ~90 tokens back from her end
        got = await s.complete(prompt=edited, n_predict=6, mind="a", ignore_eos=True)
        assert s.metrics.snapshot()["full_reprefills_total"] == 0
    async with ActorSystem(cfg(tiny_swa_model, slots=1, prefix_sharing=False)) as s:
        fresh = await s.complete(prompt=edited, n_predict=6, slot=0, ignore_eos=True)
    assert got.tokens == fresh.tokens and got.n_cached == N_BASE
