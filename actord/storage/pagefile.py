"""The page-file format: one generation = a main state file and its sidecars.

    NAME        header + meta (msgpack) + tokens (int32 LE) + raw llama sequence state
                [+ the state of a shared prefix the state stands on: meta "n_base"]
    NAME.ckpt   header + positions (int64 LE) + one section per checkpoint's bytes
    NAME.lora   header + the gene list (msgpack: [{path, scale, id}, ...])
    NAME.dft    header + the draft model's sequence state (optional)

Every file is the same small container, so one decoder validates all four:

    magic[8] version:u32 flags:u32 gen_id[16] n_sections:u32
    n_sections x (length:u64, crc32:u32)
    header_crc32:u32                      (over every header byte before it)
    sections, back to back; the file ends exactly where the last one does

Why this shape:
- A truncated file, a flipped byte anywhere, a wrong version or an absurd length is a
  `CorruptPageFile` that names the file and the reason. Lengths are checked against the
  buffer actually read (sized by fstat, never by a field) before anything is sliced, so a
  length of 2**60 costs an integer comparison, not an allocation.
- The main header's flags say which sidecars the generation has, so a missing `.ckpt` or
  `.lora` is detectable (corrupt), while a missing `.dft` is a cold draft (logged).
- Every file carries the generation's random id. A sidecar whose id differs from its main
  file's is a mixed set and is refused: publication makes that impossible, this makes it
  visible if something else (a copy, a hand edit) ever breaks it. Roll-forward uses the id
  to check a file it did not move itself.
- Encoding returns a list of buffers per file (header bytes + memoryviews of the caller's
  data), so the big state buffer is checksummed and written in place, never copied.
  Decoding hands back memoryviews into the read buffer (writable, so the engine can pass
  them to libllama without another copy).
- The state bytes are libllama's own sequence-state format; this module never looks
  inside them.
- A page that stands on a shared prefix in RAM (a base, serving/page_store.py) is written
  self-contained: the base's state is the main file's 4th section and "n_base" in the meta
  says how many tokens it holds; the 3rd section is then the state of the positions from
  there on. A file may instead name a base file in its meta (storage/bases.py, with
  `page_file_bases` on): the container is the same, and PageFiles.read joins the two.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from actord.policy.checkpoint_records import StoredCheckpoint
from actord.vocabulary.errors import CorruptPageFile, FileNotFound
from actord.vocabulary.log import get
from actord.storage.osfs import Buffer, OsFs

log = get("actord.storage")

VERSION = 1
MAIN, CKPT, LORA, DRAFT = "", ".ckpt", ".lora", ".dft"
# The meta key marking a file a client wrote by name (`slot.save`, `page.spill`), which the
# disk budget never evicts; the daemon's own writes of minds leave it out.
KEPT_META = "kept"
SUFFIXES = (MAIN, CKPT, LORA, DRAFT)
_MAGIC = {MAIN: b"ACTDPAGE", CKPT: b"ACTDCKPT", LORA: b"ACTDLORA", DRAFT: b"ACTDDRFT"}
_KIND = {MAIN: "main page", CKPT: "checkpoint", LORA: "gene list", DRAFT: "draft state"}

# Main-header flags: which sidecars this generation has.
HAS_CKPT, HAS_LORA, HAS_DRAFT = 1, 2, 4
FLAG_OF = {CKPT: HAS_CKPT, LORA: HAS_LORA, DRAFT: HAS_DRAFT}
_ALL_FLAGS = HAS_CKPT | HAS_LORA | HAS_DRAFT

GEN_ID_LEN = 16
MAX_SECTIONS = 1 << 20
_FIXED = struct.Struct("<8sII16sI")
_SECTION = struct.Struct("<QI")
_CRC = struct.Struct("<I")
_BIG = sys.byteorder == "big"
assert array("i").itemsize == 4 and array("q").itemsize == 8


class StoredGene(msgspec.Struct, frozen=True):
    path: str
    scale: float
    id: int  # the saving daemon's load-order id: a hint only, never matched across daemons
    digest: str = ""  # the adapter file's content digest: how a restore finds the gene


class PageImage(msgspec.Struct, frozen=True):
    """Everything one generation of page files holds."""

    tokens: list[int]
    state: bytes | bytearray | memoryview
    checkpoints: list[StoredCheckpoint] = []
    genes: list[StoredGene] = []
    draft: bytes | bytearray | memoryview | None = None
    meta: dict[str, Any] = {}  # e.g. n_ctx, model fingerprint, resume_raw_lcp
    # The mind's divergence history, (raw lcp, end of the prompt before), oldest first, and
    # where its last prompt ended: kept in the main file's meta under "divergences" and
    # "prompt_end", written only when known, so a file without them is the old format and
    # reads as "nothing known".
    divergences: list[tuple[int, int]] = []
    prompt_end: int = 0
    # The shared prefix `state` stands on (its state, and its token count), if any.
    base: bytes | bytearray | memoryview | None = None
    n_base: int = 0


class MainFile(NamedTuple):
    flags: int
    gen_id: bytes
    tokens: list[int]
    state: memoryview
    meta: dict[str, Any]
    base: memoryview | None = None


_DIVERGENCES, _PROMPT_END, _N_BASE = "divergences", "prompt_end", "n_base"
MAX_DIVERGENCES = 1024
_GENES_ENC = msgspec.msgpack.Encoder()
_GENES_DEC = msgspec.msgpack.Decoder(list[StoredGene])
_META_DEC = msgspec.msgpack.Decoder(dict[str, Any])


def _bytes_view(b: Buffer | array) -> memoryview:
    v = memoryview(b)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


def _le(values: Sequence[int], code: str) -> array:
    a = array(code, values)
    if _BIG:
        a.byteswap()
    return a


def _from_le(view: memoryview, code: str) -> list[int]:
    a = array(code)
    a.frombytes(view)
    if _BIG:
        a.byteswap()
    return a.tolist()


# ---- encode ------------------------------------------------------------------------------


def _container(kind: str, flags: int, gen_id: bytes, sections: Sequence[Buffer | array]) -> list[Buffer]:
    views = [_bytes_view(s) for s in sections]
    head = bytearray(_FIXED.pack(_MAGIC[kind], VERSION, flags, gen_id, len(views)))
    for v in views:
        head += _SECTION.pack(v.nbytes, zlib.crc32(v))
    head += _CRC.pack(zlib.crc32(head))
    return [bytes(head), *views]


def encode_generation(image: PageImage, gen_id: bytes) -> dict[str, list[Buffer]]:
    """File bodies keyed by suffix ("" is the main file); only the files it has."""
    if len(gen_id) != GEN_ID_LEN:
        raise ValueError("gen_id must be 16 bytes")
    side: dict[str, list[Buffer]] = {}
    if image.checkpoints:
        pos = _le([c.pos for c in image.checkpoints], "q")
        side[CKPT] = _container(CKPT, 0, gen_id, [pos, *(c.data for c in image.checkpoints)])
    if image.genes:
        side[LORA] = _container(LORA, 0, gen_id, [_GENES_ENC.encode(image.genes)])
    if image.draft is not None:
        side[DRAFT] = _container(DRAFT, 0, gen_id, [image.draft])
    flags = 0
    for sfx in side:
        flags |= FLAG_OF[sfx]
    meta_d = dict(image.meta)
    if image.divergences:
        meta_d[_DIVERGENCES] = [[int(a), int(b)] for a, b in image.divergences]
    if image.prompt_end:
        meta_d[_PROMPT_END] = int(image.prompt_end)
    parts: list[Any] = [_le(image.tokens, "i"), image.state]
    if image.base is not None:
        meta_d[_N_BASE] = int(image.n_base)
        parts.append(image.base)
    meta = msgspec.msgpack.encode(meta_d)
    main = _container(MAIN, flags, gen_id, [meta, *parts])
    return {MAIN: main, **side}


def n_bytes(parts: Sequence[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


# ---- decode ------------------------------------------------------------------------------


def _corrupt(file: Path | str, why: str) -> CorruptPageFile:
    return CorruptPageFile(f"page file {file}: {why}", file=str(file), reason=why)


class _Container(NamedTuple):
    flags: int
    gen_id: bytes
    sections: list[memoryview]


def _fixed_header(mv: memoryview, kind: str, file: Path | str) -> tuple[int, bytes, int, int]:
    """Check magic, version and section count; returns (flags, gen_id, n_sections, header_len)."""
    n = mv.nbytes
    if n < _FIXED.size + _CRC.size:
        raise _corrupt(file, f"truncated: {n} bytes is shorter than the header")
    magic, version, flags, gen_id, nsec = _FIXED.unpack_from(mv, 0)
    if magic != _MAGIC[kind]:
        raise _corrupt(file, f"bad magic {magic!r}, not a {_KIND[kind]} file")
    if version != VERSION:
        raise _corrupt(file, f"unsupported format version {version} (this build reads {VERSION})")
    hlen = _FIXED.size + nsec * _SECTION.size + _CRC.size
    if nsec > MAX_SECTIONS or hlen > n:
        raise _corrupt(file, f"section table of {nsec} entries does not fit in {n} bytes")
    (crc,) = _CRC.unpack_from(mv, hlen - _CRC.size)
    if zlib.crc32(mv[: hlen - _CRC.size]) != crc:
        raise _corrupt(file, "header checksum mismatch")
    return flags, gen_id, nsec, hlen


def main_n_tokens(head: Buffer, file: Path | str = "<main>") -> int | None:
    """The token count a main file's header states (its token section's length), from the
    file's first bytes; None when they are too few to hold the header's section table. The
    header is checksummed; the sections are not read (a restore checks them whole)."""
    mv = _bytes_view(head)
    if mv.nbytes < _FIXED.size:
        return None
    nsec = _FIXED.unpack_from(mv, 0)[4]
    if _FIXED.size + nsec * _SECTION.size + _CRC.size > mv.nbytes:
        return None
    _main_header(mv, file)
    return _SECTION.unpack_from(mv, _FIXED.size + _SECTION.size)[0] // 4


def _main_header(mv: memoryview, file: Path | str) -> None:
    """A main file's header checked (`_fixed_header`) and holding its 3 or 4 sections."""
    _, _, nsec, _ = _fixed_header(mv, MAIN, file)
    if nsec not in (3, 4):
        raise _corrupt(file, f"expected 3 or 4 sections, found {nsec}")


_HEAD_PEEK = 4096  # a main file's header and section table (3 or 4 sections) fit many times over


def _check_head(head: Buffer, file: Path | str) -> None:
    """Refuse, typed, a main file whose first bytes are not a page file's header (its
    magic, version, section count and checksum); a short one is left to the whole read."""
    mv = _bytes_view(head)
    if mv.nbytes >= _FIXED.size + _CRC.size:
        _main_header(mv, file)


def main_meta(head: Buffer, file: Path | str = "<main>") -> dict[str, Any] | None:
    """A main file's meta (its first section, checksummed), from the file's first bytes;
    None when they do not hold it whole (read more)."""
    mv = _bytes_view(head)
    if mv.nbytes < _FIXED.size:
        return None
    nsec = _FIXED.unpack_from(mv, 0)[4]
    hlen = _FIXED.size + nsec * _SECTION.size + _CRC.size
    if hlen > mv.nbytes:
        return None
    _, _, nsec, _ = _fixed_header(mv, MAIN, file)
    if nsec not in (3, 4):
        raise _corrupt(file, f"expected 3 or 4 sections, found {nsec}")
    length, crc = _SECTION.unpack_from(mv, _FIXED.size)
    if hlen + length > mv.nbytes:
        return None
    meta_v = mv[hlen: hlen + length]
    if zlib.crc32(meta_v) != crc:
        raise _corrupt(file, "checksum mismatch in section 0 (meta)")
    try:
        return _META_DEC.decode(meta_v)
    except msgspec.MsgspecError as e:
        raise _corrupt(file, f"meta does not decode: {e}") from None


def main_head(head: Buffer, file: Path | str = "<main>") -> tuple[dict[str, Any], list[int]] | None:
    """A main file's meta and tokens (its first two sections, checksummed), from the file's
    first bytes; None when they do not hold both whole (read more). A base file's index
    entry (storage/bases.py) is read so, without its state."""
    meta = main_meta(head, file)
    if meta is None:
        return None
    mv = _bytes_view(head)
    nsec = _FIXED.unpack_from(mv, 0)[4]
    hlen = _FIXED.size + nsec * _SECTION.size + _CRC.size
    meta_len = _SECTION.unpack_from(mv, _FIXED.size)[0]
    length, crc = _SECTION.unpack_from(mv, _FIXED.size + _SECTION.size)
    start = hlen + meta_len
    if start + length > mv.nbytes:
        return None
    tok_v = mv[start: start + length]
    if zlib.crc32(tok_v) != crc:
        raise _corrupt(file, "checksum mismatch in section 1 (tokens)")
    if length % 4:
        raise _corrupt(file, f"token section of {length} bytes is not whole int32s")
    return meta, _from_le(tok_v, "i")


def _open(buf: Buffer, kind: str, file: Path | str, names: Sequence[str]) -> _Container:
    mv = _bytes_view(buf)
    flags, gen_id, nsec, hlen = _fixed_header(mv, kind, file)
    table = [_SECTION.unpack_from(mv, _FIXED.size + i * _SECTION.size) for i in range(nsec)]
    total = hlen + sum(length for length, _ in table)
    if total != mv.nbytes:
        how = "truncated" if total > mv.nbytes else "trailing bytes"
        raise _corrupt(file, f"{how}: section lengths describe {total} bytes, the file has {mv.nbytes}")
    sections: list[memoryview] = []
    off = hlen
    for i, (length, crc) in enumerate(table):
        s = mv[off : off + length]
        if zlib.crc32(s) != crc:
            label = names[min(i, len(names) - 1)]
            raise _corrupt(file, f"checksum mismatch in section {i} ({label})")
        sections.append(s)
        off += length
    return _Container(flags, gen_id, sections)


def _same_generation(c: _Container, gen_id: bytes, file: Path | str) -> None:
    if c.gen_id != gen_id:
        raise _corrupt(file, "belongs to another generation than its main file (mixed set)")


def decode_main(buf: Buffer, file: Path | str = "<main>") -> MainFile:
    c = _open(buf, MAIN, file, ("meta", "tokens", "state", "base state"))
    if len(c.sections) not in (3, 4):
        raise _corrupt(file, f"expected 3 or 4 sections, found {len(c.sections)}")
    if c.flags & ~_ALL_FLAGS:
        raise _corrupt(file, f"unknown flags {c.flags:#x}")
    meta_v, tok_v, state_v = c.sections[:3]
    if tok_v.nbytes % 4:
        raise _corrupt(file, f"token section of {tok_v.nbytes} bytes is not whole int32s")
    try:
        meta = _META_DEC.decode(meta_v)
    except msgspec.MsgspecError as e:
        raise _corrupt(file, f"meta does not decode: {e}") from None
    tokens = _from_le(tok_v, "i")
    n_base = meta.get(_N_BASE, 0)
    base = c.sections[3] if len(c.sections) == 4 else None
    if base is None and n_base:
        raise _corrupt(file, f"records a base of {n_base!r} tokens but has no base section")
    if base is not None and not (type(n_base) is int and 0 < n_base < len(tokens) and base.nbytes):
        raise _corrupt(file, f"base section with a base token count of {n_base!r} for {len(tokens)} tokens")
    return MainFile(c.flags, c.gen_id, tokens, state_v, meta, base)


def decode_checkpoints(buf: Buffer, gen_id: bytes, file: Path | str = "<ckpt>") -> list[StoredCheckpoint]:
    c = _open(buf, CKPT, file, ("positions", "checkpoint"))
    _same_generation(c, gen_id, file)
    if not c.sections or c.sections[0].nbytes % 8:
        raise _corrupt(file, "position table missing or not whole int64s")
    positions = _from_le(c.sections[0], "q")
    if len(c.sections) != 1 + len(positions):
        raise _corrupt(file, f"{len(positions)} positions but {len(c.sections) - 1} checkpoints")
    return [StoredCheckpoint(pos=p, data=d) for p, d in zip(positions, c.sections[1:], strict=True)]


def decode_genes(buf: Buffer, gen_id: bytes, file: Path | str = "<lora>") -> list[StoredGene]:
    c = _open(buf, LORA, file, ("genes",))
    _same_generation(c, gen_id, file)
    if len(c.sections) != 1:
        raise _corrupt(file, f"expected 1 section, found {len(c.sections)}")
    try:
        return _GENES_DEC.decode(c.sections[0])
    except msgspec.MsgspecError as e:
        raise _corrupt(file, f"gene list does not decode: {e}") from None


def decode_draft(buf: Buffer, gen_id: bytes, file: Path | str = "<dft>") -> memoryview:
    c = _open(buf, DRAFT, file, ("draft",))
    _same_generation(c, gen_id, file)
    if len(c.sections) != 1:
        raise _corrupt(file, f"expected 1 section, found {len(c.sections)}")
    return c.sections[0]


# ---- files -------------------------------------------------------------------------------


def sidecar_paths(main: Path) -> dict[str, Path]:
    return {sfx: main.with_name(main.name + sfx) for sfx in SUFFIXES}


def peek_gen_id(fs: OsFs, path: Path, kind: str) -> bytes | None:
    """The generation id in a file's (checksummed) header, reading only the header.

    None if the file does not exist. Used by roll-forward to check a file it finds already
    in place.
    """
    head = fs.read_file(path, limit=_FIXED.size + _CRC.size)
    if head is None:
        return None
    mv = memoryview(head)
    if mv.nbytes < _FIXED.size:
        raise _corrupt(path, f"truncated: {mv.nbytes} bytes is shorter than the header")
    nsec = _FIXED.unpack_from(mv, 0)[4]
    size = _FIXED.size + min(nsec, MAX_SECTIONS + 1) * _SECTION.size + _CRC.size
    full = fs.read_file(path, limit=size)
    if full is None:
        return None
    _, gen_id, _, _ = _fixed_header(memoryview(full), kind, path)
    return gen_id


def load_generation(fs: OsFs, paths: Mapping[str, Path]) -> PageImage:
    """Read and validate one generation. `paths` maps each suffix to its (confined) path.

    No locking and no recovery here: `publish.read_generation` does both around this.
    """
    main_path = paths[MAIN]
    # The header first: a file that is not a page file is refused before its bulk is read
    # (a stray multi-GB file where a mind's file goes would otherwise be read whole).
    head = fs.read_file(main_path, limit=_HEAD_PEEK)
    if head is not None:
        _check_head(head, main_path)
    buf = fs.read_file(main_path)
    if buf is None:
        raise FileNotFound(f"page file {main_path} not found", file=str(main_path))
    m = decode_main(buf, main_path)

    def sidecar(sfx: str) -> bytearray:
        b = fs.read_file(paths[sfx])
        if b is None:
            raise _corrupt(paths[sfx], f"missing, but {main_path.name} records a {_KIND[sfx]} sidecar")
        return b

    checkpoints: list[StoredCheckpoint] = []
    genes: list[StoredGene] = []
    draft: memoryview | None = None
    if m.flags & HAS_CKPT:
        checkpoints = decode_checkpoints(sidecar(CKPT), m.gen_id, paths[CKPT])
    if m.flags & HAS_LORA:
        genes = decode_genes(sidecar(LORA), m.gen_id, paths[LORA])
    if m.flags & HAS_DRAFT:
        b = fs.read_file(paths[DRAFT])
        if b is None:
            log.info("page_file.cold_draft", file=str(paths[DRAFT]), reason="draft sidecar missing")
        else:
            draft = decode_draft(b, m.gen_id, paths[DRAFT])
    else:
        log.info("page_file.cold_draft", file=str(main_path), reason="generation has no draft state")
    meta = dict(m.meta)
    n_base = meta.pop(_N_BASE, 0) if m.base is not None else 0
    divergences, prompt_end = _placement_meta(meta, main_path)
    return PageImage(
        tokens=m.tokens, state=m.state, checkpoints=checkpoints, genes=genes, draft=draft, meta=meta,
        divergences=divergences, prompt_end=prompt_end, base=m.base, n_base=n_base,
    )


def _placement_meta(meta: dict[str, Any], file: Path | str) -> tuple[list[tuple[int, int]], int]:
    """Take the divergence history and prompt end out of a main file's meta (absent: none)."""
    raw = meta.pop(_DIVERGENCES, [])
    end = meta.pop(_PROMPT_END, 0)
    ok = isinstance(raw, list) and len(raw) <= MAX_DIVERGENCES and all(
        isinstance(d, list) and len(d) == 2 and all(type(v) is int and v >= 0 for v in d) for d in raw)
    if not ok:
        raise _corrupt(file, "divergence history is not a list of [lcp, end] pairs of non-negative ints")
    if type(end) is not int or end < 0:
        raise _corrupt(file, f"prompt end {end!r} is not a non-negative int")
    return [(d[0], d[1]) for d in raw], end
