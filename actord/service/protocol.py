"""What a front may ask of the service: the `Service` protocol, its typed results and the
event stream a streamed request feeds.

Why a protocol: the fronts (the JSON-RPC socket, the OpenAI and llama-server HTTP routes,
the daemon) are clients of one typed surface, not of the actors or the engine thread behind
it. `ActorSystem` (service/system.py) implements it; the cluster's front
(actord/cluster/front.py) implements the generation part its routes call (`model_props`,
`chat_info`, `complete`, `complete_n`, `chat`, `health`, `closing`, `metrics`). A layering
test (tests/frontends/test_fronts_use_the_service.py) holds the fronts to it: no front reads
a private name of the system, its engine, or imports the serving floor.

Every verb that is an external input is recorded for traces where it enters the façade
(`service/system.py: entry`), under its JSON-RPC method name, so a replay re-executes it
by that name (actord/replay/replay.py).

The chat package's narrower `ChatHost` (and the `TokenChunk` stream) is chat's own
(actord/chat/host.py): the façade implements it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from actord.chat.host import ChatHost
from actord.chat.stream import OnToken, TokenChunk  # noqa: F401  (the stream fronts feed)
from actord.engine.jobs import ChatTemplateInfo, ModelProps
from actord.vocabulary.types import CompletionRequest, CompletionResult, RequestLimits, SlotInfo
from actord.vocabulary.config import Config
from actord.vocabulary.metrics import Metrics

if TYPE_CHECKING:
    from actord.chat.messages import ChatMessage, ChatRequest, ChatResult
    from actord.service.memory import MemoryReport, MemorySources


class Tokenized(msgspec.Struct, frozen=True):
    """`tokenize`'s answer: the ids, and (with_pieces) each one's bytes."""

    tokens: list[int]
    pieces: list[bytes] | None = None

    def answer(self) -> dict[str, Any]:
        """{tokens: [id, ...]} or, with pieces, [{id, piece}]: a piece is its text when it
        is valid UTF-8, else its bytes (llama-server's /tokenize answer, the socket's too)."""
        if self.pieces is None:
            return {"tokens": self.tokens}
        tokens = []
        for t, piece in zip(self.tokens, self.pieces):
            try:
                text: Any = piece.decode("utf-8")
            except UnicodeDecodeError:
                text = list(piece)
            tokens.append({"id": t, "piece": text})
        return {"tokens": tokens}


class TemplateSource(msgspec.Struct, frozen=True):
    """The chat template chats render with (`chat.template`): --chat-template-file, else the model's."""

    template: str | None
    bos_token: str
    eos_token: str
    origin: str  # "builtin" (--chat-template), "file" (--chat-template-file) or "model"


class Embedded(msgspec.Struct, frozen=True):
    """`embed`'s answer: one pooled, L2-normalized vector per input, and the tokens they took."""

    vectors: list[list[float]]
    n_tokens: int


class MindView(msgspec.Struct, frozen=True):
    """One mind (or client-named page) and the tier that holds it: "slot" (its state in the
    KV cache), "page" (a RAM page) or "file" (a page file in the page folder)."""

    name: str
    tier: str
    n_bytes: int
    n_tokens: int | None = None  # None: a page file's, not read (its header would be a disk read per poll)
    slot: int | None = None
    mtime: float | None = None  # a page file's last write (wall clock)
    # A RAM page on a shared prefix (serving/page_bases.py): its base's generation, tokens
    # and bytes (held once for every page on it).
    base: int | None = None
    n_base: int = 0
    base_bytes: int = 0


class BudgetView(msgspec.Struct, frozen=True):
    """A byte budget and what holds it now (limit 0: unlimited)."""

    name: str
    used: int
    limit: int


class MemoryView(msgspec.Struct, frozen=True):
    """`memory`'s answer (what the dashboard draws): the slots, every mind by tier, the byte
    budgets, the genes, and the counters a rate is computed from, at wall-clock `time`."""

    time: float
    slots: list[SlotInfo]
    minds: list[MindView]
    budgets: list[BudgetView]
    genes: list[dict[str, Any]]
    counters: dict[str, float]
    next: str | None = None  # the cursor of the following page (memory(after=next)); None: the last


class Service(Protocol):
    """The verbs a front calls (see the module docstring); `ActorSystem` is the one implementation."""

    config: "Config"
    metrics: "Metrics"  # the one registry: fronts count their own connections and refusals in it
    closing: bool

    @property
    def asleep(self) -> bool: ...  # the idle daemon freed its model (service/sleep.py)

    # -- what the model is, and the bounds on a request ---------------------------------
    def model_props(self) -> ModelProps: ...
    def request_limits(self) -> RequestLimits: ...
    async def chat_info(self) -> ChatTemplateInfo: ...
    def default_gene_ids(self) -> set[int]: ...
    def n_deferred(self) -> int: ...

    # -- generation ----------------------------------------------------------------------
    async def complete(self, request: CompletionRequest, *, on_token: OnToken | None = None) -> CompletionResult: ...
    async def complete_n(self, request: CompletionRequest, n: int, *,
                         on_token: OnToken | None = None) -> list[CompletionResult]: ...
    async def chat(self, request: "ChatRequest", *, on_token: OnToken | None = None,
                   n: int = 1) -> "ChatResult | list[ChatResult]": ...

    # -- text, without generating ---------------------------------------------------------
    async def tokenize(self, content: str, add_special: bool = False, parse_special: bool = True,
                       with_pieces: bool = False) -> Tokenized: ...
    async def detokenize(self, tokens: list[int]) -> str: ...
    async def chat_template(self) -> TemplateSource: ...
    async def apply_template(self, messages: list["ChatMessage"], template: str | None = None,
                             add_generation_prompt: bool = True, tools: list[Any] | None = None,
                             template_kwargs: dict[str, Any] | None = None) -> str: ...
    async def count_prompt(self, messages: list["ChatMessage"], template: str | None = None,
                           add_generation_prompt: bool = True, tools: list[Any] | None = None,
                           template_kwargs: dict[str, Any] | None = None) -> int: ...
    async def embed(self, inputs: list[str | list[int]]) -> Embedded: ...

    # -- slots, pages, genes ---------------------------------------------------------------
    async def slot_list(self) -> list[SlotInfo]: ...
    async def slot_erase(self, slot: int) -> dict[str, Any]: ...
    async def slot_save(self, slot: int, file: str) -> dict[str, Any]: ...
    async def slot_restore(self, slot: int, file: str) -> dict[str, Any]: ...
    async def page_out(self, slot: int, page: str) -> dict[str, Any]: ...
    async def page_in(self, slot: int, page: str) -> dict[str, Any]: ...
    async def page_drop(self, page: str) -> Any: ...
    async def page_list(self, after: str = "", limit: int = 0) -> Any: ...
    async def forget_mind(self, mind: str) -> int: ...
    async def page_spill(self, page: str, file: str, drop: bool = False) -> dict[str, Any]: ...
    async def page_stats(self) -> Any: ...
    async def checkpoint_stats(self) -> Any: ...
    async def gene_load(self, path: str, *, default: bool = False) -> Any: ...
    async def gene_unload(self, gene_id: int) -> Any: ...
    async def gene_page_out(self, gene_id: int) -> Any: ...
    async def gene_page_in(self, gene_id: int) -> Any: ...
    async def gene_list(self) -> Any: ...

    # -- the daemon's own ------------------------------------------------------------------
    async def props_dict(self) -> dict[str, Any]: ...
    async def health(self) -> dict[str, Any]: ...
    async def memory(self, after: str = "", limit: int = 0) -> MemoryView: ...
    def metrics_text(self) -> str: ...
    async def memory_report(self) -> "MemoryReport": ...
    # Bytes a front holds (stored responses, connection buffers), for memory_report.
    memory_sources: "MemorySources"
    async def shutdown(self, grace_s: float | None = None) -> dict[str, int]: ...
    async def stop(self) -> dict[str, Any]: ...
    async def write_behind(self) -> None: ...
    async def persist(self) -> dict[str, int]: ...
    stop_requested: Any  # an anyio.Event the `stop` verb sets (the daemon waits on it); None before the start
