"""The actor system's wiring, in one place: every actor gets its peers in its constructor,
and the engine thread they share is started on its chosen CPUs.

Why a builder: the actors form an ask order (the placer above the scheduler above the slots
above the page store, the checkpoint budget and the gene residency), and upward they only
tell. Building them top-down from the bottom of that order means each actor's downward peers
exist when it is made; the one upward reference every layer needs, the slots, is a list
made first and filled last, in this function, so nothing is assigned into an actor after
its constructor ran and no peer is Optional.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from actord.engine import jobs as J
from actord.engine.engine import run_job
from actord.engine.thread import EngineThread
from actord.policy.cpus import choose_engine_cpus
from actord.policy.pipeline import pipeline_depth
from actord.vocabulary.config import Config, engine_threads
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics
from actord.serving.checkpoint_budget import CheckpointBudget
from actord.serving.checkpoint_plan import CheckpointPlan
from actord.serving.gene_residency import GeneResidency
from actord.vocabulary.errors import ActordError
from actord.serving.kernel import Actor, Dispatcher
from actord.serving.messages import SlotLost
from actord.serving.page_store import PageStore
from actord.serving.placer import MindPlacer, Spill
from actord.serving.scheduler import Scheduler
from actord.serving.slot import Slot
from actord.serving.slot_peers import SlotPeers
from actord.serving.kv_index import KvIndex
from actord.storage.files import PageFiles

log = get("actord.service.builder")


@dataclass(frozen=True)
class Actors:
    """The running system's actors, typed."""

    slots: list[Slot]
    scheduler: Scheduler
    pages: PageStore
    residency: GeneResidency
    ckpt_budget: CheckpointBudget
    placer: MindPlacer
    index: KvIndex  # where KV states live: each slot's sequence and the page store's pages, as each published

    def all(self) -> list[Actor[Any]]:
        return [*self.slots, self.scheduler, self.pages, self.residency, self.ckpt_budget, self.placer]


def build_actors(config: Config, props: J.ModelProps, dispatcher: Dispatcher, engine: Any, metrics: Metrics,
                 files: PageFiles, spill: Spill, default_genes: list[int],
                 placer_class: type[MindPlacer] = MindPlacer) -> Actors:
    cap = max(config.mailbox_capacity, 256)
    n = config.slots
    slots: list[Slot] = []  # filled below: the upper actors address the slots by id
    depth = pipeline_depth(config.pipeline_depth, props.device.backend)
    log.info("scheduler.pipeline_depth", depth=depth, asked=config.pipeline_depth, backend=props.device.backend)
    scheduler = Scheduler(
        dispatcher, engine, slots, props.n_batch, metrics, capacity=max(cap, 8 * n),
        n_ctx=props.kv_cells,  # 0: cells not charged
        piece_tile=config.piece_tile, depth=depth, n_slots=n, engine_budget_s=config.request_engine_s,
        yield_after=config.yield_after_tokens,
    )
    # Where KV states live: the slots and the page store publish there, and the page files
    # keep their base files' records in it (with page_file_bases on: no start from one else).
    index = KvIndex(n, base_files=files.base_index if config.page_file_bases else None)
    pages = PageStore(dispatcher, config.page_ram_bytes, metrics, capacity=cap, index=index)
    # --device-bytes as the engine resolved it (0 on a GPU: its free memory less a margin).
    device_budget = props.device.budget_bytes
    residency = GeneResidency(dispatcher, engine, slots, device_budget, metrics, capacity=cap)
    ckpt_budget = CheckpointBudget(dispatcher, config.ctx_checkpoints_bytes, slots, metrics, capacity=cap,
                                   policy=config.checkpoint_policy, cap=1 + config.ctx_checkpoints, n_slots=n)
    placer = placer_class(dispatcher, slots, pages, files, spill, metrics, scheduler, index, kv_cells=scheduler.n_ctx,
                          n_slots=n, capacity=cap, share_bases=config.prefix_sharing)
    peers = SlotPeers(scheduler=scheduler, placer=placer, pages=pages, ckpt_budget=ckpt_budget,
                      residency=residency, files=files, index=index)
    for i in range(n):
        ckpt = CheckpointPlan(
            policy=config.checkpoint_policy, keep=config.ctx_checkpoints, every=config.checkpoint_every,
            align=props.n_batch, tile=config.piece_tile, share_bytes=config.ctx_checkpoints_bytes // max(1, n),
        )
        slots.append(Slot(dispatcher, i, engine, props, metrics, peers, ckpt, default_seed=config.seed,
                          capacity=config.mailbox_capacity, track_footprint=device_budget > 0,
                          default_genes=default_genes, share_prefixes=config.prefix_sharing,
                          swa_window_pages=config.page_swa_window))
    return Actors(slots=slots, scheduler=scheduler, pages=pages, residency=residency, ckpt_budget=ckpt_budget,
                  placer=placer, index=peers.index)


def engine_thread(config: Config, factory: Callable[[Config], Any], dispatcher: Dispatcher) -> EngineThread:
    """The one thread that owns every libllama call, on the CPUs actord/policy/cpus.py
    chooses (decided here, on the thread that starts it, whose mask it inherits)."""
    choice = choose_engine_cpus(config.engine_cpus, os.sched_getaffinity(0), engine_threads(config.threads))
    log.info("engine.cpus", cpus=sorted(choice.cpus) if choice.cpus else None, reason=choice.reason)
    engine = EngineThread(lambda: factory(config), run_job, lambda e: e.close(),
                          defer_s=config.announce_within_ms / 1e3, cpus=choice.cpus)
    engine.on_done = dispatcher.engine_done
    dispatcher.attach_engine(engine)  # a deterministic dispatcher waits for its jobs
    return engine


def failure_handler(actors: Actors, metrics: Metrics) -> Callable[[Actor[Any], BaseException], None]:
    """What the kernel calls when an actor's handler fails: counted, and a slot's cells are
    released through the scheduler (they must not stay charged for good)."""
    def on_failure(actor: Actor[Any], error: BaseException) -> None:
        metrics.actor_failures_total.labels(actor=actor.name).inc()
        if isinstance(actor, Slot) and not actors.scheduler.failed:
            try:
                actors.scheduler.tell_nowait(SlotLost(slot=actor.id))
            except ActordError:
                pass
    return on_failure
