"""The async face of page files: every read, write, fsync and rename on a worker thread.

The engine thread copies bytes out of the context; this module hands the resulting image
to `publish_generation` / `read_generation` through `anyio.to_thread.run_sync` with a
limiter, so disk work never runs on the engine thread or the event loop. A `to_thread`
call is shielded from cancellation by anyio: an fsync that has started finishes.

It also keeps the page folder's index (storage/disk_index.py), filled by `start` and kept by
every publication, read and removal made here, and holds the disk budget with it: before a
generation is written, the least recently used minds' files not in use are removed (crash
safely, `remove_generation`) until it fits, else it is refused (`PageDiskExceeded`) with
nothing written.
"""

from __future__ import annotations

from pathlib import Path
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import msgspec

from actord.vocabulary.errors import ActordError, CorruptPageFile, FileNotFound, PageDiskExceeded
from actord.vocabulary.log import get
from actord.storage import bases as B
from actord.storage.disk_index import DiskIndex, scan
from actord.storage.osfs import OsFs
from actord.storage.pagefile import KEPT_META, PageImage, main_head, main_meta, main_n_tokens
from actord.storage.paths import confine_file
from actord.storage.publish import PublishStats, publish_generation, read_generation, recover_folder, remove_generation

log = get("actord.storage")
_META_ENC = msgspec.msgpack.Encoder()

# What a generation's files add to its state, checkpoint and draft bytes: four containers'
# headers, the sections' table, the gene list, the meta. The budget admits a publication by
# this estimate (an upper bound within a few hundred bytes) before it is encoded on its
# worker thread, then charges its true size.
_OVERHEAD = 512


def image_bytes(image: PageImage) -> int:
    def n(b: Any) -> int:
        return 0 if b is None else memoryview(b).nbytes

    meta = len(_META_ENC.encode(image.meta)) if image.meta else 0
    return (n(image.state) + n(image.base) + n(image.draft) + 4 * len(image.tokens) + meta
            + sum(n(c.data) + 20 for c in image.checkpoints) + 64 * len(image.genes)
            + 16 * len(image.divergences) + _OVERHEAD)


class PageFiles:
    def __init__(self, root: str | Path, *, threads: int = 4, fs: OsFs | None = None,
                 offload: Callable[..., Awaitable[Any]] | None = None, disk_bytes: int = 0,
                 metrics: Any = None, share_bases: bool = False) -> None:
        self.root = Path(root)
        self.fs = fs or OsFs()
        self.limiter = anyio.CapacityLimiter(threads)
        self._offload = offload  # the dispatcher's seam: it may order worker completions
        self._locks: dict[str, list[Any]] = {}  # path -> [lock, holders and waiters]
        self.index = DiskIndex(disk_bytes)
        # Per file, how many generations this process published or removed: a reader that
        # notes it learns, with no disk access (and nothing a trace would see differ from
        # run to run, as a stat's times would), whether the file changed since.
        self.versions: dict[str, int] = {}
        self.metrics = metrics  # actord.vocabulary.metrics.Metrics, or None (a bare PageFiles)
        # Base files (storage/bases.py): a page on a base spills as its part + a reference.
        self.share_bases = share_bases
        self.refs = B.BaseRefs()
        # The base files by their tokens and identity, kept here as they are published,
        # removed and swept; asked through the KV index (serving/kv_index.py `base_file_for`).
        self.base_index = B.BaseIndex()
        self.pinned: set[str] = set()  # bases a publication that failed may name: kept until the next start
        self._drops: set[str] = set()  # bases whose last user went while locks were held: removed after

    async def start(self) -> int:
        """Complete publications a crash cut short, remove orphaned stages, and index the
        page folder (names and sizes; no file is read). Returns the files indexed."""
        def load() -> list[tuple[str, int, int]]:
            if self.fs.stat(self.root) is None:
                return []
            try:
                recover_folder(self.root, self.fs)
            except ActordError as e:  # the reads of the files concerned refuse them, typed
                log.warning("page_files.recover_failed", error=e.to_dict())
            return scan(self.root, self.fs)

        # Not through the dispatcher's seam: start-up work before any actor runs, and its
        # answer (modification times) is no event a trace could reproduce.
        self.index.load(await anyio.to_thread.run_sync(load, limiter=self.limiter))
        self._gauges()
        return len(self.index.files)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.page_disk_bytes.set(self.index.used)
            self.metrics.page_disk_files.set(len(self.index.files))

    def version(self, name: str) -> int:
        return self.versions.get(self._key(name), 0)

    def _changed(self, key: str) -> None:
        self.versions[key] = self.versions.get(key, 0) + 1

    def _key(self, name: str) -> str:
        return str(self.check(name).relative_to(self.root.resolve()))

    async def _make_room(self, name: str, n_bytes: int) -> None:
        """Evict least recently used minds' files until `n_bytes` for `name` fit the disk
        budget; refused (nothing written, nothing evicted) when they cannot."""
        idx = self.index
        need = idx.over(name, n_bytes)
        if not need:
            return
        victims = list(idx.victims(need, lambda v: v == name or str(self.root.resolve() / v) in self._locks))
        if sum(idx.files[v] for v in victims) < need:  # refused before anything is evicted
            if self.metrics is not None:
                self.metrics.page_disk_refused_total.inc()
            log.info("page_file.disk_refused", file=name, n_bytes=n_bytes, used=idx.used, budget=idx.budget)
            raise PageDiskExceeded(f"page file {name} ({n_bytes} bytes) would pass the page disk budget",
                                   file=name, n_bytes=n_bytes, used=idx.used, reserved=idx.reserved,
                                   budget=idx.budget)
        spare = lambda v: v == name or str(self.root.resolve() / v) in self._locks  # noqa: E731
        while idx.over(name, n_bytes):
            v = next(idx.victims(1, spare), None)
            if v is None:  # taken meanwhile by publications of their own: refused after all
                raise PageDiskExceeded(f"page file {name} ({n_bytes} bytes) would pass the page disk budget",
                                       file=name, n_bytes=n_bytes, used=idx.used, budget=idx.budget)
            seen = self.versions.get(v, 0)
            async with self.holding(v):
                if self.versions.get(v, 0) != seen or v not in idx.files:
                    continue  # published (or removed) while this waited: used just now, not a victim
                if B.is_base(v):
                    self.base_index.drop(B.key_of(v))
                freed = await self._run(f"remove:{v}", remove_generation, self.root, v, self.fs)
                idx.remove(v)
                self._changed(v)
                gone = self.refs.set(v, None)
                if gone is not None:
                    self._drops.add(gone)  # removed once the publication's holds are let go
            if self.metrics is not None:
                self.metrics.page_disk_evicted_total.inc()
            log.warning("page_file.evicted", file=v, n_bytes=freed, reason="page disk budget", for_file=name)
        self._gauges()

    async def remove(self, name: str) -> int:
        """Remove page file `name`'s generation (crash-safe); the bytes it held."""
        key = self._key(name)
        async with self.holding(name):
            if B.is_base(key):
                self.base_index.drop(B.key_of(key))
            freed = await self._run(f"remove:{name}", remove_generation, self.root, name, self.fs)
        self.index.remove(key)
        self._changed(key)
        gone = self.refs.set(key, None) if not B.is_base(key) else None
        if gone is not None:
            self._drops.add(gone)
        await self._drop_bases()
        return freed

    async def _run(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self._offload is not None:
            return await self._offload(op, fn, *args, limiter=self.limiter)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    def check(self, name: str) -> Path:
        """Refuse a name that escapes the page folder before any work is done."""
        self.fs.makedirs(self.root)  # StorageError (typed) on a read-only or failing disk
        return confine_file(self.root, name)

    @contextlib.asynccontextmanager
    async def holding(self, name: str) -> AsyncIterator[None]:
        """Publications of `name` wait while this is held: a spill holds it from its write to
        its drop, so the file it dropped its page for is still that page when it drops."""
        key = str(self.check(name))
        entry = self._locks.setdefault(key, [anyio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[key]

    async def publish(self, name: str, image: PageImage, *, held: bool = False) -> PublishStats:
        """Publish one generation; `held`: the caller holds `holding(name)` already."""
        if held:
            stats = await self._publish_page(name, image)
        else:
            async with self.holding(name):
                stats = await self._publish_page(name, image)
        await self._drop_bases()
        return stats

    async def _publish_page(self, name: str, image: PageImage) -> PublishStats:
        """A page file's generation; one on a base is published as its part and a reference
        to the base's file (made first, durable before any file names it), under the
        base's hold, so the base cannot go between the check and the reference."""
        key = self._key(name)
        if B.is_base(key):
            return await self._publish(name, image)
        if not (self.share_bases and image.base is not None and image.n_base > 0):
            stats = await self._published(key, None, self._publish(name, image))
            return stats
        parts = B.split(image)
        if parts is None:  # genes not all named by content: no base file may stand for them
            return await self._published(key, None, self._publish(name, image))
        base_key, base_image, image = parts
        bname = B.base_name(base_key)
        async with self.holding(bname):
            if bname not in self.index.files:
                await self._publish(bname, base_image)
            entry = B.entry_of(base_image.meta, base_image.tokens)
            if entry is not None:
                self.base_index.add(base_key, entry)
            return await self._published(key, base_key, self._publish(name, image))

    async def _published(self, key: str, base_key: str | None, publication: Awaitable[PublishStats]) -> PublishStats:
        try:
            stats = await publication
        except BaseException:
            if base_key is not None:  # it may have committed all the same: its base stays
                self.pinned.add(base_key)
            raise
        gone = self.refs.set(key, base_key)
        if gone is not None:
            self._drops.add(gone)
        return stats

    async def _drop_bases(self) -> None:
        """Remove the base files whose last user went (once every file's reference is known)."""
        while self._drops:
            key = self._drops.pop()
            bname = B.base_name(key)
            async with self.holding(bname):
                if not self.refs.known or key in self.pinned or self.refs.users.get(key) \
                        or bname not in self.index.files:
                    continue
                self.base_index.drop(key)  # no start finds it from here on
                freed = await self._run(f"remove:{bname}", remove_generation, self.root, bname, self.fs)
                self.index.remove(bname)
                self._changed(bname)
            log.info("page_file.base_removed", base=key, n_bytes=freed)
        self._gauges()

    def _head_of(self, name: str, parse: Callable[[bytes, str], Any]) -> Any:
        """(On a worker.) What `parse` reads of page file `name`'s header: from its first 64
        KiB, else the whole file (a long header); None where it says nothing, or the file is
        gone or unreadable."""
        try:
            head = self.fs.read_file(self.root / name, limit=64 << 10)
            got = None if head is None else parse(head, name)
            if got is None and head is not None:
                got = parse(self.fs.read_file(self.root / name) or b"", name)
            return got
        except ActordError:
            return None

    async def sweep(self) -> int:
        """After start, in the background: read the header of every page file found at start:
        whether a client kept it by name (the disk budget evicts no file of those before
        this has run), and, with base files, the base it names, then remove the base files
        nobody names (a crash between a referrer's removal and its base's). Until it has run
        no base file is removed. The orphans removed."""
        if self.share_bases:
            self.refs.live.clear()
        names = [n for n in self.index.files if not B.is_base(n)]
        bases = [n for n in self.index.files if B.is_base(n)]

        def base_heads() -> dict[str, B.BaseEntry]:
            out: dict[str, B.BaseEntry] = {}
            for n in bases:  # unreadable: no start will find it
                got = self._head_of(n, main_head)
                entry = None if got is None else B.entry_of(*got)
                if entry is not None:
                    out[B.key_of(n)] = entry
            return out

        def heads() -> dict[str, tuple[str | None, bool]]:
            out: dict[str, tuple[str | None, bool]] = {}
            for n in names:  # unreadable: no restore will ever need its base, nor keep it
                meta = self._head_of(n, main_meta)
                out[n] = (None, False) if meta is None else (B.referred(meta), bool(meta.get(KEPT_META)))
            return out

        read = await self._run("sweep:heads", heads)
        for n, (_, kept) in read.items():
            self.index.learned(n, kept)
        if not self.share_bases:
            return 0
        for n, (key, _) in read.items():
            if n not in self.refs.live and key is not None:
                self.refs.set(n, key, live=False)
        self.refs.known = True
        orphans = {B.key_of(n) for n in self.index.files if B.is_base(n)}
        orphans -= set(self.refs.users)
        for k, entry in (await self._run("sweep:base_heads", base_heads)).items():
            if k not in orphans and B.base_name(k) in self.index.files and not self.base_index.add(k, entry):
                log.warning("page_file.base_mislabelled", base=k)  # its identity is not its key: never a start
        self._drops |= orphans
        await self._drop_bases()
        if orphans:
            log.info("page_file.bases_swept", orphans=len(orphans))
        return len(orphans)

    async def read_base(self, key: str) -> PageImage:
        """Base file `key`'s generation (tokens, state, identity), read under its hold, so
        that its removal waits; CorruptPageFile when it is not what the index says."""
        bname = B.base_name(key)
        entry = self.base_index.entries.get(key)
        async with self.holding(bname):
            if entry is None or bname not in self.index.files:
                raise FileNotFound(f"no base file {key}", file=bname)
            image = await self._run(f"read:{bname}", read_generation, self.root, bname, self.fs)
        self.index.touch(bname)
        got = B.entry_of(image.meta, image.tokens)
        if got != entry:
            self.base_index.drop(key)
            raise CorruptPageFile(f"base file {bname} does not hold what its key says", file=bname)
        return image

    async def _publish(self, name: str, image: PageImage) -> PublishStats:
        key = self._key(name)
        estimate = image_bytes(image)
        await self._make_room(key, estimate)
        self.index.reserved += estimate
        try:
            stats = await self._run(f"publish:{name}", publish_generation, self.root, name, image, self.fs)
        finally:
            self.index.reserved -= estimate
            self._changed(key)  # a publication that failed may have committed all the same
        self.index.set(key, stats.n_bytes, kept=bool(image.meta.get(KEPT_META)))
        self._gauges()
        return stats

    async def exists(self, name: str) -> bool:
        path = self.check(name)
        return await self._run(f"exists:{name}", lambda: self.fs.stat(path) is not None)

    async def signature(self, name: str) -> tuple[int, int, int] | None:
        """(inode, mtime ns, size) of the committed main file, or None when there is none:
        tells whether a generation was published since it was last looked at."""
        path = self.check(name)

        def sig() -> tuple[int, int, int] | None:
            st = self.fs.stat(path)
            return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)

        return await self._run(f"exists:{name}", sig)

    async def n_tokens(self, name: str) -> int | None:
        """The tokens page file `name` holds, from its header alone (a restore's cells are
        held before it reads the whole file); None when there is no such file or it is too
        short to say (the restore's own read refuses it, typed)."""
        path = self.check(name)

        def peek() -> int | None:
            head = self.fs.read_file(path, limit=4096)
            if head is None:
                return None
            try:
                return main_n_tokens(head, name)
            except ActordError:
                return None  # corrupt: the restore says so
        return await self._run(f"read:{name}", peek)

    async def read(self, name: str) -> PageImage:
        key = self._key(name)
        image = await self._run(f"read:{name}", read_generation, self.root, name, self.fs)
        self.index.touch(key)
        base_key = B.referred(image.meta)
        if base_key is None:
            return image
        n = image.meta.get(B.N_META)
        bname = B.base_name(base_key)
        try:
            base = await self._run(f"read:{bname}", read_generation, self.root, bname, self.fs)
        except ActordError as e:
            raise CorruptPageFile(f"{name} stands on base file {bname}, which cannot be read: {e.message}",
                                  file=name, base=bname) from None
        if type(n) is not int or not 0 < n < len(image.tokens) or list(base.tokens) != list(image.tokens[:n]):
            raise CorruptPageFile(f"{name}'s base file {bname} does not hold its first {n!r} tokens", file=name,
                                  base=bname)
        self.index.touch(bname)
        meta = {k: v for k, v in image.meta.items() if k not in (B.FILE_META, B.N_META)}
        return msgspec.structs.replace(image, base=base.state, n_base=n, meta=meta)
