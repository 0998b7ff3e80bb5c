"""Requests that name no mind keep their state across other requests (the prompt cache:
policy/prompt_cache.py, service/prompt_cache.py): a conversation resent one turn on resumes
its state from wherever it went (a slot, a RAM page, a page file), decodes as a fresh prefill
would, never reaches another scope, is bounded, and ends with the process."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from actord.service import tenancy
from actord.service.system import ActorSystem
from actord.vocabulary.config import Config
from actord.vocabulary.names import is_cache_mind

pytestmark = pytest.mark.anyio

SYSTEM = [1] + [3 + (i * 37) % 500 for i in range(160)]
N = 6


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(params=["tiny_model", "tiny_swa_model", "tiny_hybrid_model"])
def model(request) -> str:
    return request.getfixturevalue(request.param)


def cfg(model: str, tmp_path: Path, **kw) -> Config:
    return Config(model=model, **{"slots": 2, "ctx": 4096, "batch": 64, "threads": 1, "page_dir": str(tmp_path),
                                  "prompt_cache_min_tokens": 64, **kw})


def user(k: int, t: int, n: int = 12) -> list[int]:
    return [7 + (k * 31 + t * 17 + i * 5) % 490 for i in range(n)]


async def conversations(s: ActorSystem, n: int, turns: int, **kw) -> list[list[tuple[list[int], object]]]:
    """`n` conversations over the slots, their turns interleaved (each turn resends the whole
    history): per conversation, each turn's (prompt, result)."""
    history = [list(SYSTEM) for _ in range(n)]
    out: list[list[tuple[list[int], object]]] = [[] for _ in range(n)]
    for t in range(turns):
        for k in range(n):
            prompt = history[k] + user(k, t)
            r = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, **kw)
            out[k].append((prompt, r))
            history[k] = prompt + r.tokens
    return out


async def test_a_conversation_resent_one_turn_on_decodes_only_its_new_tokens_as_a_fresh_prefill_would(
        model, tmp_path):
    async with ActorSystem(cfg(model, tmp_path)) as s:
        runs = await conversations(s, 4, 3)  # 4 conversations over 2 slots: each one's state leaves its slot
        found = s.metrics.prompt_cache_turns_total.labels(found="yes")._value.get()
    for k, turns in enumerate(runs):
        for t, (prompt, r) in enumerate(turns[1:], 1):
            previous = turns[t - 1][0] + turns[t - 1][1].tokens
            assert r.n_prompt_processed <= len(prompt) - len(previous) + 1, (k, t)  # its turn, and the reply's last
    assert found == 8
    async with ActorSystem(cfg(model, tmp_path / "fresh", prompt_cache_minds=0, prefix_sharing=False)) as s:
        for turns in runs:
            prompt, r = turns[-1]
            await s.slot_erase(0)
            fresh = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, slot=0)
            assert fresh.n_cached == 0
            assert fresh.tokens == r.tokens


async def test_a_template_that_renders_its_generation_prompt_otherwise_in_history_still_resumes(tiny_model, tmp_path):
    """As DeepSeek R1's template does: each prompt ends `<think>\n`, which the history of the
    next turn does not hold. Two conversations over one slot, so each one's state leaves it."""
    think = [498, 499]
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1)) as s:
        history = [list(SYSTEM) + user(k, 0, 20) for k in range(2)]
        turns = []
        for t in range(3):
            for k in range(2):
                prompt = history[k] + think
                r = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True)
                turns.append((t, prompt, r))
                history[k] = history[k] + r.tokens + user(k, t + 1, 20)
        assert s.metrics.prompt_cache_turns_total.labels(found="yes")._value.get() == 4
    for t, prompt, r in turns:
        if t:  # the reply (its cells follow `think` in hers), the user's turn and `think`: not the history
            assert r.n_prompt_processed == N + 20 + len(think) < r.n_prompt_tokens // 4, (t, r.n_prompt_processed)
    async with ActorSystem(cfg(tiny_model, tmp_path / "fresh", prompt_cache_minds=0, prefix_sharing=False)) as s:
        for _, prompt, r in turns[-2:]:
            await s.slot_erase(0)
            assert (await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, slot=0)).tokens == r.tokens


async def test_a_conversation_with_an_earlier_message_edited_resumes_up_to_the_edit(model, tmp_path):
    """A chat client's edit of an older message (or a regenerate of an older reply) resends
    the conversation up to it, then the new text: the mind resumes what the two share. A
    sibling conversation (the same system prompt, its own first message) never takes her.
    Where a paged-in state cannot be cut back (a sliding window, recurrent state) the edit
    starts a mind of its own instead, from the shared prompt's base or cells."""
    cuts = model.endswith("llama.gguf")
    async with ActorSystem(cfg(model, tmp_path, slots=1)) as s:
        history = [list(SYSTEM) + user(k, 0, 40) for k in range(2)]
        prompts = []
        for t in range(3):
            for k in range(2):  # two conversations over one slot: each leaves it between turns
                r = await s.complete(prompt=history[k], n_predict=N, ignore_eos=True)
                prompts.append(history[k])
                history[k] = history[k] + r.tokens + user(k, t + 1, 40)
        third = prompts[4]  # the first conversation's third turn; her second message edited:
        edited = third[:-20] + user(9, 9, 30)
        r = await s.complete(prompt=edited, n_predict=N, ignore_eos=True)
        assert s.metrics.prompt_cache_turns_total.labels(found="yes")._value.get() == 4 + cuts
        other = await s.complete(prompt=list(SYSTEM) + user(7, 7, 40), n_predict=N, ignore_eos=True)
        assert s.metrics.prompt_cache_turns_total.labels(found="no")._value.get() == 2 + (not cuts) + 1
    if cuts:  # her cells cut back where they part
        assert r.n_cached == len(third) - 20
    assert other.n_cached < len(SYSTEM) + 40
    async with ActorSystem(cfg(model, tmp_path / "fresh", prompt_cache_minds=0, prefix_sharing=False)) as s:
        assert (await s.complete(prompt=edited, n_predict=N, ignore_eos=True, slot=0)).tokens == r.tokens


async def test_a_text_conversation_resent_one_turn_on_resumes_its_state_too(tiny_model, tmp_path):
    system_text = "You are a careful assistant who answers in short sentences. " * 8
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1)) as s:
        first = await s.complete(prompt=system_text + "User: hello there\n", n_predict=N, ignore_eos=True)
        other = await s.complete(prompt="Another conversation entirely, about boats. " * 8, n_predict=N,
                                 ignore_eos=True)  # takes the one slot: the first one's state pages out
        nxt = system_text + "User: hello there\n" + first.content + "\nUser: and then?\n"
        again = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True)
        assert s.metrics.prompt_cache_turns_total.labels(found="yes")._value.get() == 1
    assert other.n_cached == 0
    assert again.n_cached >= first.n_prompt_tokens
    assert again.n_prompt_processed < again.n_prompt_tokens - first.n_prompt_tokens + 2 * N


async def test_two_clients_sending_one_conversation_at_once_each_get_the_fresh_answer(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        first = await s.complete(prompt=SYSTEM + user(1, 0), n_predict=N, ignore_eos=True)
        nxt = SYSTEM + user(1, 0) + first.tokens + user(1, 1)
        got: list[object] = []

        async def one() -> None:
            got.append(await s.complete(prompt=nxt, n_predict=N, ignore_eos=True))

        async with anyio.create_task_group() as tg:  # one runs as the mind, the other as a new one
            tg.start_soon(one)
            tg.start_soon(one)
        minds = {i.mind for i in await s.slot_list()}
    assert [r.tokens for r in got] == [got[0].tokens] * 2  # type: ignore[attr-defined]
    assert len(minds) == 2 and all(is_cache_mind(m or "") for m in minds)
    async with ActorSystem(cfg(tiny_model, tmp_path / "fresh", prompt_cache_minds=0, prefix_sharing=False)) as s:
        assert (await s.complete(prompt=nxt, n_predict=N, ignore_eos=True)).tokens == got[0].tokens  # type: ignore


async def test_a_client_that_hangs_up_mid_turn_leaves_the_conversation_found_by_its_last_prompt(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1)) as s:
        first = await s.complete(prompt=SYSTEM + user(1, 0), n_predict=N, ignore_eos=True)
        nxt = SYSTEM + user(1, 0) + first.tokens + user(1, 1)
        with anyio.move_on_after(30):
            async with anyio.create_task_group() as tg:
                def hang_up(_: object) -> None:
                    tg.cancel_scope.cancel()  # at its first token: the client is gone

                tg.start_soon(lambda: s.complete(prompt=nxt, n_predict=200, ignore_eos=True, stream=True,
                                                 on_token=hang_up))
        again = await s.complete(prompt=nxt + user(1, 2), n_predict=N, ignore_eos=True)
    assert again.n_cached >= len(SYSTEM) + len(user(1, 0)) + N - 1


async def test_without_the_cache_the_same_conversations_prefill_their_history_again(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, prompt_cache_minds=0)) as s:
        runs = await conversations(s, 4, 2)
        assert {i.mind for i in await s.slot_list()} == {None}
    assert any(turns[1][1].n_prompt_processed > len(user(0, 0)) + 1 for turns in runs)


async def test_a_conversation_under_another_scope_or_salt_never_resumes_it(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=3)) as s:
        first = await s.complete(prompt=SYSTEM + user(1, 0), n_predict=N, ignore_eos=True, tenant="key:alice")
        nxt = SYSTEM + user(1, 0) + first.tokens + user(1, 1)
        eve = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, tenant="key:eve")
        salted = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, tenant="key:alice", cache_salt="x")
        alice = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, tenant="key:alice")
    assert eve.n_cached == 0 and salted.n_cached == 0
    assert alice.n_cached == len(SYSTEM) + len(user(1, 0)) + N - 1
    assert eve.tokens == salted.tokens == alice.tokens


async def test_a_client_never_sees_the_caches_minds_by_name(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1)) as s:
        for k in range(2):  # the second pages the first one's mind out
            await s.complete(prompt=SYSTEM + user(k, 0), n_predict=N, ignore_eos=True, tenant="uid:1000")
        assert any(is_cache_mind(i.mind or "") for i in await s.slot_list())  # the embedding host sees them
        seen: list[object] = []

        async def as_the_client() -> None:  # a task of its own, as a front runs each client
            tenancy.enter("uid:1000")
            seen.extend([[i.mind for i in await s.slot_list()], list(await s.page_list())])

        async with anyio.create_task_group() as tg:
            tg.start_soon(as_the_client)
    assert seen == [[None], []]


async def test_past_the_bound_the_oldest_minds_are_forgotten_and_counted(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1, prompt_cache_minds=2)) as s:
        for k in range(6):
            await s.complete(prompt=SYSTEM + user(k, 0), n_predict=N, ignore_eos=True)
        pages = [p.page if not isinstance(p, dict) else p["page"] for p in await s.page_list()]
        evicted = s.metrics.prompt_cache_evicted_total._value.get()
        again = await s.complete(prompt=SYSTEM + user(0, 0) + user(0, 1), n_predict=N, ignore_eos=True)
    assert len([p for p in pages if is_cache_mind(p)]) <= 2
    assert evicted >= 3
    assert again.n_cached <= len(SYSTEM)  # the first one was forgotten: at most the shared prefix


async def test_past_the_page_ram_ceiling_the_caches_pages_spill_before_a_named_minds(tiny_model, tmp_path):
    def own(k: int) -> list[int]:
        return [1] + [3 + (k * 101 + i * 7) % 490 for i in range(150)]

    kw = {"slots": 1, "prefix_sharing": False}
    async with ActorSystem(cfg(tiny_model, tmp_path / "a", **kw)) as s:  # one page's bytes
        await s.complete(prompt=own(0), n_predict=N, ignore_eos=True, mind="ada")
        await s.complete(prompt=own(1), n_predict=N, ignore_eos=True, mind="bob")
        page = (await s.page_stats()).charged
    async with ActorSystem(cfg(tiny_model, tmp_path / "b", page_ram_bytes=page * 5 // 2, **kw)) as s:
        await s.complete(prompt=own(0), n_predict=N, ignore_eos=True, mind="ada")
        for k in (1, 2, 3):  # ada's page, then the first two cache minds': the third passes the ceiling
            await s.complete(prompt=own(k), n_predict=N, ignore_eos=True)
        pages = [p.page if not isinstance(p, dict) else p["page"] for p in await s.page_list()]
        files = [n for n in s.files.index.files if is_cache_mind(n)]
    assert "ada" in pages and len(files) == 1  # the oldest cache mind spilled, not ada, older still


async def test_short_prompts_slot_requests_and_one_off_salts_run_as_before(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        await s.complete(prompt=SYSTEM[:40], n_predict=N, ignore_eos=True)
        await s.complete(prompt=SYSTEM + user(1, 0), n_predict=N, ignore_eos=True, slot=1)
        await s.complete(prompt=SYSTEM + user(2, 0), n_predict=N, ignore_eos=True, cache_salt="nocache.0123")
        assert {i.mind for i in await s.slot_list()} == {None}
        assert s.metrics.prompt_cache_turns_total.labels(found="no")._value.get() == 0


async def test_the_caches_minds_are_not_kept_past_the_process(tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1, page_ram_bytes=1)) as s:  # every page spills
        for k in range(3):
            await s.complete(prompt=SYSTEM + user(k, 0), n_predict=N, ignore_eos=True)
        await s.complete(prompt=SYSTEM + user(9, 0), n_predict=N, ignore_eos=True, mind="ada")
        spilled = [n for n in s.files.index.files if is_cache_mind(n)]
        out = await s.shutdown(1.0)
    assert spilled  # the cache's pages spilled as any page does
    assert out.get("not_persisted", 0) == 0  # the stop wrote ada and left the cache's minds
    assert (tmp_path / "ada.page").exists()
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1)) as s:
        assert [n for n in s.files.index.files if is_cache_mind(n)] == []
        assert "ada.page" in s.files.index.files
    assert not [p for p in tmp_path.iterdir() if is_cache_mind(p.name)]


async def test_a_start_removes_the_files_of_minds_an_earlier_process_made_for_unnamed_requests(tiny_model, tmp_path):
    """The prompt cache's and the Responses front's anonymous conversations' (their bounds
    are kept in memory: left over, they would pile up a bound's worth per restart); a
    client's mind, however named, keeps her file."""
    from actord.vocabulary.names import CACHE_MIND

    anonymous = "r-" + "0123456789abcdef" * 2
    names = [CACHE_MIND + "x", anonymous, anonymous + "@@" + "ab" * 8, "r-ada", "ada"]
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1)) as s:
        await s.complete(prompt=[1, 17, 40, 99], n_predict=2, slot=0)
        image = await _saved(s)
        for n in names:
            await s.files.publish(f"{n}.page", image)
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1)) as s:
        assert sorted(n for n in s.files.index.files if n.endswith(".page")) == ["ada.page", "r-ada.page"]


async def _saved(s):
    """One page image of slot 0's state, as a save writes it."""
    from actord.storage.osfs import OsFs
    from actord.storage.publish import read_generation

    await s.slot_save(0, "template.page")
    image = read_generation(s.files.root, "template.page", OsFs())
    await s.files.remove("template.page")
    return image
