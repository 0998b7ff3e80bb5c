"""Crash-safe publication: every step, failed or abandoned, leaves one whole generation.

The matrix tests run one clean publication with a recording FaultyFs, then for each call it
made (every write, fsync, directory sync, rename, ..., and every named step) run it again
with that one call failing, and separately with the publisher abandoned just before and just
after it. A reader afterwards must find the old generation or the new one, whole, and no
stage or record left behind.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actord.vocabulary.errors import CorruptPageFile, FileNotFound, PathRefused, StorageError
from actord.storage import pagefile as pf
from actord.storage.osfs import Fault, FaultyFs, OsFs, SimulatedCrash
from actord.policy.checkpoint_records import StoredCheckpoint
from actord.storage.pagefile import PageImage, StoredGene
from actord.storage.paths import confine
from actord.storage.publish import (
    RECORD_PREFIX,
    STAGE_LOCK,
    STAGE_PREFIX,
    publish_generation,
    read_generation,
)
from tests.storage.images import image_fields

NAME = "mind.page"


def image_a() -> PageImage:
    """The old generation: every sidecar."""
    return PageImage(
        tokens=list(range(50)),
        state=b"A" * 700,
        checkpoints=[StoredCheckpoint(pos=10, data=b"a1" * 20), StoredCheckpoint(pos=30, data=b"a2" * 20)],
        genes=[StoredGene(path="old.gguf", scale=0.5, id=1)],
        draft=b"old-draft" * 10,
        meta={"n_ctx": 1024, "model": "fp:a", "resume_raw_lcp": 5},
    )


def image_b() -> PageImage:
    """The new generation: no checkpoints (its .ckpt must move away), other genes and draft."""
    return PageImage(
        tokens=list(range(100, 180)),
        state=b"B" * 900,
        checkpoints=[],
        genes=[StoredGene(path="new.gguf", scale=1.0, id=2), StoredGene(path="x.gguf", scale=0.1, id=3)],
        draft=b"new-draft" * 12,
        meta={"n_ctx": 2048, "model": "fp:b", "resume_raw_lcp": 0},
    )


def image_lean() -> PageImage:
    """An old generation with no sidecars at all (the new one adds them)."""
    return PageImage(tokens=[1, 2, 3], state=b"L" * 300, meta={"model": "fp:lean"})


# scenario -> (old generation or None, new generation)
SCENARIOS = {
    "drop_ckpt": (image_a, image_b),
    "add_sidecars": (image_lean, image_a),
    "first": (None, image_a),
}


def setup_root(base: Path, scenario: str) -> Path:
    root = base / "pages"
    root.mkdir()
    old, _ = SCENARIOS[scenario]
    if old is not None:
        publish_generation(root, NAME, old(), OsFs())
    return root


def read_or_none(root: Path, fs=None) -> PageImage | None:
    try:
        return read_generation(root, NAME, fs or OsFs())
    except FileNotFound:
        return None


def leftovers(root: Path) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith((STAGE_PREFIX, RECORD_PREFIX))]


def label(root: str, target: str) -> str:
    t = target.replace(root, "")
    t = re.sub(r"\.actord-stage-\d+-[0-9a-f]+", "<stage>", t)
    t = re.sub(r"\.actord-commit-\d+-[0-9a-f]+", "<record>", t)
    return t.lstrip("/") or "<root>"


def dry_trace(scenario: str) -> list[tuple[str, str]]:
    """The calls a clean publication makes in this scenario, in order."""
    with tempfile.TemporaryDirectory() as d:
        root = setup_root(Path(d), scenario)
        fs = FaultyFs()
        publish_generation(root, NAME, SCENARIOS[scenario][1](), fs)
        return [(op, label(str(root.resolve()), t)) for op, t in fs.trace]


def cases(trace: list[tuple[str, str]], scenario: str, actions=("fail", "crash", "crash_after")):
    out = []
    for i, (op, lab) in enumerate(trace):
        nth = sum(1 for o, _ in trace[: i + 1] if o == op)
        for action in actions:
            if action == "fail" and op == "step":
                continue  # a step is a mark, not an OS call that can fail
            out.append(pytest.param(scenario, op, nth, action, id=f"{scenario}-{i:02d}-{action}-{op}-{lab}"))
    return out


PUBLISH_CASES = [c for s in SCENARIOS for c in cases(dry_trace(s), s)]


# ---- the matrix ---------------------------------------------------------------------------


@pytest.mark.timeout(30)  # a leaked lock would hang the next reader: fail fast instead
@pytest.mark.parametrize("scenario,op,nth,action", PUBLISH_CASES)
def test_any_failed_or_abandoned_step_leaves_the_old_or_the_new_generation_whole(
    tmp_path, scenario, op, nth, action
):
    root = setup_root(tmp_path, scenario)
    old, new = (None if f is None else image_fields(f()) for f in SCENARIOS[scenario])
    fs = FaultyFs([Fault(op, nth, action)])
    committed = None
    try:
        publish_generation(root, NAME, SCENARIOS[scenario][1](), fs)
        outcome = "ok"
    except StorageError as e:
        outcome, committed = "error", bool(e.data.get("committed"))
    except SimulatedCrash:
        outcome = "crash"
    assert fs.fired, "the planned fault never fired"

    # A crashed publisher's process is gone; a failed one lives on (its pid stays alive).
    reader = FaultyFs(dead_pids=[os.getpid()]) if outcome == "crash" else OsFs()
    got = read_or_none(root, reader)
    got_n = None if got is None else image_fields(got)
    assert got_n in (old, new), "reader found neither generation whole"
    if outcome == "ok" or committed:
        assert got_n == new
    if outcome == "error" and not committed:
        assert got_n == old
    assert leftovers(root) == []
    # and the state is stable: a second read agrees
    again = read_or_none(root)
    assert (None if again is None else image_fields(again)) == got_n


SYNC_CASES = [
    c for c in cases(dry_trace("drop_ckpt"), "drop_ckpt", actions=("fail",)) if c.values[1] in ("fsync", "dirsync")
]


@pytest.mark.parametrize("scenario,op,nth,action", SYNC_CASES)
def test_a_failed_fsync_is_never_reported_as_success(tmp_path, logs, scenario, op, nth, action):
    root = setup_root(tmp_path, scenario)
    trace = dry_trace(scenario)
    idx = [i for i, (o, _) in enumerate(trace) if o == op][nth - 1]
    after_record_removed = trace[idx - 1][0] == "unlink" and "<record>" in trace[idx - 1][1]
    fs = FaultyFs([Fault(op, nth, "fail")])
    if after_record_removed:
        # The one tolerated failure: the generation is in place and synced already.
        publish_generation(root, NAME, image_b(), fs)
        assert any(e["event"] == "page_file.record_removal_unsynced" for e in logs)
        assert image_fields(read_generation(root, NAME, OsFs())) == image_fields(image_b())
    else:
        with pytest.raises(StorageError):
            publish_generation(root, NAME, image_b(), fs)


def crashed_after_record(tmp_path: Path) -> Path:
    root = setup_root(tmp_path, "drop_ckpt")
    with pytest.raises(SimulatedCrash):
        publish_generation(root, NAME, image_b(), FaultyFs([Fault("step", action="crash", match="record_placed")]))
    assert any(n.startswith(RECORD_PREFIX) for n in os.listdir(root))
    return root


def reader_trace() -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as d:
        root = crashed_after_record(Path(d))
        fs = FaultyFs()
        read_generation(root, NAME, fs)
        return [(op, label(str(root.resolve()), t)) for op, t in fs.trace]


READER_TRACE = reader_trace()
READ_CASES = cases(READER_TRACE, "rollforward")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("scenario,op,nth,action", READ_CASES)
def test_a_fault_during_roll_forward_still_ends_with_the_new_generation(tmp_path, scenario, op, nth, action):
    root = crashed_after_record(tmp_path)
    idx = [i for i, (o, _) in enumerate(READER_TRACE) if o == op][nth - 1]
    tolerated = READER_TRACE[idx - 1][0] == "unlink"
    fs = FaultyFs([Fault(op, nth, action)])
    try:
        got = read_generation(root, NAME, fs)
        assert image_fields(got) == image_fields(image_b())
        assert not (action == "fail" and op in ("fsync", "dirsync") and not tolerated), "failed sync read as success"
    except (StorageError, SimulatedCrash):
        pass
    assert fs.fired
    assert image_fields(read_generation(root, NAME, OsFs())) == image_fields(image_b())
    assert leftovers(root) == []


# ---- single behaviours ---------------------------------------------------------------------


def test_a_sidecar_the_new_generation_lacks_is_moved_away_not_deleted_in_place(tmp_path):
    root = setup_root(tmp_path, "drop_ckpt")
    fs = FaultyFs()
    publish_generation(root, NAME, image_b(), fs)
    ckpt = str((root / f"{NAME}.ckpt").resolve())
    assert ("unlink", ckpt) not in fs.trace and ("rename", ckpt) in fs.trace
    assert not (root / f"{NAME}.ckpt").exists()
    assert read_generation(root, NAME, OsFs()).checkpoints == []


def test_a_cleanup_failure_does_not_mask_the_original_error(tmp_path, logs):
    root = setup_root(tmp_path, "drop_ckpt")
    fs = FaultyFs([Fault("fsync", 2, errno=errno.ENOSPC), Fault("rmtree", 1)])
    with pytest.raises(StorageError) as e:
        publish_generation(root, NAME, image_b(), fs)
    assert e.value.data["errno"] == errno.ENOSPC and e.value.data["op"] == "write_file"
    assert any(e["event"] == "page_file.stage_not_removed" for e in logs)
    assert len(leftovers(root)) == 1  # the stage the failed cleanup left
    assert image_fields(read_generation(root, NAME, OsFs())) == image_fields(image_a())
    assert leftovers(root) == []


def test_a_failure_after_the_commit_point_says_committed_and_the_next_read_completes_it(tmp_path):
    root = setup_root(tmp_path, "drop_ckpt")
    with pytest.raises(StorageError) as e:
        publish_generation(root, NAME, image_b(), FaultyFs([Fault("rename", 2)]))
    assert e.value.data["committed"] is True
    assert image_fields(read_generation(root, NAME, OsFs())) == image_fields(image_b())


def test_a_record_left_behind_is_completed_before_the_next_publication_commits(tmp_path):
    root = crashed_after_record(tmp_path)
    lean = image_lean()
    publish_generation(root, NAME, lean, OsFs())
    assert image_fields(read_generation(root, NAME, OsFs())) == image_fields(lean)
    assert leftovers(root) == []


def test_roll_forward_refuses_to_guess_when_a_staged_file_is_gone_and_the_old_one_is_in_place(tmp_path):
    root = setup_root(tmp_path, "drop_ckpt")
    with pytest.raises(SimulatedCrash):
        publish_generation(root, NAME, image_b(), FaultyFs([Fault("step", action="crash", match="record_placed")]))
    (stage,) = [n for n in os.listdir(root) if n.startswith(STAGE_PREFIX)]
    os.unlink(root / stage / "file")  # not something the protocol does
    with pytest.raises(CorruptPageFile, match="cannot complete the publication"):
        read_generation(root, NAME, OsFs())


def test_a_live_publications_stage_survives_a_concurrent_read(tmp_path):
    root = setup_root(tmp_path, "drop_ckpt")
    seen: list[list[str]] = []

    class ReadWhileStaged(OsFs):
        def step(self, name: str) -> None:
            if name == "staged":
                assert image_fields(read_generation(root, NAME, OsFs())) == image_fields(image_a())
                seen.append(leftovers(root))

    publish_generation(root, NAME, image_b(), ReadWhileStaged())
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].startswith(STAGE_PREFIX)
    assert image_fields(read_generation(root, NAME, OsFs())) == image_fields(image_b())


def test_a_reader_holds_the_folder_lock_while_it_reads(tmp_path):
    root = setup_root(tmp_path, "drop_ckpt")
    probes: list[bool] = []

    class Probe(OsFs):
        def read_file(self, path, limit=None):
            held = OsFs().lock(root / ".actord.lock", blocking=False)
            probes.append(held is None)
            if held is not None:
                held.release()
            return super().read_file(path, limit)

    read_generation(root, NAME, Probe())
    assert probes and all(probes)


def test_a_publisher_holds_the_folder_lock_from_its_record_to_the_end(tmp_path):
    root = setup_root(tmp_path, "drop_ckpt")
    probes: dict[str, bool] = {}

    class Probe(OsFs):
        def step(self, name: str) -> None:
            held = OsFs().lock(root / ".actord.lock", blocking=False)
            probes[name] = held is None
            if held is not None:
                held.release()

    publish_generation(root, NAME, image_b(), Probe())
    assert probes == {"staged": False, "record_placed": True, "moved": True, "dest_synced": True}


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("publisher, kept", [(dead_pid, False), (os.getpid, True)], ids=["dead", "live"])
def test_a_stage_with_a_held_lock_is_kept_while_its_publisher_lives_and_removed_once_it_died(tmp_path, publisher,
                                                                                              kept):
    root = setup_root(tmp_path, "drop_ckpt")
    stage = root / f"{STAGE_PREFIX}{publisher()}-cafe"
    stage.mkdir()
    held = OsFs().lock(stage / STAGE_LOCK, blocking=False)
    try:
        read_generation(root, NAME, OsFs())
        assert stage.exists() == kept
    finally:
        held.release()
    read_generation(root, NAME, OsFs())
    assert not stage.exists()


def test_a_stage_without_a_readable_pid_and_unlocked_is_removed(tmp_path):
    root = setup_root(tmp_path, "drop_ckpt")
    stage = root / f"{STAGE_PREFIX}junk"
    stage.mkdir()
    (stage / "file").write_bytes(b"x")
    read_generation(root, NAME, OsFs())
    assert not stage.exists()


def test_publish_into_a_sub_folder_creates_it(tmp_path):
    publish_generation(tmp_path, "minds/alice/a.page", image_a(), OsFs())
    assert image_fields(read_generation(tmp_path, "minds/alice/a.page", OsFs())) == image_fields(image_a())
    assert leftovers(tmp_path) == []


@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow])
@given(
    gens=st.lists(
        st.tuples(
            st.binary(max_size=200), st.booleans(), st.booleans(), st.booleans(), st.lists(st.integers(0, 999))
        ),
        min_size=1,
        max_size=4,
    )
)
def test_the_last_published_generation_is_what_a_reader_gets(gens):
    with tempfile.TemporaryDirectory() as d:
        for state, ck, lo, dr, toks in gens:
            img = PageImage(
                tokens=toks,
                state=state,
                checkpoints=[StoredCheckpoint(pos=1, data=b"c")] if ck else [],
                genes=[StoredGene(path="g", scale=2.0, id=1)] if lo else [],
                draft=b"d" if dr else None,
            )
            publish_generation(Path(d), NAME, img, OsFs())
            assert image_fields(read_generation(Path(d), NAME, OsFs())) == image_fields(img)
            present = {s for s in pf.SUFFIXES if (Path(d) / f"{NAME}{s}").exists()}
            assert present == {pf.MAIN} | {s for s, on in ((pf.CKPT, ck), (pf.LORA, lo), (pf.DRAFT, dr)) if on}


# ---- the adapter ----------------------------------------------------------------------------


def test_a_stat_error_other_than_not_found_is_an_error_not_absence(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    assert OsFs().stat(tmp_path / "absent") is None
    with pytest.raises(StorageError) as e:
        OsFs().stat(f / "child")  # ENOTDIR: not "not found"
    assert e.value.data["errno"] == errno.ENOTDIR
    with pytest.raises(StorageError):
        FaultyFs([Fault("stat", errno=errno.EACCES)]).stat(f)
    assert FaultyFs([Fault("stat", errno=errno.ENOENT)]).stat(f) is None


def test_roll_forward_does_not_read_an_unstattable_staged_file_as_already_moved(tmp_path):
    root = crashed_after_record(tmp_path)
    fs = FaultyFs([Fault("stat", errno=errno.EACCES, match="/file")])
    with pytest.raises(StorageError):
        read_generation(root, NAME, fs)
    assert image_fields(read_generation(root, NAME, OsFs())) == image_fields(image_b())


def test_pid_liveness(tmp_path):
    assert OsFs().pid_alive(os.getpid())
    assert not OsFs().pid_alive(dead_pid())
    assert not FaultyFs(dead_pids=[os.getpid()]).pid_alive(os.getpid())


def test_faulty_fs_fires_at_the_nth_matching_call_only(tmp_path):
    fs = FaultyFs([Fault("write", nth=2, match="b")])
    fs.write_file(tmp_path / "a1", [b"x"])
    fs.write_file(tmp_path / "b1", [b"x"])
    with pytest.raises(StorageError):
        fs.write_file(tmp_path / "b2", [b"x"])
    fs.write_file(tmp_path / "b3", [b"x"])
    assert fs.fired == [Fault("write", nth=2, match="b")]


def test_crash_after_leaves_the_call_done(tmp_path):
    fs = FaultyFs([Fault("rename", action="crash_after")])
    (tmp_path / "a").write_bytes(b"x")
    with pytest.raises(SimulatedCrash):
        fs.rename(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").exists() and not (tmp_path / "a").exists()


def test_write_file_writes_every_part_and_reads_back(tmp_path):
    big = bytearray(os.urandom(1 << 20))
    n = OsFs().write_file(tmp_path / "f", [b"head", memoryview(big)[10:], b"tail"])
    assert n == 4 + len(big) - 10 + 4
    assert OsFs().read_file(tmp_path / "f") == b"head" + big[10:] + b"tail"
    assert OsFs().read_file(tmp_path / "f", limit=4) == b"head"
    assert OsFs().read_file(tmp_path / "absent") is None


# ---- path confinement -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,why",
    [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("../x.page", "'..'"),
        ("a/../../x.page", "'..'"),
        ("a/..", "'..'"),
        ("x\x00.page", "NUL"),
        (".", "folder"),
        ("a/", "folder"),
        (".actord.lock", "reserved"),
        (".actord-stage-1-abc", "reserved"),
        ("sub/.actord-commit-1.rec", "reserved"),
    ],
)
def test_confine_refuses(tmp_path, name, why):
    with pytest.raises(PathRefused, match=why):
        confine(tmp_path, name)


def test_confine_refuses_a_symlink_that_leads_out_of_the_folder(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "esc.page").symlink_to(outside / "victim")
    (root / "dir").symlink_to(outside)
    with pytest.raises(PathRefused, match="outside"):
        confine(root, "esc.page")
    with pytest.raises(PathRefused, match="outside"):
        confine(root, "dir/x.page")


def test_confine_accepts_names_inside_the_folder(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert confine(tmp_path, "m.page") == tmp_path.resolve() / "m.page"
    assert confine(tmp_path, "./a/b.page") == tmp_path.resolve() / "a" / "b.page"
    assert confine(tmp_path, "alias/x.page") == tmp_path.resolve() / "real" / "x.page"


def test_publish_refuses_a_sidecar_name_that_is_a_symlink_out_of_the_folder(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / f"{NAME}.ckpt").symlink_to(outside / "victim")
    with pytest.raises(PathRefused):
        publish_generation(root, NAME, image_a(), OsFs())
    assert not (outside / "victim").exists() and leftovers(root) == []


def test_publish_refuses_a_destination_that_is_a_folder_before_its_record(tmp_path):
    root = setup_root(tmp_path, "first")
    (root / f"{NAME}.lora").mkdir()
    with pytest.raises(PathRefused, match="is a folder"):
        publish_generation(root, NAME, image_a(), OsFs())
    assert leftovers(root) == []
    with pytest.raises(FileNotFound):
        read_generation(root, NAME, OsFs())
