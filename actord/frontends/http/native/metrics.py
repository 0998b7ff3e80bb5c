"""llama-server's `/metrics` series (`llamacpp:`), read from actord's one registry.

Why a module of its own: llama-server's two throughput gauges are averages over the window
between two scrapes, so something must remember the previous scrape; that state, and the
mapping from llama-server's names onto actord's counters, live here and nowhere else (no
second registry, no second count). The seed's page and gene series are listed under the
same prefix.

The names, kinds and help lines are llama-server's (tools/server/server-task.cpp,
`to_metrics`): `n_tokens_max` is a counter there, so it is one here. Its meanings, as
actord counts them: prompt tokens exclude cached ones; prompt seconds run from a
completion's arrival to its first token (llama-server starts them when a slot takes the
task); the generation rate is over the tokens after the first, which comes from the
prompt's last step and costs no decode of its own.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.utils import floatToGoString

from actord.service.protocol import Service

SEED_SERIES: list[tuple[str, str]] = [
    ("page_store_bytes", "gauge"), ("page_store_pages", "gauge"), ("ctx_checkpoint_bytes", "gauge"),
    ("page_out_total", "counter"), ("page_in_total", "counter"), ("page_failed_total", "counter"),
    ("ctx_checkpoints_evicted_budget_total", "counter"), ("ctx_checkpoints_skipped_budget_total", "counter"),
    ("lora_page_out_total", "counter"), ("lora_page_in_total", "counter"),
    ("lora_page_in_on_demand_total", "counter"), ("lora_page_failed_total", "counter"),
    ("lora_device_bytes", "gauge"), ("lora_host_bytes", "gauge"),
]

# The counters whose differences between scrapes give the window's throughput gauges.
_WINDOW = ("prompt_tokens_processed_total", "prompt_seconds_total", "predicted_steps_total",
           "predicted_seconds_total")


def _rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


class LlamaSeries:
    """The `llamacpp:` text of one front's scrapes (the window gauges need the last one)."""

    def __init__(self, front: Any = None) -> None:
        self.front = front
        self._last: dict[str, float] = dict.fromkeys(_WINDOW, 0.0)

    def series(self, system: Service | None = None) -> str:
        system = system or self.front.service
        reg = system.metrics.registry

        def v(name: str) -> float:
            x = reg.get_sample_value(name)
            return 0.0 if x is None else float(x)

        now = {k: v(k) for k in _WINDOW}
        d = {k: now[k] - self._last[k] for k in _WINDOW}
        self._last = now
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
             v("prompt_tokens_processed_total")),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
             v("prompt_tokens_cached_total")),
            ("prompt_seconds_total", "Total time spent processing prompts", v("prompt_seconds_total")),
            ("tokens_predicted_total", "Number of generation tokens processed", v("predicted_tokens_total")),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", v("predicted_seconds_total")),
            ("n_decode_total", "Total number of llama_decode() calls", v("engine_steps_total")),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", v("n_tokens_max")),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
             v("spec_decode_num_draft_tokens_total")),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             v("spec_decode_num_accepted_tokens_total")),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
             v("spec_decode_num_drafts_total")),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
             _rate(d["prompt_tokens_processed_total"], d["prompt_seconds_total"])),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
             _rate(d["predicted_steps_total"], d["predicted_seconds_total"])),
            ("requests_processing", "Number of requests processing", v("requests_in_flight")),
            ("requests_deferred", "Number of requests deferred", float(system.n_deferred())),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
             v("engine_step_seqs_total") / max(v("engine_steps_total"), 1.0)),
        ]
        series = [(n, "counter", doc, x) for n, doc, x in counters] + [(n, "gauge", doc, x) for n, doc, x in gauges]
        for name, kind in SEED_SERIES:
            family = name[: -len("_total")] if kind == "counter" else name
            doc = next((f.documentation for f in reg.collect() if f.name == family), name)
            series.append((name, kind, doc, v(name)))
        lines = []
        for name, kind, doc, value in series:
            lines += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {floatToGoString(value)}"]
        return "\n".join(lines) + "\n"


def llama_metrics(system: Service) -> str:
    """One scrape's text on its own (its window gauges over the system's whole life)."""
    return LlamaSeries().series(system)
