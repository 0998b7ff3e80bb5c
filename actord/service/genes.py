"""Gene files read for `gene.load`: who may name which file, within what byte budget, and
how a loaded (or refused) gene's image lets go of its bytes.

Why apart from the façade: the reading rules are storage/clientfiles.py's; this module
only says which reader a path gets (a client's is confined to --gene-dir when set; a file
the operator listed with --gene is not) and keeps the image's lifetime short.
"""

from __future__ import annotations

from typing import Any, Callable

from actord.vocabulary.config import Config
from actord.vocabulary.errors import ActordError
from actord.serving.gene_residency import GeneResidency, LoadGene
from actord.storage.clientfiles import ByteBudget, ClientFiles


class GeneFiles:
    def __init__(self, c: Config, run_sync: Callable[..., Any]) -> None:
        self.operator_paths = set(c.gene)
        # Gene files being read or loaded hold at most max_gene_read_bytes in all, whoever
        # named them; a file must be a GGUF to be read at all.
        self.budget = ByteBudget(c.max_gene_read_bytes)
        self.client = ClientFiles(root=c.gene_dir, max_bytes=c.max_gene_bytes, timeout=c.client_file_timeout,
                                  threads=c.client_file_threads, run_sync=run_sync, budget=self.budget, magic=b"GGUF")
        self.operator = ClientFiles(max_bytes=c.max_gene_bytes, timeout=c.client_file_timeout,
                                    threads=c.client_file_threads, run_sync=run_sync, budget=self.budget, magic=b"GGUF")

    async def load(self, residency: GeneResidency, path: str, default: bool) -> Any:
        files = self.operator if path in self.operator_paths else self.client
        async with files.reading(path) as image:  # counted against --max-gene-read-bytes until loaded
            msg = LoadGene(path=path, image=image, default=default)
            del image
            try:
                return await residency.ask(msg)
            except ActordError as e:
                # A refusal's traceback runs through every frame that held the image (the
                # engine's, the residency's, ours): cut it, so the bytes go now, not whenever
                # the cycle collector next looks.
                del msg
                raise e.with_traceback(None) from None
