"""Gene (LoRA adapter) catalog: placeholder until the genes issue lands; no genes yet."""

from __future__ import annotations

from typing import Any

from actord.engine import jobs as J
from actord.errors import GeneNotFound


class GeneCatalog:
    def __init__(self, model: Any, ctx: Any) -> None:
        self.model = model
        self.ctx = ctx

    def apply(self, genes: tuple[tuple[int, float], ...]) -> None:
        for gid, _ in genes:
            raise GeneNotFound(f"unknown gene {gid}", id=gid)

    def handle(self, job: J.Job) -> Any:
        if isinstance(job, J.GeneList):
            return []
        raise GeneNotFound(f"unknown gene {getattr(job, 'id', None)}")

    def close(self) -> None:
        pass
