"""A page's spill to its page file: the store holds the page for the whole write, and the
RAM page goes only once its file is durable.

Why apart from the façade: the placer spills too (the oldest page it made, when the page RAM
ceiling refuses a page-out), through the same function the `page.spill` verb runs, so both
keep one rule: a failed or cancelled spill (a full or read-only page folder, EIO) leaves the
page where it was, and no other publication of the file can come between its write and its
drop.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from actord.engine import jobs as J
from actord.vocabulary.errors import ActordError
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics
from actord.serving.kernel import Actor
from actord.serving.page_store import PageStoreInbox, SpillBegin, SpillEnd
from actord.serving.slot import page_image
from actord.storage.files import PageFiles
from actord.vocabulary.names import MIND_FILE_SUFFIX

log = get("actord.service.spill")


async def spill_page(pages: Actor[PageStoreInbox], files: PageFiles, props: J.ModelProps, metrics: Metrics,
                     page: str, file: str, drop: bool, *, kept: bool = False) -> dict[str, Any]:
    files.check(file)
    t0 = time.perf_counter()
    async with files.holding(file):  # no other publication of `file` until the drop
        held = await pages.ask(SpillBegin(name=page))
        dropped = False
        durable = False
        try:
            stats = await files.publish(
                file, page_image(props, held.state, held.checkpoints, held.tokens, held.genes,
                                 held.divergences, held.prompt_end, draft=held.draft, draft_n=held.draft_n,
                                 base=held.base.state if held.base is not None else None, n_base=held.n_base,
                                 scope=held.scope, gene_digests=held.gene_digests, kept=kept),
                held=True)
            durable = True  # publish returns only once every file and folder is fsynced
        except ActordError as e:
            metrics.page_failed_total.inc()
            log.warning("page.spill_failed", page=page, file=file, kept=True, error=e.to_dict())
            raise
        finally:
            with anyio.CancelScope(shield=True):
                dropped = await pages.ask(SpillEnd(gen=held.gen, drop=drop and durable,
                                                   persisted=durable and file == page + MIND_FILE_SUFFIX))
    metrics.page_spill_total.inc()
    t_ms = (time.perf_counter() - t0) * 1e3
    log.info("page.spilled", page=page, file=file, n_bytes=stats.n_bytes, dropped=dropped, t_ms=round(t_ms, 3))
    return {"page": page, "file": file, "n_bytes": stats.n_bytes, "dropped": dropped, "t_ms": t_ms}
