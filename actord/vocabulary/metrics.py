"""One metrics registry per actor system, exposed as Prometheus text.

prometheus_client does the exposition format; a registry per system (not the global one)
keeps two systems in one process (tests, embedding hosts) from mixing their counts.
Actors update metrics from the event loop only; the engine thread reports through job
results, so no metric is touched from two threads.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # Serving
        self.prompt_tokens_total = Counter("prompt_tokens", "Prompt tokens received", registry=r)
        self.prompt_tokens_processed_total = Counter(
            "prompt_tokens_processed", "Prompt tokens decoded (not served from cache)", registry=r
        )
        # Counted once, as a request ends, as the processed ones are: a difference of the two
        # counters above dips while a prompt is in flight (received counted, processed not yet).
        self.prompt_tokens_cached_total = Counter(
            "prompt_tokens_cached", "Prompt tokens served from cache (not decoded)", registry=r
        )
        self.predicted_tokens_total = Counter("predicted_tokens", "Tokens generated", registry=r)
        self.requests_total = Counter("requests", "Completion requests finished", ["outcome"], registry=r)
        self.requests_in_flight = Gauge("requests_in_flight", "Completion requests in flight", registry=r)
        self.generations_yielded_total = Counter(
            "generations_yielded", "Generations that gave their slot up to a waiting mind and went on later "
            "(policy/yielding.py)", registry=r)
        self.requests_deferred_total = Counter(
            "requests_deferred", "Slot operations deferred because the slot was processing", registry=r
        )
        self.first_token_seconds = Histogram(
            "first_token_seconds", "Seconds from a completion's arrival to its first token (queued + prompt)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.engine_steps_total = Counter("engine_steps", "llama_decode steps", registry=r)
        # llama-server's timing series (its /metrics `llamacpp:` names, native/metrics.py):
        # a completion's prompt time (arrival to first token) and generation time (first
        # token to last), the tokens after the first (the first comes from the prompt's last
        # step, so the rate is over these), sequences per step, the longest sequence.
        self.prompt_seconds_total = Counter(
            "prompt_seconds", "Seconds completions spent before their first token (queued + prompt)", registry=r)
        self.predicted_seconds_total = Counter(
            "predicted_seconds", "Seconds completions spent generating after their first token", registry=r)
        self.predicted_steps_total = Counter(
            "predicted_steps", "Tokens generated after each completion's first (its generation steps)", registry=r)
        self.engine_step_seqs_total = Counter("engine_step_seqs", "Sequences in llama_decode steps", registry=r)
        self.n_tokens_max = Gauge("n_tokens_max", "Longest completion sequence seen (prompt + generated)",
                                  registry=r)
        self.engine_step_tokens = Histogram(
            "engine_step_tokens", "Tokens per llama_decode step", registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
        )
        # Busy vs wall: the engine thread's time inside llama_decode + sampling, so a reader
        # sees whether Python keeps the accelerator fed (busy/wall near 1 while work queues).
        self.engine_busy_seconds_total = Counter(
            "engine_busy_seconds", "Seconds the engine thread spent in decode steps (llama_decode + sampling)",
            registry=r,
        )
        self.engine_steps_skipped_total = Counter(
            "engine_steps_skipped", "Steps planned before a failed step and not run (replanned)", registry=r
        )
        self.engine_jobs_failed_total = Counter("engine_jobs_failed", "Engine jobs that failed", registry=r)
        self.actor_failures_total = Counter("actor_failures", "Actors that raised", ["actor"], registry=r)
        self.slot_evictions_total = Counter(
            "slot_evictions", "Idle slots that gave up their sequence for room", ["reason", "how"], registry=r
        )
        self.slot_evictions_refused_total = Counter(
            "slot_evictions_refused", "Evictions refused because a mind's state had no durable place to go",
            ["reason"], registry=r,
        )
        self.minds_kept_total = Counter(
            "minds_kept", "Named minds copied to their page (or file) before another request used their slot",
            ["to"], registry=r,
        )
        # actord/service/memory.py: what holds the daemon's bytes (and rss, unaccounted)
        self.memory_bytes = Gauge("actord_memory_bytes", "Bytes held, by what holds them", ["component"], registry=r)
        self.sleeps_total = Counter(
            "sleeps", "Times the idle daemon freed its model and context (service/sleep.py)", registry=r
        )
        self.kv_evictions_total = Counter(
            "kv_evictions", "Idle slots evicted by the scheduler for KV cells", registry=r
        )
        self.full_reprefills_total = Counter(
            "full_reprefills", "Requests that re-prefilled from zero despite a cached prefix", registry=r
        )
        # The prompt cache (policy/prompt_cache.py): unnamed requests run as the daemon's minds
        self.prompt_cache_turns_total = Counter(
            "prompt_cache_turns", "Unnamed requests run as a prompt-cache mind: found (its state resumed) or new",
            ["found"], registry=r,
        )
        self.prompt_cache_minds = Gauge("prompt_cache_minds", "Minds the prompt cache holds", registry=r)
        self.prompt_cache_evicted_total = Counter(
            "prompt_cache_evicted", "Prompt-cache minds forgotten (RAM page and page file dropped) past the bound",
            registry=r,
        )
        self.prefix_hit_tokens_total = Counter(
            "prefix_hit_tokens", "Prompt tokens a request took from a prefix another mind's sequence or a shared "
            "page held (not prefilled)", ["source"], registry=r,
        )
        # Speculative decoding, as llama-server names them (Counter adds the _total)
        self.spec_decode_num_draft_tokens_total = Counter(
            "spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated", registry=r
        )
        self.spec_decode_num_accepted_tokens_total = Counter(
            "spec_decode_num_accepted_tokens", "Speculative: Total draft tokens accepted by the target model",
            registry=r,
        )
        self.spec_decode_num_drafts_total = Counter(
            "spec_decode_num_drafts", "Speculative: Total speculative decoding verification steps", registry=r
        )
        # Pages
        self.page_store_bytes = Gauge("page_store_bytes", "Bytes charged by the page store", registry=r)
        self.page_store_pages = Gauge("page_store_pages", "Pages in the page store", registry=r)
        self.prefix_shared_bytes = Gauge("prefix_shared_bytes", "Page bytes a shared prefix (a base) saves", registry=r)
        self.page_out_total = Counter("page_out", "Slot page-outs", registry=r)
        self.page_in_total = Counter("page_in", "Slot page-ins", registry=r)
        self.page_failed_total = Counter("page_failed", "Page moves and spills that failed (engine, disk)", registry=r)
        self.page_refused_total = Counter(
            "page_refused", "Page admissions refused by the page RAM ceiling (expected: callers spill)", registry=r
        )
        self.page_spill_total = Counter("page_spill", "Pages spilled to disk", registry=r)
        self.mind_files_refused_total = Counter(
            "mind_files_refused", "Minds whose page file could not be restored (corrupt, another model): "
            "refused once, the mind started fresh", registry=r,
        )
        # Page files (storage/disk_index.py) and their persistence (service/persist.py)
        self.page_disk_bytes = Gauge("page_disk_bytes", "Bytes of page files in the page folder", registry=r)
        self.page_disk_files = Gauge("page_disk_files", "Page files (generations) in the page folder", registry=r)
        self.page_disk_evicted_total = Counter(
            "page_disk_evicted", "Minds' page files removed, least recently used first, to fit --page-disk-bytes",
            registry=r)
        self.page_disk_refused_total = Counter(
            "page_disk_refused", "Page files refused by --page-disk-bytes (nothing evictable freed enough)", registry=r)
        self.page_write_behind_total = Counter(
            "page_write_behind", "Minds written to their page files in the background (RAM pages and idle slots)",
            registry=r)
        self.page_unpersisted_age_seconds = Gauge(
            "page_unpersisted_age_seconds", "Age of the oldest change to a mind not yet in its page file "
            "(what a kill -9 would lose at most; 0: everything persisted)", registry=r)
        self.minds_unpersisted = Gauge(
            "minds_unpersisted", "Minds (RAM pages, idle or busy slots) whose state is not yet in their page file, "
            "as the last write-behind pass found them", registry=r)
        self.minds_not_persisted_total = Counter(
            "minds_not_persisted", "Minds a graceful stop could not write to their page files (logged by name)",
            registry=r)
        # Checkpoints
        self.ctx_checkpoint_bytes = Gauge("ctx_checkpoint_bytes", "Bytes held by context checkpoints", registry=r)
        self.ctx_checkpoints_evicted_budget_total = Counter(
            "ctx_checkpoints_evicted_budget", "Checkpoints evicted to fit the byte budget", registry=r
        )
        self.ctx_checkpoints_skipped_budget_total = Counter(
            "ctx_checkpoints_skipped_budget", "Checkpoints skipped: larger than the budget", registry=r
        )
        self.ctx_checkpoint_restores_total = Counter(
            "ctx_checkpoint_restores", "Requests resumed from a context checkpoint", registry=r
        )
        # Genes
        self.lora_page_out_total = Counter("lora_page_out", "Gene page-outs", registry=r)
        self.lora_page_in_total = Counter("lora_page_in", "Gene page-ins", registry=r)
        self.lora_page_in_on_demand_total = Counter(
            "lora_page_in_on_demand", "Gene page-ins on a request's path (misses)", registry=r
        )
        self.lora_page_failed_total = Counter("lora_page_failed", "Failed gene page moves", registry=r)
        self.lora_device_bytes = Gauge("lora_device_bytes", "Gene bytes resident on device", registry=r)
        self.lora_host_bytes = Gauge("lora_host_bytes", "Gene bytes held in host RAM", registry=r)

        # Clients (the socket server)
        self.rpc_connections = Gauge("rpc_connections", "Open client connections", registry=r)
        self.rpc_disconnects_total = Counter(
            "rpc_disconnects", "Connections closed by the daemon or the peer, by reason", ["reason"], registry=r
        )
        self.rpc_refused_total = Counter(
            "rpc_refused", "Requests and connections refused by a bound or a check, by reason", ["reason"], registry=r
        )

        # Clients (the HTTP front): its own bounds, apart from the socket's
        self.http_connections = Gauge("http_connections", "Open HTTP connections", registry=r)
        self.http_refused_total = Counter(
            "http_refused", "HTTP connections and requests refused by a bound or a check, by reason", ["reason"],
            registry=r,
        )
        self.http_anonymous_minds = Gauge("http_anonymous_minds", "Minds the HTTP front made for anonymous chats",
                                     registry=r)
        self.http_anonymous_minds_evicted_total = Counter(
            "http_anonymous_minds_evicted", "Anonymous minds forgotten (RAM page and page file dropped) past the bound",
            registry=r,
        )
        self.generations_waiting = Gauge(
            "generations_waiting", "Generations (HTTP and socket) waiting in line for their client's share",
            registry=r,
        )
        self.http_client_gone_total = Counter(
            "http_client_gone", "HTTP clients that hung up before their answer ended, by phase", ["phase"],
            registry=r,
        )

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()

    def snapshot(self, *, clients: bool = False) -> dict[str, float]:
        """Flat name -> value, for tests, traces and the final-state check of a replay.

        The socket server's `rpc_*` and the HTTP front's `http_*` metrics are left out unless
        asked for: they count connections, which a replay (no socket, no clients) cannot
        reproduce."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            if not clients and family.name.startswith(("rpc_", "http_")):
                continue
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                key = s.name + ("" if not s.labels else "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}")
                out[key] = s.value
        return out
