"""What the system reports about itself: `props`, `health`, `memory` (every tier at once,
for the dashboard), the start-up lines, and the final state a replay must reproduce.

Why apart from the façade: these read the running system's parts (its model props, its
actors' failures and state) and shape them for a caller; the façade keeps the verbs.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from actord.engine.jobs import ModelProps
from actord.service.builder import Actors
from actord.vocabulary.config import Config
from actord.vocabulary.log import get
from actord.vocabulary.metrics import Metrics
from actord.vocabulary.kv_identity import client_name
from actord.service import tenancy
from actord.service.protocol import BudgetView, MemoryView, MindView
from actord.vocabulary.trace import digest
from actord.serving.checkpoint_budget import BudgetStats
from actord.serving.gene_residency import ListGenes
from actord.serving.kernel import Actor
from actord.serving.messages import Info
from actord.serving.page_store import ListPages, StoreStats
from actord.storage.disk_index import DiskIndex

log = get("actord.service.system")

PROPS_VERSION = {"slot_page_version": 1, "lora_page_version": 1}


def props_dict(model: str, n_slots: int, http_address: str | None, props: ModelProps) -> dict[str, Any]:
    return {
        "model": model,
        "n_slots": n_slots,
        **({"http": http_address} if http_address else {}),
        **msgspec.to_builtins(props),
        **PROPS_VERSION,
    }


def health(actors: list[Actor[Any]], started: float, engine_queue: int) -> dict[str, Any]:
    failed = [a.name for a in actors if a.failed]
    return {
        "status": "ok" if not failed else "degraded",
        "failed_actors": failed,
        "uptime_s": round(time.time() - started, 3),
        "engine_queue": engine_queue,
    }


def log_started(props: ModelProps, config: Config) -> None:
    dev = props.device
    log.info("system.device", backend=dev.backend, device=dev.device, n_gpu_layers=dev.n_gpu_layers,
             flash_attn=dev.flash_attn, flash_attn_used=dev.flash_attn_used, free_bytes=dev.free_bytes,
             device_budget=dev.budget_bytes, device_budget_reason=dev.budget_reason)
    log.info("system.started", model=config.model, slots=config.slots, ctx=props.n_ctx,
             swa_full=props.swa_full, swa_full_reason=props.swa_full_reason,
             needs_checkpoints=props.needs_checkpoints, checkpoint_policy=config.checkpoint_policy)


def final_state(a: Actors | None, metrics: Metrics) -> dict[str, Any]:
    """What a replay must reproduce: each actor's state that outlives a request (`a`: the
    actors, None before the start). It reads the actors' fields: it runs once they stopped."""
    # Wall-clock series (creation stamps, seconds busy) differ run to run: not state.
    series = {k: v for k, v in metrics.snapshot().items() if "_created" not in k and "_seconds" not in k}
    return {
        "slots": [(s.id, digest(s.kv_tokens), s.resume_raw_lcp, [(c.pos, c.n_bytes) for c in s.checkpoints],
                   s.genes, s.mind) for s in (a.slots if a else [])],
        "pages": sorted((n, g) for n, g in a.pages.names.items()) if a else [],
        "charged": a.pages.charged if a else 0,
        "genes": sorted((g.id, g.resident) for g in a.residency.genes.values()) if a else [],
        "ckpt_used": a.ckpt_budget.used if a else 0,
        "metrics": sorted(series.items()),
    }


# The counters a front turns into rates (tokens/s, first-token latency, prompt tokens
# processed vs cached), by their names in the registry's snapshot.
MEMORY_COUNTERS = ("prompt_tokens_total", "prompt_tokens_processed_total", "prompt_tokens_cached_total",
                   "predicted_tokens_total",
                   "first_token_seconds_sum", "first_token_seconds_count", "page_out_total", "page_in_total")


def answered(metrics: Metrics, result: Any) -> Any:
    """A completion's result, its first-token latency observed on the way out: the time it
    queued plus its prompt's (the first token is sampled at the prompt's last step)."""
    t = getattr(result, "timings", None)
    if t is not None:
        metrics.first_token_seconds.observe((t.queued_ms + t.prompt_ms) / 1e3)
    return result


async def memory(a: Actors, disk: DiskIndex, props: ModelProps, metrics: Metrics, after: str = "",
                 limit: int = 0) -> MemoryView:
    """Every tier of memory at once, for the dashboard (frontends/http/dashboard.py).

    Not recorded for traces, unlike `slot.list` and the stats verbs it overlaps: a page
    polls it every second, and a read that changes nothing is no input a replay needs. It
    asks the same actors those verbs ask; the minds on disk come from the page folder's
    index (storage/disk_index.py), with no disk access.

    Paginated by mind name (issue 34: 10,000 minds): the minds named after `after`, at most
    `limit` names (0: all), each in every tier that holds her (a RAM page and its file
    written behind are two entries); `next` is the cursor for the following page."""
    scope = tenancy.scope()  # a front's client sees her own scope's minds, by her names
    slots = [tenancy.own_slot(await s.ask(Info(scope=scope)), scope) for s in a.slots]
    pages = await a.pages.ask(ListPages(after=after, limit=limit, scope=scope))
    store = await a.pages.ask(StoreStats())
    ckpt = await a.ckpt_budget.ask(BudgetStats())
    genes = await a.residency.ask(ListGenes())
    # A slot's state as a page of it would hold it (what a page move copies); the device
    # budget counts it only where there is one, so it is computed, not read.
    minds = [MindView(name=s.mind, tier="slot", n_tokens=s.n_tokens, slot=s.id,
                      n_bytes=props.recurrent_state_bytes + s.n_tokens * props.kv_bytes_per_token)
             for s in slots if s.mind is not None and s.mind > after]
    minds += [MindView(name=p.page, tier="page", n_bytes=p.n_bytes, n_tokens=p.n_tokens,
                       base=p.base if p.base >= 0 else None, n_base=p.n_base, base_bytes=p.base_bytes) for p in pages]
    if scope is None:
        files = disk.minds(after, limit)
    else:  # O(files): the folder's index is kept by the names as kept
        files = sorted((c, b) for n, b in disk.minds() if (c := client_name(n, scope)) is not None and c > after)
        files = files[:limit] if limit else files
    minds += [MindView(name=n, tier="file", n_bytes=b) for n, b in files]
    minds.sort(key=lambda m: m.name)
    nxt = None
    if limit:
        names = sorted({m.name for m in minds})
        if len(names) > limit:
            nxt = names[limit - 1]
            minds = [m for m in minds if m.name <= nxt]
        elif len(names) == limit:
            nxt = names[-1]
    gene_bytes = sum(g.n_bytes for g in genes)
    budgets = [
        BudgetView(name="page_ram", used=store.charged, limit=store.ceiling),
        BudgetView(name="checkpoints", used=ckpt.used, limit=ckpt.budget),
        BudgetView(name="device", used=a.residency.device_bytes(), limit=props.device.budget_bytes),
        BudgetView(name="genes_resident", used=sum(g.n_bytes for g in genes if g.resident), limit=gene_bytes),
    ]
    snap = metrics.snapshot()
    return MemoryView(time=time.time(), slots=slots, minds=minds, budgets=budgets,
                      genes=[msgspec.to_builtins(g) for g in genes],
                      counters={k: snap.get(k, 0.0) for k in MEMORY_COUNTERS}, next=nxt)
