"""The page store's pool of warm state buffers: what it reuses, and its bound under the page
RAM ceiling (`charged - earmarked + pooled <= ceiling` at every message boundary)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from actord.serving.kernel import Dispatcher
from actord.serving.buffer_pool import PAGE, BufferPool, buffer_of, capacity_for, fits
from actord.serving.page_store import Page, PageStore
from actord.engine.jobs import HostBuffer
from actord.vocabulary.errors import PageNotFound, PageRamExceeded
from actord.vocabulary.metrics import Metrics


def buf(n: int) -> HostBuffer:
    return HostBuffer(np.empty(n, dtype=np.uint8))


def test_a_fresh_buffer_has_headroom_and_serves_a_grown_state() -> None:
    n = 20 << 20
    cap = capacity_for(n)
    assert cap % PAGE == 0 and n + n // 16 <= cap < n + n // 16 + PAGE
    assert fits(cap, n + n // 20)  # the mind grew by a turn: its old buffer still serves
    assert not fits(cap, n + n // 10)
    assert not fits(4 * n, n)  # a large buffer is not spent on a small state


def test_take_gives_the_smallest_buffer_that_fits() -> None:
    p = BufferPool()
    small, mid, big = buf(1000 * PAGE), buf(1050 * PAGE), buf(4000 * PAGE)
    for b in (big, mid, small):
        assert p.give(b, room=1 << 40)
    assert p.take(1000 * PAGE) is small and p.take(1000 * PAGE) is mid
    assert p.take(1000 * PAGE) is None and p.misses == 1 and p.hits == 2
    assert p.bytes == big.capacity


def test_give_and_trim_keep_the_pool_within_its_room() -> None:
    p = BufferPool()
    a, b = buf(10 * PAGE), buf(20 * PAGE)
    assert p.give(a, room=25 * PAGE)
    assert not p.give(b, room=25 * PAGE) and p.bytes == 10 * PAGE  # would not fit beside a
    assert p.give(b, room=30 * PAGE)
    p.trim(20 * PAGE)  # oldest first
    assert p.bytes == 20 * PAGE and p.take(20 * PAGE) is b


def test_only_an_engine_buffer_is_pooled() -> None:
    arr = np.empty(8192, dtype=np.uint8)
    assert buffer_of(memoryview(arr)[:5000]).array is arr  # type: ignore[union-attr]
    assert buffer_of(bytearray(10)) is None and buffer_of(memoryview(b"x")) is None
    assert buffer_of(memoryview(arr[10:])) is None  # a view of a view: not the whole buffer


# ---- in the page store -----------------------------------------------------------------


def store(ceiling: int) -> PageStore:
    return PageStore(Dispatcher(), ceiling, Metrics())


def page_out(s: PageStore, name: str, n_state: int, extra: int = 100) -> Page:
    adm = s.admit_state(name, n_state + extra, n_state)
    arr = adm.into.array if adm.into is not None else np.empty(max(adm.capacity, n_state), dtype=np.uint8)
    page = Page(gen=adm.reservation, name=name, n_bytes=adm.n_bytes, state=memoryview(arr)[:n_state], tokens=[])
    s.commit(adm.reservation, page)
    return page


def bound_holds(s: PageStore) -> bool:
    return s.effective + s.pool.bytes <= s.ceiling


def test_a_page_in_feeds_the_next_page_out_its_warm_buffer() -> None:
    s = store(1 << 30)
    first = page_out(s, "ada", 5 << 20)
    taken = s.take("ada")
    s.release(taken.gen)  # page_in done: the page is gone, its buffer stays warm
    st = s.stats()
    assert st.charged == 0 and st.pooled == capacity_for(5 << 20) and st.pool_buffers == 1
    second = page_out(s, "bob", (5 << 20) + 4096)
    assert second.state.obj is first.state.obj  # the same memory, already faulted in
    assert s.stats().pool_hits == 1 and s.stats().pooled == 0
    # The charge is the buffer's bytes: the headroom counts.
    assert second.n_bytes == 100 + capacity_for(5 << 20)


def test_dropped_and_replaced_pages_feed_the_pool_too() -> None:
    s = store(1 << 30)
    a = page_out(s, "ada", 1 << 20)
    s.drop("ada")
    assert s.pool.bytes == a.state.obj.nbytes
    b = page_out(s, "bob", 1 << 20)
    page_out(s, "bob", 2 << 20)  # replaced: the old generation's buffer goes to the pool
    assert s.pool.bytes == b.state.obj.nbytes


def test_a_held_page_feeds_nothing_until_its_last_holder_lets_go() -> None:
    s = store(1 << 30)
    page_out(s, "ada", 1 << 20)
    held = s.spill_begin("ada")
    s.drop("ada")
    assert s.pool.bytes == 0  # a spill still writes it
    s.spill_end(held.gen, drop=False)
    assert s.pool.bytes == held.state.obj.nbytes


def test_admission_trims_the_pool_before_it_refuses_a_page() -> None:
    ceiling = 4 << 20
    s = store(ceiling)
    page_out(s, "a", 1 << 20)
    page_out(s, "b", 1 << 20)
    s.drop("a")
    s.drop("b")
    assert s.pool.bytes > 2 << 20
    page_out(s, "c", 3 << 20)  # fits the ceiling only once the pool lets its buffers go
    assert bound_holds(s) and s.pool.bytes <= ceiling - s.effective


@pytest.mark.parametrize("pooled", [False, True])
def test_the_exact_size_is_tried_when_the_slack_would_not_fit(pooled: bool) -> None:
    n = 100 * PAGE
    s = store(n + n // 8 + 100)
    if pooled:
        assert s.pool.give(HostBuffer(np.empty(n + n // 8, dtype=np.uint8)), room=s.ceiling)
        extra = 200  # the pooled buffer's slack would pass the ceiling
    else:
        extra = n // 16 + 200  # a fresh buffer's headroom would
    adm = s.admit_state("m", n + extra, n)
    assert adm.into is None and adm.n_bytes == n + extra and adm.capacity == n and bound_holds(s)


def test_the_pool_stays_within_the_ceiling_under_any_sequence_of_moves() -> None:
    rng = random.Random(7)
    ceiling = 64 * PAGE * 16
    s = store(ceiling)
    taken: list[Page] = []
    spilling: list[Page] = []
    for _ in range(3000):
        op = rng.choice(["out", "out", "take", "release", "give_back", "drop", "spill", "spill_end", "cancel"])
        name = rng.choice("abcd")
        try:
            if op == "out":
                page_out(s, name, rng.randrange(1, 64) * PAGE, extra=rng.randrange(0, 4096))
            elif op == "cancel":
                n = rng.randrange(1, 64) * PAGE
                s.cancel(s.admit_state(name, n + 10, n).reservation)
            elif op == "take":
                taken.append(s.take(name))
            elif op == "release" and taken:
                s.release(taken.pop(0).gen)
            elif op == "give_back" and taken:
                s.give_back(taken.pop(0).gen)
            elif op == "drop":
                s.drop(name)
            elif op == "spill":
                spilling.append(s.spill_begin(name))
            elif op == "spill_end" and spilling:
                s.spill_end(spilling.pop(0).gen, drop=rng.random() < 0.5)
        except (PageNotFound, PageRamExceeded):
            pass
        assert bound_holds(s), (op, s.stats())
        assert s.charged == s.live_bytes()
    assert s.pool.hits > 100  # the workload did reuse buffers


@pytest.mark.anyio
async def test_page_moves_through_the_actors_reuse_the_buffer(tiny_model: str, tmp_path) -> None:
    """page_out, page_in, page_out again: the second page's state is in the first's buffer."""
    from actord.vocabulary.config import Config
    from actord.service.system import ActorSystem

    async with ActorSystem(Config(model=tiny_model, slots=2, ctx=512, batch=64, page_dir=str(tmp_path))) as s:
        await s.complete(prompt=[1] + list(range(300, 360)), n_predict=4, slot=0, ignore_eos=True)
        await s.page_out(0, "m")
        first = s.pages.gens[s.pages.names["m"]].page.state.obj
        await s.page_in(1, "m")
        assert (await s.page_stats()).pooled == first.nbytes
        await s.page_out(1, "m")
        again = s.pages.gens[s.pages.names["m"]].page
        assert again.state.obj is first
        st = await s.page_stats()
        assert st.pool_hits == 1 and st.pooled == 0 and st.charged == again.n_bytes
