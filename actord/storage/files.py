"""The async face of page files: every read, write, fsync and rename on a worker thread.

The engine thread copies bytes out of the context; this module hands the resulting image
to `publish_generation` / `read_generation` through `anyio.to_thread.run_sync` with a
limiter, so disk work never runs on the engine thread or the event loop. A `to_thread`
call is shielded from cancellation by anyio: an fsync that has started finishes.
"""

from __future__ import annotations

from pathlib import Path
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio

from actord.service.errors import ActordError
from actord.storage.osfs import OsFs
from actord.storage.pagefile import PageImage
from actord.storage.paths import confine_file
from actord.storage.publish import PublishStats, publish_generation, read_generation, remove_generation


class PageFiles:
    def __init__(self, root: str | Path, *, threads: int = 4, fs: OsFs | None = None,
                 offload: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.root = Path(root)
        self.fs = fs or OsFs()
        self.limiter = anyio.CapacityLimiter(threads)
        self._offload = offload  # the dispatcher's seam: it may order worker completions
        self._locks: dict[str, list[Any]] = {}  # path -> [lock, holders and waiters]

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
        self.check(name)
        if held:
            return await self._run(f"publish:{name}", publish_generation, self.root, name, image, self.fs)
        async with self.holding(name):
            return await self._run(f"publish:{name}", publish_generation, self.root, name, image, self.fs)

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
        from actord.storage.pagefile import main_n_tokens

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

    async def remove(self, name: str) -> int:
        """Remove page file `name` (every file of its generation); the bytes it held."""
        self.check(name)
        async with self.holding(name):
            return await self._run(f"remove:{name}", remove_generation, self.root, name, self.fs)

    async def read(self, name: str) -> PageImage:
        self.check(name)
        return await self._run(f"read:{name}", read_generation, self.root, name, self.fs)
