"""Crash-safe publication of one page-file generation, and the reader that recovers.

A generation (main file + .ckpt/.lora/.dft sidecars) must be seen whole or not at all: a
restore that pairs a new main file with an old checkpoint sidecar resumes from the wrong
state without any error. POSIX renames are atomic one file at a time, so a set of files
needs a commit record (a small redo log). The protocol, from the original C++ server's
review fixes (seed 003, "page files publish whole generations"):

 1. Under the folder lock, make a staging folder `.actord-stage-<pid>-<id>` in the page
    folder and take its own lock (so a reader can tell a live stage from an orphan).
 2. Write every file of the generation into the stage, fsync each; fsync the stage.
 3. Write + fsync the commit record in the stage. It lists the files to move and the
    sidecars the new generation lacks.
 4. Under the folder lock: recover leftovers first (so an older record can never land
    after ours), rename the record into the page folder, fsync the folder. This is the
    commit point: from here the generation is published, whatever happens.
 5. Move each staged file over its committed name; move each sidecar the generation lacks
    into the stage (away, never deleted in place); fsync the destination folder(s).
 6. Remove the record; fsync the folder (the one sync failure tolerated, logged: the
    record is gone or, after a crash, rolled forward again harmlessly). Remove the stage.

A failure before step 4 leaves the old generation whole and removes the stage (a failed
cleanup is logged and never masks the error). A failure after it raises StorageError
with `committed=True`: the next reader (or publisher) completes the moves. Any failed
fsync or directory sync raises; none is reported as success.

Readers (`read_generation`) hold the same folder lock while they read, so no publication
commits under them. Before reading they roll forward every record left by a publication
cut short, and remove every stage no live publication owns (its pid is dead, or it has no
record and its lock is free). Stage writes happen outside the folder lock, so a long spill
never blocks a restore; only the renames do.

Roll-forward is idempotent: a staged file still present is moved; one already gone must be
found in place with the record's generation id (checked from its header), else the state
is not one this protocol produces and the read fails as CorruptPageFile rather than guess.

Every OS call goes through the `fs` adapter (`osfs.py`); there are no OS branches here.
"""

from __future__ import annotations

import contextlib
import stat
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import msgspec

from actord.vocabulary.errors import ActordError, CorruptPageFile, FileNotFound, PathRefused, StorageError
from actord.vocabulary.log import get
from actord.storage.osfs import FileLock, OsFs
from actord.storage.pagefile import SUFFIXES, PageImage, encode_generation, load_generation, peek_gen_id
from actord.storage.paths import LOCK_NAME, RESERVED_PREFIX, confine

log = get("actord.storage")
T = TypeVar("T")

STAGE_PREFIX = RESERVED_PREFIX + "stage-"
RECORD_PREFIX = RESERVED_PREFIX + "commit-"
RECORD_SUFFIX = ".rec"
STAGE_LOCK = ".lock"
STAGED_RECORD = "commit.rec"
RECORD_VERSION = 1


class PublishStats(msgspec.Struct, frozen=True):
    n_bytes: int
    files: list[str]  # committed names, relative to the page folder
    t_ms: float


class CommitRecord(msgspec.Struct, frozen=True):
    version: int
    stage: str  # the stage folder's name in the page folder
    gen_id: str  # hex
    moves: list[tuple[str, str, str]]  # (name in stage, destination relative to root, suffix)
    away: list[str]  # destinations (relative to root) the new generation lacks


_REC_ENC = msgspec.json.Encoder()
_REC_DEC = msgspec.json.Decoder(CommitRecord)


def _folder_lock(base: Path, fs: OsFs) -> FileLock:
    held = fs.lock(base / LOCK_NAME)
    assert held is not None  # a blocking lock is always granted or raises
    return held


# Recovery without a listing (issue 34: 10,000 page files made every read and publication
# list the whole folder, 12 ms each). Every hold of the folder lock counts itself in the
# lock file at once (before anything is changed, so a holder that dies mid-publication has
# counted). A process that found nothing to recover remembers the count and the folder's
# signature after its own hold; finding both unchanged at its next hold, it knows no other
# process held the lock meanwhile and nothing else changed the folder, so nothing can be
# left to roll forward or sweep (its own cut-short publications forget the memory).
_QUIET: dict[str, tuple[int, tuple[int, ...] | None]] = {}
_LEFT: set[str] = set()  # folders where a stage could not be removed: listed at the next hold


class _Hold:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet  # nothing to recover in the folder


def _signature(base: Path, fs: OsFs) -> tuple[int, ...] | None:
    """The folder's identity and change times; None where it cannot be read (then it is
    listed: a failure here never changes an operation's outcome)."""
    try:
        st = fs.stat(base)
    except StorageError:
        return None
    return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink, st.st_size)


@contextlib.contextmanager
def _forget_on_failure(base: Path) -> Iterator[None]:
    """A publication or removal cut short (an error, a simulated crash) may leave a stage
    or a record: the next hold lists the folder."""
    try:
        yield
    except BaseException:
        _QUIET.pop(str(base), None)
        raise


@contextlib.contextmanager
def _locked(base: Path, fs: OsFs) -> Iterator[_Hold]:
    """The folder lock, counted; `hold.quiet` says whether `recover` can skip its listing."""
    key = str(base)
    with _folder_lock(base, fs) as held:
        n = held.count()
        known = _QUIET.pop(key, None)
        left = key in _LEFT
        _LEFT.discard(key)
        sig = _signature(base, fs)
        hold = _Hold(quiet=not left and sig is not None and known == (n, sig))
        held.set_count(n + 1)
        yield hold
        sig = _signature(base, fs) if hold.quiet and key not in _LEFT else None
        if sig is not None:
            _QUIET[key] = (n + 1, sig)


# ---- publish -----------------------------------------------------------------------------


def publish_generation(root: Path, name: str, image: PageImage, fs: OsFs) -> PublishStats:
    """Publish `image` as the generation of page file `name` in `root`, whole or not at all."""
    with _forget_on_failure(Path(root).resolve()):
        return _publish_generation(root, name, image, fs)


def _publish_generation(root: Path, name: str, image: PageImage, fs: OsFs) -> PublishStats:
    t0 = time.perf_counter()
    dests = {sfx: confine(root, name + sfx) for sfx in SUFFIXES}
    base = Path(root).resolve()
    gen_id = uuid.uuid4().bytes
    bodies = encode_generation(image, gen_id)
    stage_id = f"{fs.getpid()}-{uuid.uuid4().hex[:16]}"
    stage = base / f"{STAGE_PREFIX}{stage_id}"
    record = CommitRecord(
        version=RECORD_VERSION,
        stage=stage.name,
        gen_id=gen_id.hex(),
        moves=[(f"file{sfx}", str(dests[sfx].relative_to(base)), sfx) for sfx in bodies],
        away=[str(dests[sfx].relative_to(base)) for sfx in SUFFIXES if sfx not in bodies],
    )
    fs.mkdir(base, exist_ok=True)

    def staging() -> int:
        total = 0
        for sfx, parts in bodies.items():
            total += fs.write_file(stage / f"file{sfx}", parts)
        fs.dirsync(stage)
        fs.write_file(stage / STAGED_RECORD, [_REC_ENC.encode(record)])
        fs.step("staged")
        return total

    def preparing() -> None:
        _make_parents(base, dests[""].parent, fs)
        _refuse_folders(dests, fs)

    total = _commit(base, stage_id, record, fs, what=f"page file {name}", name=name, placed="record_placed",
                    staging=staging, preparing=preparing)
    files = [m[1] for m in record.moves]
    t_ms = (time.perf_counter() - t0) * 1e3
    log.debug("page_file.published", file=name, n_bytes=total, files=files, t_ms=round(t_ms, 3))
    return PublishStats(n_bytes=total, files=files, t_ms=t_ms)


def remove_generation(root: Path, name: str, fs: OsFs) -> int:
    """Remove page file `name`'s generation, whole or not at all; the bytes it held (0: none).

    A removal is a publication of nothing: its commit record moves no file in and every
    file of the generation away into the stage (never deleted in place), so a crash at any
    point leaves the old generation whole (before the record) or rolls the removal forward
    at the next read (after it), exactly as a publication does."""
    with _forget_on_failure(Path(root).resolve()):
        return _remove_generation(root, name, fs)


def _remove_generation(root: Path, name: str, fs: OsFs) -> int:
    dests = {sfx: confine(root, name + sfx) for sfx in SUFFIXES}
    base = Path(root).resolve()
    held = sum(st.st_size for st in (fs.stat(d) for d in dests.values()) if st is not None)
    if not held:
        return 0
    stage_id = f"{fs.getpid()}-{uuid.uuid4().hex[:16]}"
    stage = base / f"{STAGE_PREFIX}{stage_id}"
    record = CommitRecord(version=RECORD_VERSION, stage=stage.name, gen_id=uuid.uuid4().hex, moves=[],
                          away=[str(d.relative_to(base)) for d in dests.values()])

    def staging() -> None:
        fs.write_file(stage / STAGED_RECORD, [_REC_ENC.encode(record)])
        fs.dirsync(stage)

    _commit(base, stage_id, record, fs, what=f"removal of page file {name}", name=name, placed="removal_placed",
            staging=staging)
    log.debug("page_file.removed", file=name, n_bytes=held)
    return held


def _commit(base: Path, stage_id: str, record: CommitRecord, fs: OsFs, *, what: str, name: str, placed: str,
            staging: Callable[[], T], preparing: Callable[[], None] = lambda: None) -> T:
    """The commit a publication and a removal share: `staging()` fills the stage (the staged
    record last) and its value is returned; then, under the folder's lock, what an earlier
    crash left is recovered, `preparing()` readies the destination, and the record is
    placed (the commit point: durable once the folder is synced; the step `placed`) and
    applied. A failure before the commit point discards the stage and changes nothing; one
    after it is a StorageError saying `what` committed, which the next read completes."""
    stage = base / record.stage
    stage_lock = _open_stage(base, stage, fs)
    committed = False
    try:
        out = staging()
        with _locked(base, fs) as hold:
            recover(base, fs, hold)
            preparing()
            rec_path = base / f"{RECORD_PREFIX}{stage_id}{RECORD_SUFFIX}"
            fs.rename(stage / STAGED_RECORD, rec_path)
            try:
                fs.dirsync(base)
            except StorageError:
                # The record's durability is unknown: take it back, so the caller's error
                # means "not published". If even that fails, the record stays and the next
                # reader rolls it forward, so report it as committed.
                committed = not _take_back(rec_path, fs)
                raise
            committed = True
            fs.step(placed)
            _apply(base, rec_path, record, fs)
    except Exception as e:
        if committed:
            msg = e.message if isinstance(e, ActordError) else str(e)
            data = e.data if isinstance(e, ActordError) else {}
            raise StorageError(f"{what} committed but not finished ({msg}); the next read completes it",
                               **{**data, "file": name, "committed": True}) from e
        _discard(stage, fs, e)
        raise
    finally:
        stage_lock.release()
    return out


def _open_stage(base: Path, stage: Path, fs: OsFs) -> FileLock:
    """Create the stage and lock it, both under the folder lock (no reader can see it
    created but not yet locked, and take it for an orphan)."""
    with _locked(base, fs):
        fs.mkdir(stage)
        try:
            held = fs.lock(stage / STAGE_LOCK, blocking=False)
            if held is None:
                raise StorageError(f"stage {stage.name} is locked by someone else", path=str(stage))
        except Exception as e:
            _discard(stage, fs, e)
            raise
        return held


def _discard(stage: Path, fs: OsFs, cause: BaseException) -> None:
    try:
        fs.rmtree(stage)
    except Exception as e:  # never mask the error that brought us here
        log.warning("page_file.stage_not_removed", stage=stage.name, error=str(e), cause=str(cause))
        _LEFT.add(str(stage.parent))  # the next hold lists the folder and sweeps it


def _take_back(rec_path: Path, fs: OsFs) -> bool:
    try:
        fs.unlink(rec_path)
        return True
    except Exception as e:
        log.warning("page_file.record_not_taken_back", record=rec_path.name, error=str(e))
        return False


def _refuse_folders(dests: dict[str, Path], fs: OsFs) -> None:
    """A destination that is a folder would make every roll-forward fail: refuse it
    before the record, while refusing still leaves the old generation whole."""
    for dst in dests.values():
        st = fs.stat(dst)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise PathRefused(f"page file {dst.name} is a folder", name=dst.name, reason="is a folder")


def _make_parents(base: Path, parent: Path, fs: OsFs) -> None:
    """Create missing sub-folders between the page folder and `parent`, durably."""
    d = base
    for part in parent.relative_to(base).parts:
        d = d / part
        if fs.mkdir(d, exist_ok=True):
            fs.dirsync(d.parent)


def _apply(base: Path, rec_path: Path, record: CommitRecord, fs: OsFs) -> None:
    """Steps 5-6: move the generation into place and retire the record. Idempotent."""
    stage = base / record.stage
    gen = bytes.fromhex(record.gen_id)
    dirs: list[Path] = []
    for staged, dest_rel, sfx in record.moves:
        src, dst = stage / staged, confine(base, dest_rel)
        if fs.stat(src) is not None:
            fs.rename(src, dst)
        elif peek_gen_id(fs, dst, sfx) != gen:
            raise CorruptPageFile(
                f"cannot complete the publication in {rec_path.name}: {staged} is gone from "
                f"{record.stage} and {dst} is not of that generation",
                file=str(dst), record=rec_path.name,
            )
        dirs.append(dst.parent)
    fs.step("moved")
    stage_ready = False
    for dest_rel in record.away:
        dst = confine(base, dest_rel)
        if fs.stat(dst) is not None:
            if not stage_ready:  # a roll-forward may find the stage gone
                fs.mkdir(stage, exist_ok=True)
                stage_ready = True
            fs.rename(dst, stage / f"away-{dst.name}")
        dirs.append(dst.parent)
    for d in dict.fromkeys(dirs):
        fs.dirsync(d)
    fs.step("dest_synced")
    fs.unlink(rec_path)
    try:
        fs.dirsync(base)
    except StorageError as e:
        # The only tolerated sync failure: the generation is in place and synced; a record
        # that comes back after a crash is rolled forward again, harmlessly.
        log.warning("page_file.record_removal_unsynced", record=rec_path.name, error=e.message)
    try:
        fs.rmtree(stage)
    except StorageError as e:
        log.warning("page_file.stage_not_removed", stage=record.stage, error=e.message)
        _LEFT.add(str(stage.parent))  # the next hold lists the folder and sweeps it


# ---- recover and read --------------------------------------------------------------------


def recover_folder(root: Path, fs: OsFs) -> None:
    """`recover` under the folder lock: at start, before the folder is indexed."""
    base = Path(root).resolve()
    with _locked(base, fs) as hold:
        hold.quiet = False  # at start, always the whole listing
        recover(base, fs, hold)


def recover(base: Path, fs: OsFs, hold: _Hold | None = None) -> None:
    """Roll forward records left by cut-short publications; remove orphaned stages.

    Call with the folder lock held (`hold`: as `_locked` gave it; a quiet folder needs no
    listing, and one listed here is quiet after it).
    """
    if hold is not None and hold.quiet:
        return
    _recover(base, fs)
    if hold is not None:
        hold.quiet = True


def _recover(base: Path, fs: OsFs) -> None:
    names = fs.listdir(base)
    records = [n for n in names if n.startswith(RECORD_PREFIX) and n.endswith(RECORD_SUFFIX)]
    for n in records:
        _roll_forward(base, base / n, fs)
    if records:
        names = fs.listdir(base)
    for n in names:
        if n.startswith(STAGE_PREFIX):
            _sweep_stage(base / n, fs)


def _roll_forward(base: Path, rec_path: Path, fs: OsFs) -> None:
    raw = fs.read_file(rec_path)
    if raw is None:
        return
    try:
        record = _REC_DEC.decode(raw)
    except msgspec.MsgspecError as e:
        raise CorruptPageFile(f"commit record {rec_path.name} does not decode: {e}", file=str(rec_path)) from None
    if (
        record.version != RECORD_VERSION
        or not record.stage.startswith(STAGE_PREFIX)
        or "/" in record.stage
        or record.stage in (".", "..")
    ):
        raise CorruptPageFile(f"commit record {rec_path.name} is not one this build wrote", file=str(rec_path))
    log.info("page_file.roll_forward", record=rec_path.name, files=[m[1] for m in record.moves])
    _apply(base, rec_path, record, fs)


def _stage_pid(stage: Path) -> int | None:
    head = stage.name[len(STAGE_PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _sweep_stage(stage: Path, fs: OsFs) -> None:
    """Remove a stage no live publication owns. A failure here is logged: it does not
    change what a reader reads, and the next sweep tries again."""
    try:
        pid = _stage_pid(stage)
        if pid is None or fs.pid_alive(pid):
            held = fs.lock(stage / STAGE_LOCK, blocking=False)
            if held is None:
                _LEFT.add(str(stage.parent))  # not quiet: its owner may yet abandon it
                return  # a live publication is writing it
            held.release()
        fs.rmtree(stage)
        log.info("page_file.stage_removed", stage=stage.name, pid=pid)
    except StorageError as e:
        log.warning("page_file.stage_not_removed", stage=stage.name, error=e.message)
        _LEFT.add(str(stage.parent))  # the next hold lists the folder and sweeps it


def read_generation(root: Path, name: str, fs: OsFs) -> PageImage:
    """Read page file `name` from `root`: whole and checksum-valid, or a typed error.

    Holds the folder lock (no publication commits while it reads), completes any
    publication cut short after its record, removes orphaned stages, then reads.
    """
    paths = {sfx: confine(root, name + sfx) for sfx in SUFFIXES}
    base = Path(root).resolve()
    if fs.stat(base) is None:
        raise FileNotFound(f"page folder {base} not found", file=name)
    with _locked(base, fs) as hold:
        recover(base, fs, hold)
        return load_generation(fs, paths)

