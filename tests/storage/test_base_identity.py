"""A base file's key is the one identity of a KV state (storage/bases.py, vocabulary/kv_identity.py):
the model and its state's layout, the gene set by content (digest and scale, sorted, never a
load-order id), the scope and the tokens; and a new mind finds a base file only under all of it."""

from __future__ import annotations

from actord.storage import bases as B
from actord.storage.pagefile import PageImage, StoredGene

FP = {"model": "tiny", "n_vocab": 512, "n_ctx_train": 2048, "n_swa": 0, "weights": "w1", "v_trans": False,
      "cache_type_k": "f16", "cache_type_v": "f16"}
TOKENS = list(range(1, 101))


def image(genes=(), scope: str = "", fp=None, n_base: int = 64) -> PageImage:
    meta = {**(fp or FP), **({"scope": scope} if scope else {})}
    return PageImage(tokens=TOKENS, state=b"rest", genes=list(genes), meta=meta, base=b"base", n_base=n_base)


A = StoredGene(path="", scale=1.0, id=1, digest="aaaa")
B_ = StoredGene(path="", scale=0.5, id=2, digest="bbbb")


def test_the_key_is_the_whole_identity_and_never_a_load_order_id():
    key = B.base_key(image([A, B_]))
    # Another daemon loaded the genes in another order: other ids, the same state.
    renumbered = [StoredGene(path="", scale=0.5, id=1, digest="bbbb"), StoredGene(path="", scale=1.0, id=2, digest="aaaa")]
    assert B.base_key(image(renumbered)) == key
    others = [image([A]), image([A, StoredGene(path="", scale=1.0, id=2, digest="bbbb")]), image([A, B_], scope="s1"),
              image([A, B_], fp={**FP, "weights": "w2"}), image([A, B_], fp={**FP, "cache_type_k": "q8_0"}),
              image([A, B_], n_base=65)]
    assert len({B.base_key(i) for i in others} | {key}) == len(others) + 1


def test_a_page_whose_genes_have_no_digest_gets_no_base_file():
    assert B.split(image([StoredGene(path="", scale=1.0, id=1)])) is None
    key, base, page = B.split(image([A], scope="s1"))
    assert base.tokens == TOKENS[:64] and base.meta[B.SCOPE] == "s1" and base.meta[B.GENES] == [["aaaa", 1.0]]
    assert page.n_base == 0 and page.meta[B.FILE_META] == key and page.meta[B.N_META] == 64


def test_the_index_finds_the_longest_base_of_the_askers_identity_only():
    idx = B.BaseIndex()
    for n, scope in ((40, ""), (64, ""), (80, "s1")):
        key, base, _ = B.split(image([A], scope=scope, n_base=n))
        assert idx.add(key, B.entry_of(base.meta, base.tokens))
    genes = [["aaaa", 1.0]]
    prompt = TOKENS + [7]
    assert idx.longest(prompt, FP, genes, "")[1] == 64
    assert idx.longest(prompt, FP, genes, "s1")[1] == 80
    assert idx.longest(prompt, FP, [["bbbb", 1.0]], "") is None  # other genes
    assert idx.longest(prompt, {**FP, "weights": "w2"}, genes, "") is None  # another model
    assert idx.longest(prompt, FP, genes, "s2") is None  # another scope
    assert idx.longest(TOKENS[:50] + [9] * 20, FP, genes, "")[1] == 40  # parts after 50 tokens
    assert idx.longest(TOKENS[:64], FP, genes, "")[1] == 40  # a base is shorter than the prompt


def test_an_entry_that_is_not_what_its_key_says_is_refused():
    key, base, _ = B.split(image([A]))
    idx = B.BaseIndex()
    forged = B.entry_of({**base.meta, B.SCOPE: "s9"}, base.tokens)
    assert not idx.add(key, forged) and idx.entries == {}
