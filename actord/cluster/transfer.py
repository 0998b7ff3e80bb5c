"""A page-file generation as numpy arrays, for the object store, and back.

The source reads the mind's page file (storage/publish.read_generation: whole and
checksum-valid, or a typed error) and packs it: the sequence state, each checkpoint's bytes
and the draft state become uint8 arrays viewing the read buffers (no copy), the tokens an
int32 array; the rest is small. Ray stores numpy arrays out of band, so the destination
reads them in place (read-only views into the object store) and hands them straight to the
page-file writer. A CRC-32 of every byte section travels with the blob and is checked at
the destination before anything is written.

The object store is only the transport: the durable copies are the page files at either
end (the source's stays until the directory has flipped).
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec
import numpy as np

from actord.cluster.fence import TurnRecord
from actord.vocabulary.errors import CorruptPageFile
from actord.policy.checkpoint_records import StoredCheckpoint
from actord.storage.pagefile import PageImage, StoredGene


class PageBlob(msgspec.Struct, frozen=True):
    mind: str
    epoch: int  # the epoch it was exported at
    turns: list[TurnRecord] = []  # the mind's applied turns: duplicates stay refused after a move
    has_page: bool = False  # False: the mind had no state to move (a fresh mind)
    tokens: Any = None  # int32 array
    state: Any = None  # uint8 array
    ckpt_pos: list[int] = []
    ckpts: list[Any] = []  # uint8 arrays
    draft: Any = None  # uint8 array or None
    base: Any = None  # uint8 array or None: the state of the shared prefix `state` stands on
    n_base: int = 0
    genes: list[StoredGene] = []
    meta: dict[str, Any] = {}
    divergences: list[tuple[int, int]] = []
    prompt_end: int = 0
    crc32: int = 0
    n_bytes: int = 0


def _u8(buf: Any) -> np.ndarray:
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def _crc(sections: list[Any]) -> int:
    crc = 0
    for s in sections:
        crc = zlib.crc32(memoryview(s).cast("B"), crc)
    return crc


def pack(mind: str, epoch: int, image: PageImage | None, turns: list[TurnRecord]) -> PageBlob:
    if image is None:
        return PageBlob(mind=mind, epoch=epoch, turns=turns)
    state = _u8(image.state)
    ckpts = [_u8(c.data) for c in image.checkpoints]
    draft = None if image.draft is None else _u8(image.draft)
    base = None if image.base is None else _u8(image.base)
    tokens = np.asarray(image.tokens, dtype=np.int32)
    sections = [tokens, state, *ckpts, *([draft] if draft is not None else []), *([base] if base is not None else [])]
    return PageBlob(
        mind=mind, epoch=epoch, turns=turns, has_page=True, tokens=tokens, state=state,
        ckpt_pos=[c.pos for c in image.checkpoints], ckpts=ckpts, draft=draft, genes=list(image.genes),
        base=base, n_base=image.n_base if base is not None else 0,
        meta=dict(image.meta), divergences=[tuple(d) for d in image.divergences], prompt_end=image.prompt_end,
        crc32=_crc(sections), n_bytes=sum(s.nbytes for s in sections),
    )


def unpack(blob: PageBlob) -> PageImage:
    """The blob's page image, its checksum verified (CorruptPageFile otherwise)."""
    assert blob.has_page
    sections = [blob.tokens, blob.state, *blob.ckpts, *([blob.draft] if blob.draft is not None else []),
                *([blob.base] if blob.base is not None else [])]
    crc = _crc(sections)
    if crc != blob.crc32:
        raise CorruptPageFile(f"page of {blob.mind!r} arrived with CRC-32 {crc:08x}, sent {blob.crc32:08x}",
                              mind=blob.mind)
    return PageImage(
        tokens=[int(t) for t in blob.tokens], state=memoryview(blob.state),
        checkpoints=[StoredCheckpoint(pos=p, data=memoryview(d)) for p, d in zip(blob.ckpt_pos, blob.ckpts)],
        genes=list(blob.genes), draft=None if blob.draft is None else memoryview(blob.draft), meta=dict(blob.meta),
        divergences=[tuple(d) for d in blob.divergences], prompt_end=blob.prompt_end,
        base=None if blob.base is None else memoryview(blob.base), n_base=blob.n_base,
    )
