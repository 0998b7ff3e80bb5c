"""One identity for every KV state (vocabulary/kv_identity.py): cells are reused only under the
whole key (the gene set by content, the tenant scope, the tokens), so sharing never changes
output and never crosses a tenant.

Each case runs with prefix sharing on and compares greedy tokens with a fresh prefill of the
same prompt under the same genes (a system that never held anything else)."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.vocabulary.errors import GenesMissing, InvalidParams
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio

SYSTEM = [1] + [3 + (i * 37) % 500 for i in range(160)]
N = 8


def own(k: int, n: int = 6) -> list[int]:
    return [7 + (k * 11 + i * 5) % 490 for i in range(n)]


@pytest.fixture
def anyio_backend():
    return "asyncio"


MODELS = ["tiny_model", "tiny_swa_model", "tiny_hybrid_model"]


@pytest.fixture(params=MODELS)
def model(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture
def loras(model, models_dir) -> list[str]:
    from actord.testing.models import write_tiny_lora

    stem = model.rsplit("/", 1)[-1]
    return [str(write_tiny_lora(models_dir / f"ident-{stem}-{seed}.gguf", model, seed=seed, strength=2.0))
            for seed in (31, 32)]


def cfg(model: str, tmp_path=None, **kw) -> Config:
    extra = {"page_dir": str(tmp_path)} if tmp_path is not None else {}
    return Config(model=model, **{"slots": 2, "ctx": 2048, "batch": 64, "threads": 1, **extra, **kw})


def genes_of(*pairs: tuple[int, float]) -> list[dict]:
    return [{"id": g, "scale": s} for g, s in pairs]


async def fresh(model: str, loras: list[str], prompt: list[int], lora_idx: int | None) -> list[int]:
    """What a prefill of the whole prompt gives, in a system that held nothing before."""
    async with ActorSystem(cfg(model)) as s:
        genes = []
        if lora_idx is not None:
            ids = [(await s.gene_load(p)).id for p in loras]
            genes = genes_of((ids[lora_idx], 1.0))
        r = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, genes=genes)
        assert r.n_cached == 0
        return r.tokens


async def test_a_slot_whose_genes_change_between_turns_prefills_under_the_new_genes(model, loras):
    p1 = SYSTEM + own(1)
    async with ActorSystem(cfg(model)) as s:
        a = (await s.gene_load(loras[0])).id
        r1 = await s.complete(prompt=p1, n_predict=N, ignore_eos=True, slot=0)
        p2 = p1 + r1.tokens + [5]
        r2 = await s.complete(prompt=p2, n_predict=N, ignore_eos=True, slot=0, genes=genes_of((a, 1.0)))
    assert r2.n_cached == 0  # every cell it held was computed without the gene
    assert r2.tokens == await fresh(model, loras, p2, 0)


async def test_new_minds_under_another_gene_set_share_nothing_with_the_same_prompt(model, loras):
    prompt = SYSTEM + own(2)
    async with ActorSystem(cfg(model)) as s:
        a = (await s.gene_load(loras[0])).id
        await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, mind="ada")
        await s.page_out(0, "ada") if (await s.slot_list())[0].mind == "ada" else await s.page_out(1, "ada")
        bob = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, mind="bob", genes=genes_of((a, 1.0)))
        cy = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, mind="cy", genes=genes_of((a, 0.5)))
    assert bob.n_cached == 0 and cy.n_cached == 0
    assert bob.tokens == await fresh(model, loras, prompt, 0)


async def test_two_salts_or_two_tenants_never_share_the_same_prompt(model):
    prompt = SYSTEM + own(3)
    async with ActorSystem(cfg(model, slots=5)) as s:  # every mind stays in a slot
        first = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, mind="alice", cache_salt="team-a")
        salted = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, mind="eve", cache_salt="team-b")
        tenant = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, mind="mallory", tenant="uid:1001")
        plain = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, mind="oscar")
        same = await s.complete(prompt=prompt + [9], n_predict=N, ignore_eos=True, mind="trent", cache_salt="team-a")
    assert (first.n_cached, salted.n_cached, tenant.n_cached, plain.n_cached) == (0, 0, 0, 0)
    assert first.tokens == salted.tokens == tenant.tokens == plain.tokens
    assert same.n_cached >= len(SYSTEM)  # the same salt shares as before


async def test_a_guess_at_another_scopes_prompt_reads_nothing_from_n_cached(tiny_model):
    secret = SYSTEM + own(4, 40)
    async with ActorSystem(cfg(tiny_model, slots=3)) as s:
        await s.complete(prompt=secret, n_predict=2, ignore_eos=True, mind="alice", tenant="key:alice")
        wrong = await s.complete(prompt=SYSTEM + own(6, 40) + own(5), n_predict=2, ignore_eos=True, mind="eve",
                                 tenant="key:eve")
        right = await s.complete(prompt=secret + own(5), n_predict=2, ignore_eos=True, mind="eve2", tenant="key:eve")
    # The right guess caches only what eve's own scope held (her wrong guess's SYSTEM), as
    # a wrong one would: nothing of alice's 40 secret tokens shows.
    assert wrong.n_cached == 0 and right.n_cached == len(SYSTEM)


async def test_a_tenants_mind_name_never_reaches_another_tenants_mind(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        a1 = await s.complete(prompt=SYSTEM + own(7), n_predict=N, ignore_eos=True, mind="ada", tenant="key:a")
        b = await s.complete(prompt=SYSTEM + own(7), n_predict=N, ignore_eos=True, mind="ada", tenant="key:b")
        nxt = SYSTEM + own(7) + a1.tokens + own(8)
        a2 = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, mind="ada", tenant="key:a")
        minds = {i.mind for i in await s.slot_list()} | {p["page"] if isinstance(p, dict) else p.page
                                                         for p in await s.page_list()}
    assert b.n_cached == 0
    assert a2.n_cached == len(SYSTEM) + 6 + N - 1  # her state was not written over by the other "ada"
    assert "ada" not in minds  # each is kept under its own scope


async def test_a_bad_cache_salt_is_refused_by_name_before_any_work(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        for salt in ("", "x" * 257, "a b", "ü", "a\nb"):
            with pytest.raises(InvalidParams) as e:
                await s.complete(prompt=SYSTEM, n_predict=1, cache_salt=salt)
            assert e.value.data.get("param") == "cache_salt"
        with pytest.raises(InvalidParams):
            await s.complete(prompt=SYSTEM, n_predict=1, mind="a@@b")
        assert all(i.n_tokens == 0 for i in await s.slot_list())


async def test_a_file_restores_under_the_same_genes_loaded_in_another_order(model, loras, tmp_path):
    prompt = SYSTEM + own(9)
    async with ActorSystem(cfg(model, tmp_path)) as s:
        ids = [(await s.gene_load(p)).id for p in loras]  # A = 1, B = 2
        r1 = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, slot=0, genes=genes_of((ids[1], 1.0)))
        await s.slot_save(0, "b.page")
    nxt = prompt + r1.tokens + own(10)
    async with ActorSystem(cfg(model, tmp_path)) as s:
        ids = [(await s.gene_load(p)).id for p in reversed(loras)]  # now B = 1, A = 2
        await s.slot_restore(0, "b.page")
        assert (await s.slot_list())[0].genes[0].id == ids[0]  # B, found by content
        r2 = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, slot=0, genes=genes_of((ids[0], 1.0)))
        assert r2.n_cached > len(prompt)
        wrong = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, slot=1, genes=genes_of((ids[1], 1.0)))
        assert wrong.n_cached == 0  # A's request never starts from B's cells
    assert r2.tokens == await fresh(model, loras, nxt, 1)


async def test_a_file_whose_gene_is_not_loaded_is_refused_and_the_slot_is_untouched(tiny_model, tmp_path, models_dir):
    from actord.testing.models import write_tiny_lora

    lora = str(write_tiny_lora(models_dir / "ident-missing.gguf", tiny_model, seed=33))
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        g = (await s.gene_load(lora)).id
        await s.complete(prompt=SYSTEM + own(11), n_predict=2, ignore_eos=True, slot=0, genes=genes_of((g, 1.0)))
        await s.slot_save(0, "g.page")
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        await s.complete(prompt=SYSTEM, n_predict=1, ignore_eos=True, slot=0)
        with pytest.raises(GenesMissing):
            await s.slot_restore(0, "g.page")
        assert (await s.slot_list())[0].n_tokens == len(SYSTEM)  # refused before anything changed


async def test_a_scoped_page_spilled_and_restored_keeps_its_scope(tiny_model, tmp_path):
    prompt = SYSTEM + own(12)
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        r1 = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, slot=0, cache_salt="s1")
        await s.page_out(0, "p")
        await s.page_spill("p", "p.page", drop=True)
    nxt = prompt + r1.tokens + own(13)
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        await s.slot_restore(0, "p.page")
        other = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, slot=1)
        await s.slot_restore(0, "p.page")
        mine = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, slot=0, cache_salt="s1")
    assert other.n_cached == 0
    assert mine.n_cached == len(prompt) + N - 1  # all it held: the prompt and the reply but its last token
    assert mine.tokens == other.tokens


async def test_a_new_mind_on_a_base_whose_owners_were_paged_out_dropped_or_spilled_decodes_as_fresh(
        tiny_model, tmp_path):
    async with ActorSystem(cfg(tiny_model, tmp_path, slots=1)) as s:
        for mind, k in (("ada", 20), ("bob", 21)):  # one slot: each pages the other out
            await s.complete(prompt=SYSTEM + own(k), n_predict=N, ignore_eos=True, mind=mind)
        await s.complete(prompt=SYSTEM + own(22), n_predict=N, ignore_eos=True, mind="eve")
        assert (await s.page_stats()).bases == 1
        await s.page_drop("ada")
        cy = await s.complete(prompt=SYSTEM + own(23), n_predict=N, ignore_eos=True, mind="cy")
        await s.page_spill("bob", "bob.page", drop=True)
        await s.page_spill("eve", "eve.page", drop=True)
        dave = await s.complete(prompt=SYSTEM + own(24), n_predict=N, ignore_eos=True, mind="dave")
    assert cy.n_cached == len(SYSTEM)  # from the base: its owners gone from slots, one page dropped
    assert cy.tokens == await fresh(tiny_model, [], SYSTEM + own(23), None)
    assert dave.tokens == await fresh(tiny_model, [], SYSTEM + own(24), None)


async def test_a_request_addressed_to_a_slot_from_another_scope_never_writes_over_her_state(tiny_model):
    async with ActorSystem(cfg(tiny_model)) as s:
        a1 = await s.complete(prompt=SYSTEM + own(30), n_predict=N, ignore_eos=True, mind="ada", tenant="key:a")
        other = await s.complete(prompt=SYSTEM + own(31), n_predict=N, ignore_eos=True, slot=a1.slot, tenant="key:b")
        assert other.n_cached == 0
        nxt = SYSTEM + own(30) + a1.tokens + own(32)
        a2 = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, mind="ada", tenant="key:a")
    assert a2.n_cached == len(SYSTEM) + 6 + N - 1  # her state was kept (to her page) before the slot was reused


def test_a_tenants_page_file_path_is_scoped_in_every_folder_so_none_takes_another_tenants_name():
    from actord.vocabulary.kv_identity import client_file, scope_of, scoped_file, scoped_mind

    bob = scope_of("key:bob", None)
    # bob's folder "ada.page" is not the default tenant's mind ada's file, nor a folder of hers.
    kept = scoped_file("ada.page/x.page", bob)
    assert kept == f"{scoped_mind('ada.page', bob)}/{scoped_mind('x', bob)}.page"
    assert not kept.startswith("ada.page/") and kept.split("/")[0] != scoped_file("ada.page", bob)
    assert client_file(kept, bob) == "ada.page/x.page"
    assert scoped_file("ada.page/x.page", "") == "ada.page/x.page"  # the default scope keeps names
    # Another scope's path reads back as kept, unnamed by this one.
    assert client_file(kept, scope_of("key:eve", None)) == kept


async def test_a_mind_whose_gene_was_unloaded_under_her_names_it_by_content_and_is_never_refused(
        tiny_model, tmp_path, models_dir):
    """Her state, paged out and spilled after its gene was unloaded, still names the gene by
    content (the slot kept the digest it was granted); her next turn without that gene starts
    another way instead of failing for ever, and a daemon that loads the gene again restores her."""
    from actord.storage.publish import read_generation
    from actord.storage.osfs import OsFs
    from actord.testing.models import write_tiny_lora

    lora = str(write_tiny_lora(models_dir / "ident-unloaded.gguf", tiny_model, seed=35))
    prompt = SYSTEM + own(14)
    one = cfg(tiny_model, tmp_path, slots=1)
    async with ActorSystem(one) as s:
        info = await s.gene_load(lora)
        r1 = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, mind="x", genes=genes_of((info.id, 1.0)))
        await s.gene_unload(info.id)
        await s.complete(prompt=SYSTEM + own(15), n_predict=1, ignore_eos=True, mind="y")  # x to her page
        await s.page_spill("x", "x.page", drop=True)
        kept = read_generation(tmp_path, "x.page", OsFs())
        assert [g.digest for g in kept.genes] == [info.digest] and info.digest
        plain = await s.complete(prompt=prompt, n_predict=1, ignore_eos=True, mind="x")  # not GenesMissing
        assert plain.n_cached < len(prompt)
        await s.slot_erase(0)
    nxt = prompt + r1.tokens + own(16)
    async with ActorSystem(one) as s:
        g = (await s.gene_load(lora)).id
        await s.slot_restore(0, "x.page")
        back = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, slot=0, genes=genes_of((g, 1.0)))
        assert back.n_cached >= len(prompt)


async def test_the_index_holds_each_slots_lineage_as_the_slot_sets_it(tiny_model, tmp_path):
    """A request's begin sets its slot's lineage after the cut (slot.py `_begin`), a page-in
    after the tokens: the index every reuse asks must hold each change at once, or a peer
    would take those cells under another scope or other genes."""
    async with ActorSystem(cfg(tiny_model, tmp_path)) as s:
        await s.complete(prompt=SYSTEM + own(17), n_predict=2, ignore_eos=True, slot=0, cache_salt="s1")
        m = s.slots[0].memory
        assert m.peers.index.of(0).lineage == m.lineage and m.lineage[1] != ""
        m.lineage = ((), "")
        assert m.peers.index.of(0).lineage == ((), "")


async def test_a_gene_loaded_again_gets_its_old_id_and_her_page_resumes_with_it(model, loras):
    """An id names one content: after an unload, another adapter gets a new id, and the
    same adapter loaded again gets its old one back, so the mind paged out under it resumes
    her cells (equal to a fresh prefill) instead of prefilling them again."""
    prompt = SYSTEM + own(18)
    async with ActorSystem(cfg(model, slots=1)) as s:
        a = await s.gene_load(loras[0])
        r1 = await s.complete(prompt=prompt, n_predict=N, ignore_eos=True, mind="x", genes=genes_of((a.id, 1.0)))
        await s.complete(prompt=SYSTEM + own(19), n_predict=1, ignore_eos=True, mind="y")  # x to her page
        await s.gene_unload(a.id)
        b = await s.gene_load(loras[1])
        assert b.id != a.id
        again = await s.gene_load(loras[0])
        assert again.id == a.id and again.digest == a.digest
        nxt = prompt + r1.tokens + own(20, 2)
        back = await s.complete(prompt=nxt, n_predict=N, ignore_eos=True, mind="x", genes=genes_of((a.id, 1.0)))
    assert back.n_cached >= len(prompt)
    assert back.tokens == await fresh(model, loras, nxt, 0)
