"""The page-file format: round trips, and every kind of damage gives a typed error."""

from __future__ import annotations

import errno
import struct
import tracemalloc
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actord.vocabulary.errors import CorruptPageFile, FileNotFound, StorageError
from actord.storage import pagefile as pf
from actord.storage.osfs import Fault, FaultyFs, OsFs
from actord.policy.checkpoint_records import StoredCheckpoint
from actord.storage.pagefile import PageImage, StoredGene
from actord.storage.publish import publish_generation, read_generation
from tests.storage.images import image_fields

GEN = bytes(range(16))
OTHER_GEN = bytes(range(16, 32))

_settings = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])


def full_image(seed: int = 1) -> PageImage:
    return PageImage(
        tokens=[seed, 2, 3, 2**31 - 1, -(2**31)],
        state=bytes((seed + i) % 251 for i in range(300)),
        checkpoints=[StoredCheckpoint(pos=7, data=b"c1" * 5), StoredCheckpoint(pos=40, data=b"c2" * 9)],
        genes=[StoredGene(path="genes/a.gguf", scale=0.25, id=3), StoredGene(path="b.gguf", scale=1.0, id=4)],
        draft=b"draft" * 7,
        meta={"n_ctx": 4096, "model": "fp:abc", "resume_raw_lcp": 12},
    )


def files_of(image: PageImage, gen: bytes = GEN) -> dict[str, bytes]:
    return {sfx: b"".join(bytes(p) for p in parts) for sfx, parts in pf.encode_generation(image, gen).items()}


def decode(sfx: str, buf: bytes | bytearray, gen: bytes = GEN):
    if sfx == pf.MAIN:
        return pf.decode_main(buf, "x.page")
    if sfx == pf.CKPT:
        return pf.decode_checkpoints(buf, gen, "x.page.ckpt")
    if sfx == pf.LORA:
        return pf.decode_genes(buf, gen, "x.page.lora")
    return pf.decode_draft(buf, gen, "x.page.dft")


def same_image(a: PageImage, b: PageImage) -> bool:
    return image_fields(a) == image_fields(b)


def header_len(buf: bytes) -> int:
    nsec = struct.unpack_from("<I", buf, 32)[0]
    return 36 + 12 * nsec + 4


def rewrite_header(buf: bytes, **changes: int) -> bytes:
    """Change header fields and recompute the header checksum, so only the field is wrong."""
    b = bytearray(buf)
    hlen = header_len(buf)
    if "version" in changes:
        struct.pack_into("<I", b, 8, changes["version"])
    if "nsec" in changes:
        struct.pack_into("<I", b, 32, changes["nsec"])
        hlen = min(36 + 12 * changes["nsec"] + 4, len(b))
    if "length" in changes:
        i, value = changes["length"]
        struct.pack_into("<Q", b, 36 + 12 * i, value)
    struct.pack_into("<I", b, hlen - 4, zlib.crc32(b[: hlen - 4]))
    return bytes(b)


# ---- round trips -------------------------------------------------------------------------


def test_round_trip_of_every_file_in_a_generation():
    image = full_image()
    bodies = files_of(image)
    assert set(bodies) == {pf.MAIN, pf.CKPT, pf.LORA, pf.DRAFT}
    main = pf.decode_main(bodies[pf.MAIN])
    assert main.gen_id == GEN
    assert main.flags == pf.HAS_CKPT | pf.HAS_LORA | pf.HAS_DRAFT
    assert main.tokens == image.tokens and bytes(main.state) == image.state and main.meta == image.meta
    assert decode(pf.CKPT, bodies[pf.CKPT]) == image.checkpoints
    assert decode(pf.LORA, bodies[pf.LORA]) == image.genes
    assert bytes(decode(pf.DRAFT, bodies[pf.DRAFT])) == image.draft


def test_a_generation_without_sidecars_is_one_file_whose_header_says_so():
    bodies = files_of(PageImage(tokens=[], state=b""))
    assert set(bodies) == {pf.MAIN}
    main = pf.decode_main(bodies[pf.MAIN])
    assert main.flags == 0 and main.tokens == [] and bytes(main.state) == b"" and main.meta == {}


@_settings
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=200),
    state=st.binary(max_size=2000),
    checkpoints=st.lists(st.tuples(st.integers(0, 2**40), st.binary(max_size=100)), max_size=5),
    genes=st.lists(
        st.tuples(st.text(max_size=20), st.floats(allow_nan=False), st.integers(-(2**31), 2**31)), max_size=4
    ),
    draft=st.none() | st.binary(max_size=300),
    meta=st.dictionaries(st.text(max_size=10), st.integers() | st.text(max_size=10) | st.booleans(), max_size=4),
)
def test_round_trip_holds_for_any_content(tokens, state, checkpoints, genes, draft, meta):
    meta = {k: v for k, v in meta.items() if not (isinstance(v, int) and not -(2**63) <= v < 2**64)}
    image = PageImage(
        tokens=tokens,
        state=state,
        checkpoints=[StoredCheckpoint(pos=p, data=d) for p, d in checkpoints],
        genes=[StoredGene(path=p, scale=s, id=i) for p, s, i in genes],
        draft=draft,
        meta=meta,
    )
    bodies = files_of(image)
    main = pf.decode_main(bodies[pf.MAIN])
    back = PageImage(
        tokens=main.tokens,
        state=main.state,
        checkpoints=decode(pf.CKPT, bodies[pf.CKPT]) if pf.CKPT in bodies else [],
        genes=decode(pf.LORA, bodies[pf.LORA]) if pf.LORA in bodies else [],
        draft=decode(pf.DRAFT, bodies[pf.DRAFT]) if pf.DRAFT in bodies else None,
        meta=main.meta,
    )
    assert same_image(image, back)


def test_encoding_checksums_and_writes_the_state_buffer_in_place_without_copying():
    state = bytearray(b"s" * 4096)
    parts = pf.encode_generation(PageImage(tokens=[1], state=state), GEN)[pf.MAIN]
    assert isinstance(parts[-1], memoryview) and parts[-1].obj is state


def test_decoded_state_is_a_writable_view_into_the_read_buffer():
    buf = bytearray(files_of(full_image())[pf.MAIN])
    main = pf.decode_main(buf)
    assert isinstance(main.state, memoryview) and not main.state.readonly and main.state.obj is buf


# ---- damage ------------------------------------------------------------------------------


@pytest.mark.parametrize("sfx", pf.SUFFIXES)
def test_truncation_at_each_structural_offset_is_corrupt(sfx):
    buf = files_of(full_image())[sfx]
    hlen = header_len(buf)
    for cut in sorted({0, 1, 7, 8, 12, 31, 35, 36, 40, hlen - 4, hlen - 1, hlen, hlen + 1, len(buf) - 1}):
        with pytest.raises(CorruptPageFile):
            decode(sfx, buf[:cut])


@_settings
@given(data=st.data())
def test_truncation_at_any_offset_is_corrupt(data):
    sfx = data.draw(st.sampled_from(pf.SUFFIXES))
    buf = files_of(full_image())[sfx]
    cut = data.draw(st.integers(0, len(buf) - 1))
    with pytest.raises(CorruptPageFile):
        decode(sfx, buf[:cut])


@_settings
@given(data=st.data())
def test_any_flipped_byte_anywhere_is_corrupt(data):
    sfx = data.draw(st.sampled_from(pf.SUFFIXES))
    buf = bytearray(files_of(full_image())[sfx])
    i = data.draw(st.integers(0, len(buf) - 1))
    buf[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptPageFile):
        decode(sfx, buf)


@pytest.mark.parametrize("offset,why", [(0, "bad magic"), (20, "header checksum"), (40, "header checksum")])
def test_flipped_header_byte_is_corrupt_and_says_why(offset, why):
    buf = bytearray(files_of(full_image())[pf.MAIN])
    buf[offset] ^= 0x40
    with pytest.raises(CorruptPageFile, match=why) as e:
        pf.decode_main(buf, "mind.page")
    assert "mind.page" in e.value.message and e.value.data["file"] == "mind.page"


def test_wrong_version_is_refused_with_the_version_named():
    buf = rewrite_header(files_of(full_image())[pf.MAIN], version=2)
    with pytest.raises(CorruptPageFile, match="unsupported format version 2"):
        pf.decode_main(buf)


def test_trailing_bytes_after_the_last_section_are_corrupt():
    with pytest.raises(CorruptPageFile, match="trailing bytes"):
        pf.decode_main(files_of(full_image())[pf.MAIN] + b"\0")


@pytest.mark.parametrize("sfx", pf.SUFFIXES)
def test_bad_section_checksum_is_corrupt(sfx):
    buf = bytearray(files_of(full_image())[sfx])
    buf[-1] ^= 1
    with pytest.raises(CorruptPageFile, match="checksum mismatch in section"):
        decode(sfx, buf)


def test_absurd_length_is_refused_against_the_file_size_before_allocating():
    buf = rewrite_header(files_of(full_image())[pf.MAIN], length=(2, 2**60))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptPageFile, match="truncated: section lengths describe"):
            pf.decode_main(buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_absurd_section_count_is_refused_before_reading_a_table():
    buf = rewrite_header(files_of(full_image())[pf.CKPT], nsec=2**32 - 1)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptPageFile, match="section table"):
            pf.decode_checkpoints(buf, GEN)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_absurd_length_on_disk_is_refused_without_a_huge_allocation(tmp_path):
    publish_generation(tmp_path, "m.page", full_image(), OsFs())
    p = tmp_path / "m.page"
    p.write_bytes(rewrite_header(p.read_bytes(), length=(2, 2**60)))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptPageFile):
            read_generation(tmp_path, "m.page", OsFs())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_sidecar_of_another_generation_is_a_mixed_set():
    ckpt = files_of(full_image(), OTHER_GEN)[pf.CKPT]
    with pytest.raises(CorruptPageFile, match="another generation"):
        pf.decode_checkpoints(ckpt, GEN)


def test_file_of_the_wrong_kind_is_corrupt():
    with pytest.raises(CorruptPageFile, match="bad magic"):
        pf.decode_main(files_of(full_image())[pf.LORA])


# ---- a generation on disk ----------------------------------------------------------------


def test_round_trip_through_publish_and_read(tmp_path):
    image = full_image()
    stats = publish_generation(tmp_path, "mind.page", image, OsFs())
    assert stats.files == ["mind.page", "mind.page.ckpt", "mind.page.lora", "mind.page.dft"]
    assert stats.n_bytes == sum((tmp_path / f).stat().st_size for f in stats.files)
    assert same_image(read_generation(tmp_path, "mind.page", OsFs()), image)


def test_missing_main_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFound):
        read_generation(tmp_path, "nope.page", OsFs())
    with pytest.raises(FileNotFound):
        read_generation(tmp_path / "no-folder", "nope.page", OsFs())


@pytest.mark.parametrize("sfx", [pf.CKPT, pf.LORA])
def test_missing_checkpoint_or_gene_sidecar_is_corrupt(tmp_path, sfx):
    publish_generation(tmp_path, "m.page", full_image(), OsFs())
    (tmp_path / f"m.page{sfx}").unlink()
    with pytest.raises(CorruptPageFile, match="missing"):
        read_generation(tmp_path, "m.page", OsFs())


def test_missing_draft_sidecar_is_a_cold_draft_and_is_logged(tmp_path, logs):
    publish_generation(tmp_path, "m.page", full_image(), OsFs())
    (tmp_path / "m.page.dft").unlink()
    got = read_generation(tmp_path, "m.page", OsFs())
    assert got.draft is None and got.checkpoints == full_image().checkpoints
    assert [e["reason"] for e in logs if e["event"] == "page_file.cold_draft"] == ["draft sidecar missing"]


def test_sidecar_swapped_in_from_an_older_generation_is_refused(tmp_path):
    publish_generation(tmp_path, "m.page", full_image(1), OsFs())
    old_ckpt = (tmp_path / "m.page.ckpt").read_bytes()
    publish_generation(tmp_path, "m.page", full_image(2), OsFs())
    (tmp_path / "m.page.ckpt").write_bytes(old_ckpt)
    with pytest.raises(CorruptPageFile, match="another generation"):
        read_generation(tmp_path, "m.page", OsFs())


def test_unreadable_main_file_is_a_storage_error_not_file_not_found(tmp_path):
    publish_generation(tmp_path, "m.page", full_image(), OsFs())
    fs = FaultyFs([Fault("read", errno=errno.EACCES, match="m.page")])
    with pytest.raises(StorageError) as e:
        read_generation(tmp_path, "m.page", fs)
    assert not isinstance(e.value, FileNotFound) and e.value.data["errno"] == errno.EACCES


def test_unreadable_draft_sidecar_is_an_error_not_a_cold_draft(tmp_path):
    publish_generation(tmp_path, "m.page", full_image(), OsFs())
    fs = FaultyFs([Fault("read", errno=errno.EIO, match="m.page.dft")])
    with pytest.raises(StorageError):
        read_generation(tmp_path, "m.page", fs)


def test_peek_gen_id_reads_only_a_checked_header(tmp_path):
    p = tmp_path / "x.page.ckpt"
    p.write_bytes(files_of(full_image())[pf.CKPT])
    assert pf.peek_gen_id(OsFs(), p, pf.CKPT) == GEN
    assert pf.peek_gen_id(OsFs(), tmp_path / "absent", pf.CKPT) is None
    p.write_bytes(p.read_bytes()[:30])
    with pytest.raises(CorruptPageFile):
        pf.peek_gen_id(OsFs(), p, pf.CKPT)


def test_encode_refuses_a_malformed_generation_id():
    with pytest.raises(ValueError):
        pf.encode_generation(full_image(), b"short")


def test_sidecar_paths_append_suffixes_to_the_full_name():
    assert pf.sidecar_paths(Path("/p/m.page"))[pf.CKPT] == Path("/p/m.page.ckpt")


# ---- the divergence history (checkpoint placement) ---------------------------------------


def test_divergence_history_and_prompt_end_round_trip_through_a_file(tmp_path):
    image = msgspec_replace(full_image(), divergences=[(120, 400), (130, 410)], prompt_end=410)
    publish_generation(tmp_path, "m.page", image, OsFs())
    back = read_generation(tmp_path, "m.page", OsFs())
    assert back.divergences == [(120, 400), (130, 410)] and back.prompt_end == 410
    assert back.meta == image.meta  # the history is not left in the meta


def test_a_file_written_before_the_history_existed_still_reads_as_nothing_known(tmp_path):
    image = full_image()  # no history: the main file is byte for byte the old format
    old = files_of(image)
    assert b"divergences" not in old[pf.MAIN] and b"prompt_end" not in old[pf.MAIN]
    publish_generation(tmp_path, "m.page", image, OsFs())
    back = read_generation(tmp_path, "m.page", OsFs())
    assert back.divergences == [] and back.prompt_end == 0 and same_image(back, image)


@pytest.mark.parametrize("bad", [{"divergences": "x"}, {"divergences": [[1, 2, 3]]}, {"divergences": [[-1, 2]]},
                                 {"divergences": [[1, 2]] * 2000}, {"prompt_end": -5}, {"prompt_end": "7"}])
def test_a_malformed_history_is_corrupt_and_says_so(tmp_path, bad):
    publish_generation(tmp_path, "m.page", msgspec_replace(full_image(), meta={**full_image().meta, **bad}), OsFs())
    with pytest.raises(CorruptPageFile, match="divergence history|prompt end"):
        read_generation(tmp_path, "m.page", OsFs())


def msgspec_replace(image: PageImage, **changes) -> PageImage:
    import msgspec

    return msgspec.structs.replace(image, **changes)
