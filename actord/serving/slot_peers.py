"""Whom a slot and its parts speak to: one record, given at construction."""

from __future__ import annotations

from dataclasses import dataclass

from actord.serving.checkpoint_budget import CheckpointInbox
from actord.serving.gene_residency import GeneInbox
from actord.serving.kernel import Actor
from actord.serving.messages import SchedulerInbox
from actord.serving.page_store import PageStoreInbox
from actord.serving.placer import PlacerInbox
from actord.serving.kv_index import KvIndex
from actord.storage.files import PageFiles


@dataclass(frozen=True)
class SlotPeers:
    """Whom a slot speaks to, given at construction (the builder, service/builder.py, makes
    them in ask order, so each exists before the slots). Upward (tells only): the scheduler
    and the placer. Downward (asks): the page store, the checkpoint budget, the gene
    residency, and the page files on worker threads. `index` is where every slot publishes
    what its sequence holds and asks what the others hold (serving/kv_index.py): no
    slot reads another's fields."""

    scheduler: Actor[SchedulerInbox]
    placer: Actor[PlacerInbox]
    pages: Actor[PageStoreInbox]
    ckpt_budget: Actor[CheckpointInbox]
    residency: Actor[GeneInbox]
    files: PageFiles
    index: KvIndex
