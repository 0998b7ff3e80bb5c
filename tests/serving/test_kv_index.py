"""The sequence index: what each slot published, and the questions a slot asks of it
instead of reading another slot (serving/kv_index.py). Pure: no engine, no actors."""

from __future__ import annotations

from actord.policy.checkpoint_records import SlotCheckpoint
from actord.serving.kv_index import MIN_SHARE, Held, KvIndex
from actord.serving.start_plan import plan_start

PLAIN = ((), "")
GENE_A = (((1, 1.0),), "")
TENANT_B = ((), "b")
PROMPT = list(range(100, 200))


def held(slot: int, tokens: list[int], lineage=PLAIN, *, quiet: bool = True, running: list[int] | None = None,
         epoch: int = 0, checkpoints=()) -> Held:
    return Held(slot=slot, seq=slot, tokens=tokens, lineage=lineage, epoch=epoch, quiet=quiet,
                steady=quiet or running is not None, running=running, checkpoints=tuple(checkpoints))


def index(*records: Held, n: int = 4) -> KvIndex:
    ix = KvIndex(n)
    for h in records:
        ix.publish(h)
    return ix


def test_the_best_source_is_the_steady_peer_holding_most_under_the_same_lineage():
    ix = index(held(0, []), held(1, PROMPT[:60]), held(2, PROMPT[:90], epoch=7), held(3, PROMPT[:95], GENE_A))
    src, n = ix.best_source(0, PROMPT, PLAIN, own=0)
    assert src is not None and (src.slot, src.epoch, n) == (2, 7, 90)  # slot 3's cells are another gene set's


def test_no_source_is_a_busy_peer_a_peer_of_another_tenant_or_the_asker_itself():
    ix = index(held(0, PROMPT[:99]), held(1, PROMPT[:99], quiet=False), held(2, PROMPT[:99], TENANT_B))
    assert ix.best_source(0, PROMPT, PLAIN, own=0) == (None, 0)


def test_a_peer_running_an_enrolled_request_holds_steady_and_may_be_shared():
    ix = index(held(0, []), held(1, PROMPT[:80], quiet=False, running=PROMPT[:80] + [7]))
    src, n = ix.best_source(0, PROMPT, PLAIN, own=0)
    assert src is not None and src.slot == 1 and n == 80


def test_a_share_must_beat_what_the_asker_holds_by_min_share():
    ix = index(held(0, PROMPT[:50]), held(1, PROMPT[:50 + MIN_SHARE - 1]))
    assert ix.best_source(0, PROMPT, PLAIN, own=50) == (None, 0)
    ix.publish(held(1, PROMPT[:50 + MIN_SHARE]))
    assert ix.best_source(0, PROMPT, PLAIN, own=50)[1] == 50 + MIN_SHARE


def test_the_shared_point_ignores_steadiness_but_not_lineage_and_is_zero_below_min_share():
    ix = index(held(1, PROMPT[:70], quiet=False), held(2, PROMPT[:90], TENANT_B))
    assert ix.shared_point(0, PROMPT, PLAIN) == 70
    assert ix.shared_point(0, PROMPT[:MIN_SHARE - 1] + [0], PLAIN) == 0


def test_the_best_checkpoint_is_the_furthest_below_where_the_prompt_parts_from_its_peer():
    cks = [SlotCheckpoint(pos=40, data=bytearray(b"a")), SlotCheckpoint(pos=64, data=bytearray(b"b")),
           SlotCheckpoint(pos=96, data=bytearray(b"c"))]
    ix = index(held(1, PROMPT[:80] + [1] * 30, checkpoints=cks))
    src, ck = ix.best_checkpoint(0, PROMPT, PLAIN, own=0)
    assert src is not None and ck is not None and (src.slot, ck.pos) == (1, 64)  # 96 is past the parting at 80


def test_peer_shared_counts_the_prompt_a_peer_runs_before_its_tokens_catch_up():
    ix = index(held(1, [], quiet=False, running=PROMPT[:70]))
    assert ix.peer_shared(0, PROMPT, PLAIN) == 70


def test_a_fork_source_must_be_quiet_and_hold_exactly_the_tokens():
    ix = index(held(1, PROMPT[:10]), held(2, PROMPT[:10], quiet=False, running=PROMPT[:10]))
    assert ix.quiet_with(1, PROMPT[:10]) is not None
    assert ix.quiet_with(1, PROMPT[:9]) is None
    assert ix.quiet_with(2, PROMPT[:10]) is None  # running: its cells grow
    assert ix.of(9) is None


def test_placement_measures_only_a_slots_cells_under_the_requests_lineage():
    ix = index(held(0, PROMPT[:50]), held(1, PROMPT[:50], GENE_A))
    assert ix.prefix_held(0, PROMPT, PLAIN) == 50
    assert ix.prefix_held(1, PROMPT, PLAIN) == 0


def test_the_start_plan_keeps_its_own_cells_when_they_leave_less_than_min_share_to_gain():
    ix = index(held(1, PROMPT[:99]))
    plan = plan_start(ix, 0, PROMPT, PLAIN, own=len(PROMPT) - MIN_SHARE, cells=True, checkpoints=True)
    assert (plan.how, plan.n, plan.src) == ("own", len(PROMPT) - MIN_SHARE, None)


def test_the_start_plan_shares_cells_first_and_falls_back_to_a_checkpoint_without_them():
    cks = [SlotCheckpoint(pos=64, data=bytearray(b"x"))]
    ix = index(held(1, PROMPT[:90], checkpoints=cks))
    cells = plan_start(ix, 0, PROMPT, PLAIN, own=0, cells=True, checkpoints=True)
    assert (cells.how, cells.n) == ("cells", 90)
    ckpt = plan_start(ix, 0, PROMPT, PLAIN, own=0, cells=False, checkpoints=True)
    assert (ckpt.how, ckpt.n, ckpt.checkpoint) == ("checkpoint", 64, cks[0])
    assert plan_start(ix, 0, PROMPT, PLAIN, own=0, cells=False, checkpoints=False).how == "own"


def test_the_start_plan_never_reaches_across_a_lineage():
    ix = index(held(1, PROMPT[:90], TENANT_B, checkpoints=[SlotCheckpoint(pos=64, data=bytearray(b"x"))]))
    assert plan_start(ix, 0, PROMPT, PLAIN, own=0, cells=True, checkpoints=True).how == "own"


def test_base_files_are_asked_of_the_index_under_their_scope_fingerprint_and_genes():
    from actord.storage.bases import BaseEntry, BaseIndex, identity_key

    files = BaseIndex()  # the page files' records (storage/files.py keeps them)
    fp = {"model": "m", "weights": "w"}
    for scope, genes, n in (("", [], 40), ("", [], 60), ("b", [], 80), ("", [["d", 1.0]], 90)):
        entry = BaseEntry(tokens=PROMPT[:n], fingerprint=fp, genes=genes, scope=scope)
        assert files.add(identity_key(fp, genes, scope, entry.tokens), entry)
    ix = KvIndex(2, base_files=files)
    key, n = ix.base_file_for(PROMPT, "", fp, [])
    assert n == 60 and files.entries[key].tokens == PROMPT[:60]  # the longest of her scope and genes
    assert ix.base_file_for(PROMPT, "", None, None)[1] == 90  # a hint: any genes of the scope
    assert ix.base_file_for(PROMPT, "b")[1] == 80 and ix.base_file_for(PROMPT, "c") is None
    assert ix.base_file_for(PROMPT, "", {"model": "other"}, []) is None  # another model's
    assert ix.base_file_for(PROMPT[:60], "", fp, []) == (ix.base_file_for(PROMPT[:41], "", fp, [])[0], 40)
    assert KvIndex(2).base_file_for(PROMPT, "") is None  # page_file_bases off: no start from a file
