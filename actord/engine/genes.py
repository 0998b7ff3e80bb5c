"""Gene (LoRA adapter) catalog: mechanism for loading, paging and applying adapters.

A gene's bytes (its GGUF image) live in host RAM from load to unload; its device copy is a
libllama adapter that exists only while the gene is resident. page_out frees the adapter
(`llama_adapter_lora_free`); page_in rebuilds it from the host image through an in-memory
FILE (`fmemopen` + `llama_adapter_lora_init_from_file_ptr`), so no disk is touched. The
gene's id is ours, not libllama's pointer, so it never changes across moves: slot gene
lists, KV computed under a gene and saved pages stay valid. An id names one content: a
gene loaded again after its unload gets its old id back (so the pages and slot states
computed under it are hers again, not re-prefilled), and no other content ever gets it.

Adapters are set per context, and only here: `apply` sets exactly the step's gene set and
refuses to decode with a gene whose device copy is gone (never a decode on freed memory).
Runs only on the engine thread; it never decides what to page (GeneResidency does).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterator

from actord.engine import jobs as J
from actord.engine.llama import lib
from actord.vocabulary.errors import EngineError, GeneNotFound, InvalidParams

_libc = ctypes.CDLL(None)
_libc.fmemopen.restype = ctypes.c_void_p
_libc.fmemopen.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.fclose.argtypes = [ctypes.c_void_p]


class GeneNotResident(EngineError):
    """A step asked for a gene whose device copy is paged out (a scheduling bug)."""


@dataclass
class _Gene:
    id: int
    path: str
    image: bytes  # the adapter's GGUF bytes, kept in host RAM
    adapter: Any  # libllama adapter pointer while resident, else None
    moved: int = 0
    digest: str = ""  # of `image`: the gene by content (page files name genes by it)


@dataclass
class DetachedGenes:
    """The catalog across a sleep (`detach` to `attach`): its genes with their host images,
    which of them were resident, the id counter and the unloaded genes' ids by content, so
    an id never names another content."""

    genes: dict[int, _Gene]
    resident: set[int]
    ids: Iterator[int]
    retired: dict[str, int]


class GeneCatalog:
    def __init__(self, model: Any, ctx: Any) -> None:
        self.model = model
        self.ctx = ctx
        self.genes: dict[int, _Gene] = {}
        self._ids = itertools.count(1)
        self._retired: dict[str, int] = {}  # an unloaded gene's digest -> its id, for her return
        self._applied: tuple[tuple[int, float], ...] = ()

    def handle(self, job: J.Job) -> Any:
        match job:
            case J.GeneLoad(path=path, image=image):
                return self.load(path, image)
            case J.GeneUnload(id=gid):
                return self.unload(gid)
            case J.GenePageOut(id=gid):
                return self.page_out(gid)
            case J.GenePageIn(id=gid):
                return self.page_in(gid)
            case J.GeneList():
                return [self.info(g) for g in self.genes.values()]
        raise InvalidParams(f"not a gene job: {type(job).__name__}")

    def _get(self, gid: int) -> _Gene:
        g = self.genes.get(gid)
        if g is None:
            raise GeneNotFound(f"no gene {gid}", id=gid)
        return g

    def info(self, g: _Gene, moved: int = 0, t_ms: float = 0.0) -> J.GeneInfo:
        return J.GeneInfo(id=g.id, path=g.path, resident=g.adapter is not None, n_bytes=len(g.image),
                          n_moved=moved, t_ms=t_ms, digest=g.digest)

    def _build(self, image: bytes) -> Any:
        # Read-only fmemopen straight over the immutable host image: no copy (the gene
        # record keeps `image` alive for the whole call).
        buf = ctypes.c_char_p(image)
        fp = _libc.fmemopen(ctypes.cast(buf, ctypes.c_void_p), len(image), b"rb")
        if not fp:
            raise EngineError("fmemopen failed")
        try:
            adapter = lib.llama_adapter_lora_init_from_file_ptr(self.model, fp)
        finally:
            _libc.fclose(fp)
        if not adapter:
            raise InvalidParams("not a LoRA adapter for this model")
        return adapter

    def load(self, path: str, image: bytes) -> J.GeneInfo:
        t0 = time.perf_counter()
        adapter = self._build(image)
        digest = hashlib.blake2b(image, digest_size=16).hexdigest()
        gid = self._retired.pop(digest, None)
        g = _Gene(id=gid if gid is not None else next(self._ids), path=path, image=image, adapter=adapter,
                  digest=digest)
        self.genes[g.id] = g
        return self.info(g, len(image), (time.perf_counter() - t0) * 1e3)

    def _free_device(self, g: _Gene) -> None:
        if any(gid == g.id for gid, _ in self._applied):
            lib.llama_set_adapters_lora(self.ctx, None, 0, None)
            self._applied = ()
        lib.llama_adapter_lora_free(g.adapter)
        g.adapter = None

    def unload(self, gid: int) -> J.GeneInfo:
        g = self._get(gid)
        if g.adapter is not None:
            self._free_device(g)
        del self.genes[gid]
        if g.digest:
            self._retired[g.digest] = gid
        g.image = b""  # the host copy goes with the gene
        return self.info(g)

    def page_out(self, gid: int) -> J.GeneInfo:
        g = self._get(gid)
        if g.adapter is None:
            return self.info(g)  # idempotent
        t0 = time.perf_counter()
        self._free_device(g)
        return self.info(g, len(g.image), (time.perf_counter() - t0) * 1e3)

    def page_in(self, gid: int) -> J.GeneInfo:
        g = self._get(gid)
        if g.adapter is not None:
            return self.info(g)
        t0 = time.perf_counter()
        g.adapter = self._build(g.image)
        return self.info(g, len(g.image), (time.perf_counter() - t0) * 1e3)

    def apply(self, genes: tuple[tuple[int, float], ...]) -> None:
        if genes == self._applied:
            return
        adapters = []
        for gid, _ in genes:
            g = self._get(gid)
            if g.adapter is None:
                raise GeneNotResident(f"gene {gid} is paged out", id=gid)
            adapters.append(g.adapter)
        n = len(genes)
        arr = (lib.llama_adapter_lora_p_ctypes * n)(*adapters) if n else None
        scales = (ctypes.c_float * n)(*[s for _, s in genes]) if n else None
        rc = lib.llama_set_adapters_lora(self.ctx, arr, n, scales)
        if rc != 0:
            raise EngineError("llama_set_adapters_lora failed", rc=rc)
        self._applied = genes

    def host_bytes(self) -> int:
        return sum(len(g.image) for g in self.genes.values() if g.adapter is None)

    def detach(self) -> DetachedGenes:
        """For a sleep: free every device copy (the context and model go next) and hand over
        the genes with their host images, the ids, and which were resident."""
        resident = {gid for gid, g in self.genes.items() if g.adapter is not None}
        for gid in resident:
            self._free_device(self.genes[gid])
        kept = DetachedGenes(genes=dict(self.genes), resident=resident, ids=self._ids, retired=self._retired)
        self.genes.clear()
        return kept

    def attach(self, kept: DetachedGenes) -> None:
        """After a wake, on the new model: the same genes under the same ids, those that were
        resident built again from their images (GeneResidency's view never changed)."""
        self._ids, self._retired = kept.ids, kept.retired
        self.genes.update(kept.genes)
        for gid in sorted(kept.resident):
            g = self.genes[gid]
            g.adapter = self._build(g.image)

    def close(self) -> None:
        if self._applied:
            lib.llama_set_adapters_lora(self.ctx, None, 0, None)
        for g in self.genes.values():
            if g.adapter is not None:
                lib.llama_adapter_lora_free(g.adapter)
                g.adapter = None
        self.genes.clear()
