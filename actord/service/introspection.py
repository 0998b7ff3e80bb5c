"""What the system reports about itself: `props`, `health`, the start-up lines, and the
final state a replay must reproduce.

Why apart from the façade: these read the running system's parts (its model props, its
actors' failures and state) and shape them for a caller; the façade keeps the verbs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from actord.service.log import get

if TYPE_CHECKING:
    from actord.service.system import ActorSystem

log = get("actord.service.system")

PROPS_VERSION = {"slot_page_version": 1, "lora_page_version": 1}


def props_dict(system: "ActorSystem") -> dict[str, Any]:
    return {
        "model": system.config.model,
        "n_slots": len(system.slots),
        **({"http": system.http_address} if system.http_address else {}),
        **msgspec.to_builtins(system.props),
        **PROPS_VERSION,
    }


def health(system: "ActorSystem", started: float) -> dict[str, Any]:
    failed = [a.name for a in system.actors() if a.failed]
    return {
        "status": "ok" if not failed else "degraded",
        "failed_actors": failed,
        "uptime_s": round(time.time() - started, 3),
        "engine_queue": system.engine.queued,
    }


def log_started(system: "ActorSystem") -> None:
    props, config = system.props, system.config
    dev = props.device
    log.info("system.device", backend=dev.backend, device=dev.device, n_gpu_layers=dev.n_gpu_layers,
             flash_attn=dev.flash_attn, flash_attn_used=dev.flash_attn_used, free_bytes=dev.free_bytes,
             device_budget=dev.budget_bytes, device_budget_reason=dev.budget_reason)
    log.info("system.started", model=config.model, slots=config.slots, ctx=props.n_ctx,
             swa_full=props.swa_full, swa_full_reason=props.swa_full_reason,
             needs_checkpoints=props.needs_checkpoints, checkpoint_policy=config.checkpoint_policy)


def final_state(system: "ActorSystem") -> dict[str, Any]:
    """What a replay must reproduce: each actor's state that outlives a request."""
    from actord.service.trace import digest

    # Wall-clock series (creation stamps, seconds busy) differ run to run: not state.
    metrics = {k: v for k, v in system.metrics.snapshot().items() if "_created" not in k and "_seconds" not in k}
    a = system.built if system.actors() else None
    return {
        "slots": [(s.id, digest(s.kv_tokens), s.resume_raw_lcp, [(c.pos, c.n_bytes) for c in s.checkpoints],
                   s.genes, s.mind) for s in system.slots],
        "pages": sorted((n, g) for n, g in a.pages.names.items()) if a else [],
        "charged": a.pages.charged if a else 0,
        "genes": sorted((g.id, g.resident) for g in a.residency.genes.values()) if a else [],
        "ckpt_used": a.ckpt_budget.used if a else 0,
        "metrics": sorted(metrics.items()),
    }
