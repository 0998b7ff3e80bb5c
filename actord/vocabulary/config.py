"""All configuration in one typed place.

The daemon's flags, the embedded API and the tests all build a `Config`; nothing else reads
the environment or argv (the `aip_*` fields take their defaults from Vertex AI's variables). Sizes are bytes, counts are tokens, so a flag means one thing.
"""

from __future__ import annotations

import ipaddress
import os

import msgspec

from actord.vocabulary.errors import InvalidParams
from actord.vocabulary.types import RequestLimits

# The names of the policies options choose (the policies themselves live in actord/policy/):
# the names are configuration's, so a config is checked without loading any policy.
CHECKPOINT_POLICIES = ("placement", "divergence", "oldest")  # policy/checkpoint_select.py
SWA_FULL_MODES = ("auto", "on", "off")  # policy/swa.py
SWA_FULL_SHARE = 0.25  # of the device budget a full SWA cache may take under "auto"


def parse_cpu_list(text: str) -> frozenset[int]:
    """ "1-3,6" -> {1, 2, 3, 6} (`engine_cpus`; policy/cpus.py chooses from it); a clear
    error for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise InvalidParams(f"engine_cpus is auto, off or a CPU list like 1-3,6 (got {text!r})",
                                engine_cpus=text) from None
        if a < 0 or b < a:
            raise InvalidParams(f"engine_cpus: bad range {part!r}", engine_cpus=text)
        cpus.update(range(a, b + 1))
    return frozenset(cpus)


FLASH_ATTN_MODES = ("auto", "on", "off")
BACKEND_SAMPLING_MODES = ("auto", "on", "off")
SPEC_MODES = ("", "off", "draft", "mtp")
CACHE_TYPES = ("f16", "q8_0", "q4_0")  # the KV cache's element types (llama-server's -ctk / -ctv)


def _env(name: str) -> str:
    """A Config default read from the environment: only Google Vertex AI's container
    variables (`aip_*`), which Vertex sets and no flag can."""
    return os.environ.get(name, "")


def engine_threads(threads: int) -> int:
    """What `threads` means: 0 = all CPUs this process may use but one (llama.cpp's threads
    spin, and the event loop needs a core)."""
    return threads or max(1, len(os.sched_getaffinity(0)) - 1)


class Config(msgspec.Struct, kw_only=True, frozen=True):
    model: str  # the GGUF file served (a path; `actord serve` defaults to the packaged Gemma 3 270M)
    slots: int = 4  # sequences decoded side by side: each holds one mind's (or request's) state at a time
    ctx: int = 4096  # total KV cells, shared by all slots (unified KV)
    batch: int = 512  # most tokens in one llama_decode step
    # Prompt pieces end at multiples of this many positions where they can: ggml's batched
    # matmuls run whole tiles at full speed (a 135-token piece ran ~11% slower than one of
    # 128 or 192 on Gemma 3 270M); grid checkpoints sit on the same boundaries. 1: off.
    piece_tile: int = 64
    # Engine steps in flight at once: step k+1 (and more) is planned before step k's samples
    # reach Python, and the engine feeds them itself, so it never waits for Python. A
    # request that ends by its sample is answered up to depth-1 steps later; a stop string
    # leaves up to depth-1 extra tokens in its KV (an eog or stop token none past itself).
    # 0 = auto: 4 on a GPU backend, 2 on the CPU (actord/policy/pipeline.py).
    pipeline_depth: int = 0
    # How long a decode step's result may wait before the engine wakes the loop for it
    # (engine/thread.py `_announce`): with depth >= 3 on a fast device the loop then routes a
    # few steps per wake-up instead of one. A slow step (longer than this) is always
    # announced at once. 0: every step rings.
    announce_within_ms: float = 1.0
    threads: int = 0  # 0 = all CPUs but one (llama.cpp's threads spin; the loop needs a core)
    # The engine thread's CPUs (actord/policy/cpus.py): "auto" keeps it, and libllama's
    # compute threads, off the first CPU so the loop always has one; "off"; or a list "1-3".
    engine_cpus: str = "auto"
    # Speculative decoding (engine/draft.py, policy/speculation.py): a draft model with the target's
    # vocabulary proposes up to spec_n_max tokens per step for each generating request, which
    # the target verifies in the same batched step. spec: "" = "draft" when
    # spec_draft_model is named, else off; "mtp" = the model's own MTP head (engine/mtp.py;
    # a model without an MTP layer is refused at start). A draft token is kept only while
    # the request's own sampler, run at each position, picks it: output is the same as
    # without speculation, on every memory kind (engine/step.py `_verify`). spec_p_min > 0 stops a
    # draft at its first token whose draft probability is below it (llama-server's p_min).
    spec: str = ""
    spec_draft_model: str | None = None
    spec_n_max: int = 4
    spec_p_min: float = 0.0
    seed: int = 0  # default sampling seed when a request names none
    # Pages
    page_ram_bytes: int = 2 << 30  # the page RAM ceiling: host RAM for paged-out minds; past it, pages spill to files
    page_dir: str = "./pages"  # the page folder: page files (spills, saves, minds) live here, and only here
    # The disk budget for page files (bytes, every file of each generation, sub-folders
    # included): past it, the least recently used minds' files not in use are removed first;
    # a file that still does not fit is refused (PageDiskExceeded). 0: no budget.
    page_disk_bytes: int = 0
    # Write-behind: a mind unchanged this many seconds (a RAM page, an idle slot) is written
    # to its page file in the background, so a kill -9 loses at most about this window of
    # any mind; the page stays in RAM (the file is its backup). 0: off.
    write_behind_s: float = 3.0
    # Page files share bases (storage/bases.py): a page on a shared prefix spills as its own
    # part plus a reference to a base file `bases/KEY.base` (KEY: the base's whole identity),
    # written once and removed with its last referrer; a new mind may start from one. Off:
    # every page file is self-contained.
    page_file_bases: bool = True
    # Context checkpoints
    ctx_checkpoints: int = 16  # safety cap: a slot or page holds at most 1 + this many
    ctx_checkpoints_bytes: int = 256 << 20  # one budget across all slots
    checkpoint_every: int = 512  # spacing for the "divergence" and "oldest" policies
    # "placement": make and keep checkpoints where the mind's next request is expected to
    # diverge (actord.policy.checkpoint_placement); "divergence": the seed's spacing + count rule aware
    # of the last raw lcp; "oldest": the original keep-head-and-newest rule (a baseline).
    checkpoint_policy: str = "placement"
    # A page or page file of a full sliding-window cache keeps the window of those layers at
    # its last prompt's end (libllama writes a state without the cells the window has passed,
    # so once moved a turn that cuts back, a regenerate say, re-prefilled the whole history):
    # one window per page (Gemma 3 270M: 7.7 MB at 512 positions). Off: pages hold no more.
    page_swa_window: bool = True
    # A request whose slot holds little of its prompt starts from the longest prefix another
    # slot's sequence holds, by cells (actord.serving.prefix_share), and pages of minds that
    # open alike hold their common prefix once (the page store's bases). Off: every
    # sequence and page is its own (the comparison bench/shared_prefix.py draws).
    prefix_sharing: bool = True
    # The prompt cache (actord/policy/prompt_cache.py): a request that names no mind and
    # brings at least prompt_cache_min_tokens prompt tokens runs as a mind the daemon names
    # itself, found again by the next request whose prompt begins with its last prompt (a
    # conversation resent with one more turn), so its state is paged out and back rather than
    # written over, as llama-server's --cache-ram keeps prompts in host RAM. At most
    # prompt_cache_minds of them, holding at most prompt_cache_bytes of state; past either
    # the least recently used one's RAM page and page file are dropped. They are not written
    # behind or persisted at a stop, and their files are removed at start. 0 minds: off.
    prompt_cache_minds: int = 64
    prompt_cache_bytes: int = 1 << 30
    prompt_cache_min_tokens: int = 128
    # Reuse of cells (a resume, a share, a base, a page) stays within a tenant: an HTTP API
    # key (when there are several) or a socket peer's uid, narrowed by a request's
    # cache_salt. On: every tenant of this daemon shares with every other, and a client can
    # learn whether another tenant sent a prompt from how much of it was cached (n_cached,
    # or timing: the prompt-cache side channel). Turn it on only where all clients trust
    # each other.
    share_across_tenants: bool = False
    # A full SWA cache makes checkpoints unnecessary but costs memory (actord.policy.swa):
    # "auto" takes it when bytes/token x ctx fits swa_full_share of the device budget
    # (device_bytes, else the host's memory), "on"/"off" decide outright.
    swa_full: str = "auto"
    swa_full_share: float = SWA_FULL_SHARE
    # The accelerator (llama-server's flags of the same names). n_gpu_layers: layers whose
    # weights and KV cache go to the GPU, -1 = all of them (libllama ignores it where the
    # build has no GPU backend: props report 0 there). flash_attn: auto lets libllama use
    # flash attention wherever the backend has it (its V cache is then not transposed, so
    # state copies are contiguous rows); on/off decide outright. main_gpu: -1 = every GPU,
    # layers split between them (libllama's default); N = the whole model on GPU N.
    n_gpu_layers: int = -1
    flash_attn: str = "auto"
    main_gpu: int = -1
    # The KV cache's element types (llama-server's --cache-type-k / --cache-type-v): f16, q8_0
    # (about half the bytes per token, so a page holds twice the minds) or q4_0 (about a
    # quarter). A quantized V cache needs flash attention (not --flash-attn off). Pages and
    # page files record the types; a file of other types is refused (PageDoesNotFit).
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    # Sampler chains that can run inside the decode's graph (greedy, top-k/top-p/min-p/
    # temperature/dist, logit bias; not grammar, penalties, logprobs, speculation) do, so a
    # GPU step copies one token per sequence instead of its logits (engine/backend_sampling.py).
    # auto: on where the model runs on a GPU backend; on/off decide outright.
    backend_sampling: str = "auto"
    # Keep each sequence's logits of its prompt's last token (n_vocab floats per slot), so a
    # request whose whole prompt the slot already holds samples its first token from them
    # instead of decoding that token alone again. On quantized CPU kernels a one-token batch
    # rounds differently from the prompt's batch: without them the same request sent twice
    # can answer differently the second time (engine/step.py `memo`).
    prompt_logits_memo: bool = True
    # A request's grammar whose sampling costs more than this much of the engine thread's CPU
    # time for one token (a token that
    # masks the vocabulary: this per 65,536 candidates) is cut: the request ends with a 400
    # naming the grammar, and the same grammar sent again is refused before it runs
    # (engine/sampling.py `_cut_grammar`), so an ambiguous grammar, whose cost doubles
    # each token, holds the engine a bounded time.
    grammar_token_budget_ms: float = 150.0
    # The engine time one request may have, as its share of the steps it was in
    # (policy/engine_time.py); past it the request ends with EngineTimeExceeded (HTTP 429)
    # and its slot serves others. Generous: a whole context's generation on a slow device
    # stays under it, a request that stalls its peers for minutes does not. 0: no budget.
    request_engine_s: float = 600.0
    # A generation past this many tokens gives its slot up to a mind waiting for one, at
    # the next token that ends its text whole, and goes on after her from its page (a mind
    # switch: a memory copy each way), so no mind waits for a whole long generation to end.
    # Only a mind's request whose sampling a new sampler goes on exactly (policy/yielding.py:
    # no grammar, penalties, stop strings, seeded draws). 0: a generation keeps its slot.
    yield_after_tokens: int = 256
    # Genes
    # One budget for resident genes and occupied slots' state. 0: unlimited on the CPU; on a
    # GPU, what it has free at start less a margin (actord.policy.device says which; props
    # report the figure and why).
    device_bytes: int = 0
    gene: list[str] = []  # adapters loaded at start and active by default (scale 1)
    # Daemon
    socket: str = "./actord.sock"  # the JSON-RPC Unix socket the daemon listens on (and the CLI calls)
    metrics_http: str | None = None  # "127.0.0.1:9464" serves Prometheus text over HTTP
    # OpenAI-compatible HTTP front (actord/frontends/http/), in the daemon's own event loop
    # "127.0.0.1:8080"; port 0 picks a free one (props reports it); several, comma-separated
    # ("127.0.0.1:8080,[::1]:8080"), are all served by the one front and its bounds.
    http: str | None = None
    # Required as "Authorization: Bearer KEY" (or x-api-key) when set: one key, or several
    # separated by commas (as llama-server's --api-key), each its own tenant.
    api_key: str | None = None
    # A file of more keys, one per line (blank lines and # comments skipped), read at start.
    api_key_file: str | None = None
    http_max_body_bytes: int = 16 << 20  # larger request bodies get 413
    # Bytes of request bodies being read at once, in all (half of it from one client
    # address): past it, 503 as the body arrives (costs.py BodyBytes). 0: 4 x the above.
    http_max_body_bytes_in_flight: int = 0
    # The front's own bounds (actord/frontends/http/bounds.py), beside the socket's below. A request
    # line + headers over http_max_header_bytes get 431 before more is read; a request head
    # not in within http_header_timeout_s of the connection (or of its first byte after a
    # keep-alive answer) gets 408; a keep-alive connection idle for http_idle_timeout_s is
    # closed; a body not in within http_body_timeout_s gets 408; connections beyond
    # http_max_connections get 503 and are closed (the fd limit is raised to cover them).
    http_max_header_bytes: int = 64 << 10
    http_header_timeout_s: float = 10.0
    http_idle_timeout_s: float = 5.0
    http_body_timeout_s: float = 60.0
    http_max_connections: int = 256
    # Per peer (bounds.py): one client address holds at most http_max_connections_per_peer
    # connections; past either cap, http_control_connections more are served for /health
    # and /metrics alone, so the control routes answer under any flood; an answer whose
    # client reads nothing for http_write_timeout_s while output waits ends its connection
    # (and its generation).
    http_max_connections_per_peer: int = 128
    http_control_connections: int = 8
    http_write_timeout_s: float = 30.0
    # Generations (completions, chats, messages, responses) one client address has in
    # flight, running or queued for a slot, while it is the only address at work; while
    # others are, its fair part of the slots (rounded up; frontends/shares.py). 0: twice the
    # slots. Below the slot count, one address never holds every slot.
    http_max_generations_per_peer: int = 0
    # Past its share (of the address's, or of the key's with several keys), a generation
    # waits its turn in the HTTP front's line, its body unread (frontends/shares.py), while
    # other clients' generations start within their own shares; at most this many of an
    # address's (and of a key's) wait, one more gets 429 in the API's shape. 0: none wait.
    # As many as an address's connections by default: a waiting generation holds its
    # connection and what of its body the transport read (64 KiB), so a load tool at any
    # concurrency its connections allow is served, not refused.
    http_max_waiting_per_peer: int = 128
    # Per API key, with two keys or more (frontends/shares.py; one key is everyone's, and its
    # bound would be the front's own): one key holds at most http_max_connections_per_key
    # connections and http_max_generations_per_key generations in flight; one more gets 429
    # in the API's shape. 0: connections as per address (http_max_connections_per_peer),
    # generations every slot but one (at least 1), so one key's flood never holds every slot.
    http_max_connections_per_key: int = 0
    http_max_generations_per_key: int = 0
    # Chunks generated for streams but not yet taken by their clients, per client address and
    # per key (0: as per address): past the share, the stream whose chunk overflows ends
    # (its generation cancelled) with a client_too_slow error event.
    http_max_queued_chunks_per_peer: int = 16384
    http_max_queued_chunks_per_key: int = 0
    # A stream whose client takes nothing (its transport holds what was sent) may generate
    # this many chunks more; then its generation ends, freeing its slot, and the stream ends
    # with a client_too_slow error event: a client that does not read holds no engine time.
    http_stream_ahead_chunks: int = 64
    # Cost before work (actord/frontends/http/costs.py): a JSON body nesting deeper than
    # this many arrays and objects is refused 400 before it is decoded (a decoder recurses
    # once per level); a large body is decoded on a worker thread within
    # http_parse_budget_s (past it, 413 naming the body).
    http_max_json_depth: int = 128
    # ... and one holding more values than this in its arrays and objects is refused 413
    # before it is decoded (a decoder makes an object per value): 128 full-context token
    # prompts fit.
    http_max_json_values: int = 1 << 19
    http_parse_budget_s: float = 5.0
    # Without --api-key, the Host names the front answers to besides its own address,
    # localhost and loopback addresses: any other Host is refused 403, as llama-server and
    # Jupyter refuse one (a DNS-rebinding page names its own host).
    http_host: list[str] = []
    # A chat completion naming no max_tokens generates at most this many (capped by ctx),
    # not the whole context: a model that never emits EOS would otherwise hold its slot
    # for ctx tokens. /v1/completions keeps OpenAI's own default of 16.
    http_default_max_tokens: int = 2048
    # The most choices one request may ask for (OpenAI's `n`, llama-server's `n_cmpl`); over
    # it, a 400 naming the field. Choices beyond the idle slots queue (actord/chat/choices.py).
    max_n: int = 8
    # The model's names, llama-server's: /v1/models lists the model once, its id the first
    # alias in sorted order (else the file's stem), with every alias and tag beside it (any
    # `model` name is served). Each value may be a comma-separated list.
    model_alias: list[str] = []
    model_tags: list[str] = []  # informational tags listed with the model by /v1/models
    # Browser origins allowed (CORS, preflight): none listed serves any (llama-server's
    # default); "localhost" stands for any local origin (localhost, 127.0.0.1, [::1]).
    cors_origin: list[str] = []
    # A preflight's Access-Control-Allow-Headers (llama-server's --cors-headers). Browsers
    # never read "*" as covering Authorization: a cross-origin page that sends the key
    # needs it named ("Authorization, Content-Type").
    cors_headers: str = "*"
    # Routes llama-server serves only when asked: off, /metrics and /slots answer 501 in
    # its error shape (its defaults are off; actord's own users get them on).
    http_metrics: bool = True
    http_slots: bool = True
    http_ui: bool = True  # the dashboard page at / and /dashboard (off: 404; its data route stays keyed)
    # Each completion's answer carries `__verbose` (llama-server's --verbose): the prompt as
    # rendered, the generated text and the request's settings, for debugging a template.
    http_verbose: bool = False
    # Request headers whose value names the request's mind when it names none itself (after
    # X-Actord-Mind, before prompt_cache_key and user), through a digest as `user` does: e.g.
    # "X-Correlation-ID,X-Session-Id", the session headers load tools (NVIDIA AIPerf) and
    # agents send. Off by default: a header a proxy may add must not move requests between
    # minds unless the operator says so. Each value may be a comma-separated list.
    http_mind_headers: list[str] = []
    # Google Vertex AI's prediction protocol, read from the variables Vertex sets in a
    # container: with AIP_MODE=PREDICTION the front listens on AIP_HTTP_PORT, answers POST
    # AIP_PREDICT_ROUTE ({"instances": [...]}, each naming its route by "@requestFormat")
    # and, when AIP_HEALTH_ROUTE is set, health there too (actord/frontends/http/vertex.py).
    aip_mode: str = msgspec.field(default_factory=lambda: _env("AIP_MODE"))
    aip_http_port: int = msgspec.field(default_factory=lambda: int(_env("AIP_HTTP_PORT") or 8080))
    aip_predict_route: str = msgspec.field(default_factory=lambda: _env("AIP_PREDICT_ROUTE") or "/predict")
    aip_health_route: str = msgspec.field(default_factory=lambda: _env("AIP_HEALTH_ROUTE"))
    # Exact prompt+reply tokens kept for chat turns, in 4-byte units: each turn kept is also
    # charged ~256 B (64 units) for its key and bookkeeping (chat/prompter.py TurnMemory).
    chat_memory_tokens: int = 1 << 22
    chat_template_file: str | None = None  # a Jinja2 chat template used instead of the GGUF's
    # A built-in chat template by name (chatml, llama3, llama2, gemma, phi3, mistral-v7,
    # zephyr, command-r, deepseek3: actord/chat/named_templates.py) or Jinja source, used
    # instead of the GGUF's: llama-server's --chat-template, for models that ship none.
    chat_template: str | None = None
    # Tool calling's output format (actord.chat.tools): "auto" reads it from the chat template;
    # hermes, mistral, llama3 or generic (a grammar-held JSON format for any template).
    tool_format: str = "auto"
    # Each slot's context as llama-server gives it (n_ctx / slots): a prompt over it refused,
    # a generation held to it, /props and /slots reporting it (actord/service/slot_ctx.py).
    # Off: the --ctx cells are one pool any slot may use all of (actord's default).
    ctx_per_slot: bool = False
    # Reasoning models (actord.chat.reasoning), llama-server's flags: thinking on, off, or the
    # template's default (auto); how the thought is parsed out of the output (none: left in
    # the content; deepseek/auto: into reasoning_content); the thinking budget in tokens
    # (-1: no limit, 0: thinking off, N: a thought is closed by force after N tokens) and the
    # text forced before its end marker then. A request's chat_template_kwargs.enable_thinking,
    # reasoning_format, reasoning_budget and reasoning_budget_message override them.
    reasoning: str = "auto"
    reasoning_format: str = "auto"
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    # The Responses API (POST /v1/responses) remembers this many responses, oldest dropped
    # first, for `previous_response_id` and GET /v1/responses/{id}, in at most
    # http_responses_max_bytes of conversation text.
    http_responses_max: int = 1024
    http_responses_max_bytes: int = 64 << 20
    # The minds made for anonymous Responses conversations (named by how they start, no
    # client name): at most this many, holding at most this many bytes of state; past
    # either the least recently used one's RAM page and page file are dropped
    # (actord/frontends/http/openai/anonymous.py).
    http_anonymous_minds: int = 64
    http_anonymous_mind_bytes: int = 1 << 30
    # Record every external input and the order of every delivery to this JSONL file, so
    # `actord replay` re-executes the run as it went (docs/traces.md). None: no trace.
    trace: str | None = None
    # Messages an actor's mailbox holds before a sender waits: the bound on what one actor
    # can queue for another (asks flow one way, every ask has a bound).
    mailbox_capacity: int = 64
    # Worker threads for page-file reads and writes (spills, restores, write-behind, the
    # stop's persistence): disk work never runs on the engine thread or the event loop.
    disk_threads: int = 4
    # Bounds in time
    ask_timeout_s: float = 600.0  # longest an actor awaits another's reply (then AskTimeout + wait-for chain)
    request_timeout_s: float = 3600.0  # longest a completion may take end to end (then cancelled)
    shutdown_grace_s: float = 10.0  # SIGTERM: requests in flight get this long to finish, then are cancelled
    # A graceful stop (SIGTERM, `stop`) then writes every mind (slots and RAM pages) to its
    # page file, in parallel on the disk threads, within this many seconds more; a mind
    # not written by then is logged by name. The whole stop takes at most
    # shutdown_grace_s + shutdown_persist_s (systemd's TimeoutStopSec must cover both).
    shutdown_persist_s: float = 30.0
    persist_on_stop: bool = True  # off: a stop keeps only the minds already in page files
    # ... and the process exits at most this long after that, whatever a thread is doing (a
    # worker stuck in a read held it past SIGTERM for ever): exit status 1, logged.
    shutdown_exit_margin_s: float = 30.0
    # Memory care (actord/service/memory.py): every memory_report_s the daemon refreshes
    # actord_memory_bytes{component} and, with malloc_trim, gives glibc's free arena pages
    # back; trace_malloc_s > 0 runs tracemalloc and logs the top growth by file:line that often
    # (a diagnosis: it slows the daemon). 0 turns each off.
    memory_report_s: float = 15.0
    malloc_trim: bool = True
    malloc_arena_max: int = 2  # glibc malloc arenas, set at daemon start (0: glibc's default)
    trace_malloc_s: float = 0.0
    # After this many seconds with nothing in flight the daemon sleeps: minds page out, the
    # engine frees the model and its context (device and host memory), and the next request
    # loads them again (llama-server's --sleep-idle-seconds; service/sleep.py). 0: never.
    sleep_idle_s: float = 0.0
    # Clients: every resource a client can make the daemon hold is bounded. Over a bound a
    # request gets a typed error; a client that stops reading is disconnected (logged).
    max_connections: int = 512  # open connections; one more is answered Overloaded and closed
    max_line_bytes: int = 4 << 20  # one request line (exact; the newline not counted)
    max_requests_in_flight: int = 64  # per connection (a batch counts each element)
    max_inflight_bytes: int = 16 << 20  # per connection: bytes of request lines being served
    max_outbox_bytes: int = 8 << 20  # per connection: answers and chunks queued for a slow reader
    # Control calls (slot.*, page.*, gene.*, the stats: everything but completion, chat and
    # the cheap props/health/metrics) served at once, per connection and in all: more wait
    # their turn, in order, so a flood of them cannot take the event loop and the actors'
    # mailboxes from generation (actord/frontends/rpc/server.py).
    max_control_in_flight: int = 4
    max_control_total: int = 16
    max_prompt_bytes: int = 0  # UTF-8 bytes of a text prompt, checked before tokenizing; 0 = 32 x ctx
    max_stop: int = 32  # stop strings per request
    max_stop_bytes: int = 256  # UTF-8 bytes of one stop string
    max_stop_tokens: int = 1024  # stop token ids per request
    max_request_genes: int = 64  # genes one request may apply
    max_gene_bytes: int = 4 << 30  # a gene file larger than this is refused before reading
    # Bytes of gene files being read or loaded at once, across all gene.load calls: more wait
    # their turn (within client_file_timeout). At least max_gene_bytes.
    max_gene_read_bytes: int = 4 << 30
    gene_dir: str | None = None  # confine gene.load to files under this folder (as page_dir confines pages)
    client_file_timeout: float = 60.0  # seconds to read one client-named file
    client_file_threads: int = 4  # worker threads reading client-named files, hung ones included
    allow_uid: list[int] = []  # peers (SO_PEERCRED) allowed besides the daemon's own uid
    allow_gid: list[int] = []  # peers whose primary gid is one of these are allowed too

    def validate(self) -> "Config":
        if self.slots < 1:
            raise InvalidParams("slots must be >= 1")
        if self.ctx < 16:
            raise InvalidParams("ctx must be >= 16")
        if self.piece_tile < 1:
            raise InvalidParams("piece_tile must be >= 1")
        if not 0 <= self.pipeline_depth <= 8:
            raise InvalidParams("pipeline_depth is between 1 and 8, or 0 (auto)", pipeline_depth=self.pipeline_depth)
        if self.engine_cpus not in ("auto", "off"):
            parse_cpu_list(self.engine_cpus)
        if not 0 <= self.announce_within_ms <= 1000:
            raise InvalidParams("announce_within_ms is between 0 and 1000",
                                announce_within_ms=self.announce_within_ms)
        if self.batch < 1:
            raise InvalidParams("batch must be >= 1")
        if self.spec not in SPEC_MODES:
            raise InvalidParams(f"spec is one of {SPEC_MODES}", spec=self.spec)
        if self.spec == "draft" and not self.spec_draft_model:
            raise InvalidParams("--spec draft needs --spec-draft-model PATH")
        if self.spec in ("mtp", "off") and self.spec_draft_model:
            raise InvalidParams(f"--spec {self.spec} and --spec-draft-model exclude each other")
        if not 1 <= self.spec_n_max <= 32 or not 0 <= self.spec_p_min <= 1:
            raise InvalidParams("spec_n_max is between 1 and 32, spec_p_min a probability in [0, 1]")
        if self.page_ram_bytes < 0 or self.ctx_checkpoints_bytes < 0 or self.device_bytes < 0:
            raise InvalidParams("byte budgets must be >= 0")
        if self.swa_full not in SWA_FULL_MODES:
            raise InvalidParams(f"swa_full is one of {SWA_FULL_MODES}")
        if not 0 <= self.swa_full_share <= 1:
            raise InvalidParams("swa_full_share is a fraction in [0, 1]")
        if self.n_gpu_layers < -1:
            raise InvalidParams("n_gpu_layers is -1 (all) or a count >= 0", n_gpu_layers=self.n_gpu_layers)
        if self.flash_attn not in FLASH_ATTN_MODES:
            raise InvalidParams(f"flash_attn is one of {FLASH_ATTN_MODES}", flash_attn=self.flash_attn)
        if self.cache_type_k not in CACHE_TYPES or self.cache_type_v not in CACHE_TYPES:
            raise InvalidParams(f"cache_type_k and cache_type_v are one of {', '.join(CACHE_TYPES)}",
                                cache_type_k=self.cache_type_k, cache_type_v=self.cache_type_v)
        if self.cache_type_v != "f16" and self.flash_attn == "off":
            raise InvalidParams(f"a quantized V cache (cache_type_v {self.cache_type_v}) needs flash attention: "
                                "not with --flash-attn off", cache_type_v=self.cache_type_v)
        if self.backend_sampling not in BACKEND_SAMPLING_MODES:
            raise InvalidParams(f"backend_sampling is one of {BACKEND_SAMPLING_MODES}",
                                backend_sampling=self.backend_sampling)
        if self.main_gpu < -1:
            raise InvalidParams("main_gpu is -1 (split across every GPU) or a GPU index >= 0", main_gpu=self.main_gpu)
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise InvalidParams(f"checkpoint_policy is one of {CHECKPOINT_POLICIES}")
        if self.ask_timeout_s <= 0 or self.request_timeout_s <= 0 or self.shutdown_grace_s < 0:
            raise InvalidParams("ask_timeout_s and request_timeout_s must be > 0, shutdown_grace_s >= 0")
        if self.page_disk_bytes < 0 or self.write_behind_s < 0 or self.shutdown_persist_s < 0:
            raise InvalidParams("page_disk_bytes, write_behind_s and shutdown_persist_s are >= 0 (0: none or off)")
        if self.memory_report_s < 0 or self.trace_malloc_s < 0 or self.malloc_arena_max < 0 or self.sleep_idle_s < 0:
            raise InvalidParams("memory_report_s, trace_malloc_s, malloc_arena_max and sleep_idle_s are >= 0 (0: off)")
        if self.ctx_checkpoints < 0 or self.checkpoint_every < 1:
            raise InvalidParams("ctx_checkpoints must be >= 0 and checkpoint_every >= 1")
        if self.http_max_body_bytes < 1 or self.chat_memory_tokens < 0:
            raise InvalidParams("http_max_body_bytes must be >= 1 and chat_memory_tokens >= 0")
        if not (self.http_header_timeout_s > 0 and self.http_idle_timeout_s > 0 and self.http_body_timeout_s > 0):
            raise InvalidParams("http_header_timeout_s, http_idle_timeout_s and http_body_timeout_s must be > 0")
        if self.http_max_body_bytes_in_flight < 0:
            raise InvalidParams("http_max_body_bytes_in_flight must be >= 0 (0: 4 x http_max_body_bytes)")
        if self.http_max_generations_per_peer < 0:
            raise InvalidParams("http_max_generations_per_peer must be >= 0 (0: twice the slots)")
        if self.http_max_waiting_per_peer < 0:
            raise InvalidParams("http_max_waiting_per_peer must be >= 0 (0: none wait)")
        if min(self.http_max_connections_per_key, self.http_max_generations_per_key,
               self.http_max_queued_chunks_per_key) < 0:
            raise InvalidParams("http_max_connections_per_key, http_max_generations_per_key and "
                                "http_max_queued_chunks_per_key must be >= 0 (0: the default)")
        if self.http_max_queued_chunks_per_peer < 1 or self.http_stream_ahead_chunks < 1:
            raise InvalidParams("http_max_queued_chunks_per_peer and http_stream_ahead_chunks must be >= 1")
        if self.http_max_connections_per_peer < 1 or self.http_control_connections < 0 or \
                not self.http_write_timeout_s > 0:
            raise InvalidParams("http_max_connections_per_peer must be >= 1, http_control_connections >= 0 and "
                                "http_write_timeout_s > 0")
        if not self.shutdown_exit_margin_s > 0:
            raise InvalidParams("shutdown_exit_margin_s must be > 0")
        if self.request_engine_s < 0:
            raise InvalidParams("request_engine_s must be >= 0 (0: no budget)")
        if self.yield_after_tokens < 0:
            raise InvalidParams("yield_after_tokens must be >= 0 (0: a generation keeps its slot)")
        if not self.grammar_token_budget_ms > 0:
            raise InvalidParams("grammar_token_budget_ms must be > 0")
        if self.http_max_json_values < 1024:
            raise InvalidParams("http_max_json_values must be >= 1024")
        if not 2 <= self.http_max_json_depth <= 512 or not self.http_parse_budget_s > 0:
            raise InvalidParams("http_max_json_depth is between 2 and 512, http_parse_budget_s > 0")
        if self.http_max_header_bytes < 1024:
            raise InvalidParams("http_max_header_bytes must be >= 1024")
        if not 1 <= self.max_n <= 128:
            raise InvalidParams("max_n is between 1 and 128", max_n=self.max_n)
        if self.http_max_connections < 1 or self.http_default_max_tokens < 1:
            raise InvalidParams("http_max_connections and http_default_max_tokens must be >= 1")
        if self.tool_format not in ("auto", "hermes", "mistral", "llama3", "generic"):
            raise InvalidParams("tool_format is one of auto, hermes, mistral, llama3, generic")
        if self.reasoning not in ("on", "off", "auto") or self.reasoning_format not in ("none", "deepseek", "auto"):
            raise InvalidParams("reasoning is one of on, off, auto; reasoning_format one of none, deepseek, auto")
        if self.chat_template is not None and (not self.chat_template or self.chat_template_file):
            raise InvalidParams("chat_template is a name or Jinja source, and excludes chat_template_file")
        if self.reasoning_budget < -1:
            raise InvalidParams("reasoning_budget is -1 (no limit), 0 (thinking off) or a number of tokens")
        if self.prompt_cache_minds < 0 or self.prompt_cache_bytes < 0 or self.prompt_cache_min_tokens < 1:
            raise InvalidParams("prompt_cache_minds and prompt_cache_bytes are >= 0 (0 minds: off), "
                                "prompt_cache_min_tokens >= 1")
        if self.http_anonymous_minds < 1 or self.http_anonymous_mind_bytes < 0:
            raise InvalidParams("http_anonymous_minds must be >= 1 and http_anonymous_mind_bytes >= 0")
        if self.http_responses_max < 0 or self.http_responses_max_bytes < 0:
            raise InvalidParams("http_responses_max and http_responses_max_bytes must be >= 0")
        if any(not a for a in self.model_alias) or any(not o for o in self.cors_origin) \
                or "" in split_names(self.model_alias) or "" in split_names(self.model_tags) \
                or "" in split_names(self.http_mind_headers):
            raise InvalidParams("model_alias, model_tags, cors_origin and http_mind_headers values must not be empty")
        if not 0 < self.aip_http_port < 65536:
            raise InvalidParams("aip_http_port (AIP_HTTP_PORT) is a TCP port", aip_http_port=self.aip_http_port)
        if self.http is not None:
            for host, port in http_addresses(self.http):
                if not is_loopback(host) and not (self.api_key or self.api_key_file):
                    raise InvalidParams(f"--http {self.http} is not a loopback address: it needs --api-key",
                                        http=self.http)
        positive = ("max_connections", "max_line_bytes", "max_requests_in_flight", "max_inflight_bytes",
                    "max_outbox_bytes", "max_control_in_flight", "max_control_total", "max_stop_bytes", "max_gene_bytes", "client_file_threads")
        for name in positive:
            if getattr(self, name) < 1:
                raise InvalidParams(f"{name} must be >= 1")
        counts = ("max_prompt_bytes", "max_stop", "max_stop_tokens", "max_request_genes")
        for name in counts:
            if getattr(self, name) < 0:
                raise InvalidParams(f"{name} must be >= 0")
        if self.max_gene_read_bytes < self.max_gene_bytes:
            raise InvalidParams("max_gene_read_bytes must be >= max_gene_bytes (a file of the largest size must fit)")
        if not self.client_file_timeout > 0:
            raise InvalidParams("client_file_timeout must be > 0")
        return self

    @property
    def vertex(self) -> bool:
        """Whether Google Vertex AI runs this daemon as a prediction container."""
        return self.aip_mode == "PREDICTION"

    @property
    def spec_mode(self) -> str:
        """What speculative decoding runs: "" (none), "draft" or "mtp"."""
        if self.spec == "off":
            return ""
        return self.spec or ("draft" if self.spec_draft_model else "")

    def api_keys(self) -> list[str]:
        """Every API key the HTTP front accepts: --api-key's, comma-separated, then
        --api-key-file's, one per line (read here, once, at the front's start)."""
        keys = [k.strip() for k in (self.api_key or "").split(",") if k.strip()]
        if self.api_key_file:
            try:
                with open(self.api_key_file, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except OSError as e:
                raise InvalidParams(f"api_key_file {self.api_key_file}: {e.strerror}",
                                    api_key_file=self.api_key_file) from None
            keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if (self.api_key is not None or self.api_key_file) and not keys:
            raise InvalidParams("api_key / api_key_file name no key")
        return list(dict.fromkeys(keys))

    def request_limits(self) -> "RequestLimits":
        """The bounds `CompletionRequest.check` applies, from this configuration."""
        return RequestLimits(
            max_prompt_bytes=self.max_prompt_bytes or 32 * self.ctx,
            max_prompt_tokens=self.ctx // self.slots if self.ctx_per_slot else self.ctx,
            max_stop=self.max_stop, max_stop_bytes=self.max_stop_bytes,
            max_stop_tokens=self.max_stop_tokens, max_genes=self.max_request_genes,
        )


def split_names(values: list[str]) -> list[str]:
    """`--model-alias a,b --model-alias c` -> ["a", "b", "c"] (llama-server's comma lists)."""
    return [x.strip() for v in values for x in v.split(",")]


def http_addresses(spec: str) -> list[tuple[str, int]]:
    """`--http`'s comma-separated addresses (llama-server's several hosts), each HOST:PORT."""
    return [http_address(a.strip()) for a in spec.split(",")]


def http_address(spec: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [::1]:8080) -> (host, port)."""
    host, sep, port = spec.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidParams(f"--http wants HOST:PORT, got {spec!r}", http=spec)
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ClusterConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The cluster (actord[ray], actord/cluster/): one NodeDaemon per Ray node hosting an
    `ActorSystem` built from `node` (its page_dir is replaced per node), one MindRouter.

    `root` is the cluster's shared folder: `root/router/directory.json` (the directory,
    crash-safe), `root/nodes/NAME/pages` (each node's page files) and
    `root/nodes/NAME/fence` (each node's epochs and applied turns). On one machine, or with
    `root` on a filesystem every node mounts, a lost node's page files are read by the node
    that takes its minds over; where they cannot be read the minds are re-prefilled.
    """

    node: Config
    root: str = "./actord-cluster"
    namespace: str = "actord"
    nodes: int = 3  # NodeDaemons `actord cluster up` starts (one per simulated node)
    num_gpus: float = 0.0  # per NodeDaemon (1 where a node has a GPU); num_cpus is always 0
    # How many of a mind's applied turns (id -> answer) a node keeps for duplicates.
    turns_kept: int = 16
    # After each turn, make the mind's state durable in its page file (a save per turn:
    # a lost node's minds then come back from their files, not re-prefilled).
    durable_turns: bool = False
    # The router's view of node health: how often it polls Ray's node table, and how long
    # it waits for a restarted daemon (after an actor failure) before treating it as lost.
    monitor_interval_s: float = 0.5
    restart_wait_s: float = 60.0
    call_timeout_s: float = 600.0  # one call from the router to a node
    # Ray's node health checks (its GCS config; 0 = Ray's default, where a hung node is
    # declared dead after about 66 s). A node stops answering -> dead after about
    # period x threshold; `local.FAST_HEALTH` is 1000 ms x 5 with a 2000 ms timeout.
    health_check_period_ms: int = 0
    health_check_timeout_ms: int = 0
    health_check_failure_threshold: int = 0
    socket: str | None = None  # the router's JSON-RPC socket (None: root/router/actord.sock)
    log_level: str = "warning"

    def validate(self) -> "ClusterConfig":
        self.node.validate()
        if self.nodes < 1 or self.turns_kept < 1:
            raise InvalidParams("cluster nodes and turns_kept must be >= 1")
        if min(self.health_check_period_ms, self.health_check_timeout_ms, self.health_check_failure_threshold) < 0:
            raise InvalidParams("health check settings are >= 0 (0: Ray's default)")
        if self.num_gpus < 0 or self.monitor_interval_s <= 0 or self.restart_wait_s <= 0 or self.call_timeout_s <= 0:
            raise InvalidParams("num_gpus >= 0; monitor_interval_s, restart_wait_s, call_timeout_s > 0")
        return self

    def ray_system_config(self) -> dict[str, int]:
        """The health-check settings given, as Ray's `_system_config` keys."""
        names = ("health_check_period_ms", "health_check_timeout_ms", "health_check_failure_threshold")
        out = {n: getattr(self, n) for n in names if getattr(self, n)}
        if out:
            out["health_check_initial_delay_ms"] = 1000
        return out
