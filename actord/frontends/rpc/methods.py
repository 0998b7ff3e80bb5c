"""The socket's method table: JSON-RPC method name -> typed params Struct and the Service
verb it calls.

The method names are the socket's wire; this is where they meet the verbs, at the socket's
edge. The params Structs are the service's (actord/service/params.py: bounded, a page name
checked as it decodes), which the native HTTP routes decode into too before calling the
same verbs themselves: no other front goes through this table. The CLI, the socket's
client, builds its verbs from it (`actord page-out 0 ada`: the method's params are the
verb's arguments, its `help` the verb's), and so do the docs, so a method's name, shape
and description are defined once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import msgspec

from actord.chat.messages import ChatRequest
from actord.service.params import (  # noqa: F401  (ListParams, ... : every method's, here by name)
    ApplyTemplateParams, DetokenizeParams, GeneIdParams, GenePathParams, ListParams, NoParams, PageParams,
    SlotFileParams, SlotPageParams, SlotParams, SpillParams, StatsParams, TokenizeParams,
)
from actord.service.protocol import Service, TokenChunk
from actord.vocabulary.types import CompletionRequest

Handler = Callable[[Service, Any, Callable[[Any], None] | None], Awaitable[Any]]


@dataclass(frozen=True)
class Method:
    params: type
    call: Handler
    streams: bool = False
    # A control call: it waits for a turn under the per-connection and global bounds on
    # control work (Config.max_control_in_flight / max_control_total). Generation and the
    # calls that ask no actor (props, health, metrics) never wait there.
    control: bool = True
    help: str = ""  # one line: what the method does (the CLI verb's help)


def _b(x: Any) -> Any:
    return msgspec.to_builtins(x)


async def _completion(system: Service, p: CompletionRequest, sink: Any) -> Any:
    return _b(await system.complete(p, on_token=sink if p.stream else None))


def socket_chunk(chunk: TokenChunk) -> Mapping[str, Any]:
    """A chat chunk as the socket streams it: the calls it completed (`calls`, actord's
    CallMade events) become `tool_calls` deltas in OpenAI's shape, in the same place, which
    is what the socket's `completion.chunk` has always carried. Written here rather than
    borrowed from the HTTP front: this is the socket's own wire, which only looks like OpenAI's."""
    if not chunk.get("calls"):
        return chunk
    return {("tool_calls" if k == "calls" else k): [
        {"index": m.index, "id": m.call.id, "type": "function",
         "function": {"name": m.call.name, "arguments": m.call.arguments}} for m in v] if k == "calls" else v
        for k, v in chunk.items()}


async def _chat(system: Service, p: ChatRequest, sink: Any) -> Any:
    on_token = None
    if p.stream and sink is not None:
        def on_token(chunk: TokenChunk) -> None:
            sink(socket_chunk(chunk))
    return _b(await system.chat(p, on_token=on_token))


async def _stats(system: Service, p: StatsParams, _: Any) -> Any:
    """`actord stats memory|page|checkpoint`: memory is the whole daemon's (what holds its
    bytes, actord/service/memory.py); page and checkpoint are page.stats and checkpoint.stats."""
    if p.what == "memory":
        return _b(await system.memory_report())
    return _b(await (system.page_stats() if p.what == "page" else system.checkpoint_stats()))


# -- text verbs: the tokenizer and the chat template, without generating -----------------
#
# The system's own verbs (actord/service/text.py): each records its input, so a trace that
# holds them replays, and is bounded like a completion's prompt.


async def _tokenize(system: Service, p: TokenizeParams, _: Any) -> Any:
    """{tokens: [id, ...]} or, with_pieces, [{id, piece}] (`Tokenized.answer`)."""
    return (await system.tokenize(p.content, p.add_special, p.parse_special, p.with_pieces)).answer()


async def _detokenize(system: Service, p: DetokenizeParams, _: Any) -> Any:
    return {"content": await system.detokenize(p.tokens)}


async def _chat_template(system: Service, p: NoParams, _: Any) -> Any:
    src = await system.chat_template()
    return {"template": src.template, "bos_token": src.bos_token, "eos_token": src.eos_token, "from": src.origin}


async def _apply_template(system: Service, p: ApplyTemplateParams, _: Any) -> Any:
    """{prompt}: the messages rendered as a chat would render them, without generating."""
    return {"prompt": await system.apply_template(p.messages, p.template, p.add_generation_prompt, p.tools,
                                                  p.template_kwargs)}


METHODS: dict[str, Method] = {
    "completion": Method(CompletionRequest, _completion, streams=True, control=False,
                         help="generate from a prompt (text or token ids), in a slot or a named mind"),
    "chat": Method(ChatRequest, _chat, streams=True, control=False,
                   help="one chat turn: messages rendered with the model's chat template"),
    "slot.list": Method(NoParams, lambda s, p, _: _wrap(s.slot_list()), help="the slots and what each holds"),
    "slot.erase": Method(SlotParams, lambda s, p, _: _wrap(s.slot_erase(p.slot)), help="empty a slot"),
    "props": Method(NoParams, lambda s, p, _: _wrap(s.props_dict()), control=False,
                    help="the model's and the daemon's settings"),
    "health": Method(NoParams, lambda s, p, _: _wrap(s.health()), control=False, help="whether the daemon serves"),
    "metrics": Method(NoParams, lambda s, p, _: _const({"text": s.metrics_text()}), control=False,
                      help="the metrics, in Prometheus' text format"),
    "page.out": Method(SlotPageParams, lambda s, p, _: _wrap(s.page_out(p.slot, p.page)),
                       help="page a slot's context out to a page in RAM"),
    "page.in": Method(SlotPageParams, lambda s, p, _: _wrap(s.page_in(p.slot, p.page)),
                      help="page a page into a slot"),
    "page.drop": Method(PageParams, lambda s, p, _: _wrap(s.page_drop(p.page)),
                        help="forget a page"),
    "page.list": Method(ListParams, lambda s, p, _: _wrap(s.page_list(p.after, p.limit)),
                        help="the pages held, by name (after, limit: a page of them)"),
    "page.spill": Method(SpillParams, lambda s, p, _: _wrap(s.page_spill(p.page, p.file, p.drop)),
                         help="write a page to a file in the page folder (drop: and free its RAM)"),
    "slot.save": Method(SlotFileParams, lambda s, p, _: _wrap(s.slot_save(p.slot, p.file)),
                        help="save a slot's context to a file in the page folder"),
    "slot.restore": Method(SlotFileParams, lambda s, p, _: _wrap(s.slot_restore(p.slot, p.file)),
                           help="restore a slot's context from a file in the page folder"),
    "gene.load": Method(GenePathParams, lambda s, p, _: _wrap(s.gene_load(p.path, default=p.default)),
                        help="load a gene (a LoRA adapter) from a file (default: active by default, at scale 1)"),
    "gene.unload": Method(GeneIdParams, lambda s, p, _: _wrap(s.gene_unload(p.id)), help="unload a gene"),
    "gene.page_out": Method(GeneIdParams, lambda s, p, _: _wrap(s.gene_page_out(p.id)),
                            help="page a gene's weights out of the device"),
    "gene.page_in": Method(GeneIdParams, lambda s, p, _: _wrap(s.gene_page_in(p.id)),
                           help="page a gene's weights back into the device"),
    "gene.list": Method(NoParams, lambda s, p, _: _wrap(s.gene_list()), help="the loaded genes"),
    "memory": Method(ListParams, lambda s, p, _: _wrap(s.memory(p.after, p.limit)),
                     help="every tier at once: slots, minds by tier (slot, RAM page, page file), budgets, genes "
                     "(after, limit: a page of the minds, by name; `next` is the following page's cursor)"),
    "persist": Method(NoParams, lambda s, p, _: _wrap(s.persist()),
                      help="write every mind not yet in her page file (slots and RAM pages) now"),
    "stop": Method(NoParams, lambda s, p, _: _wrap(s.stop()),
                   help="stop the daemon gracefully, as SIGTERM does: requests end, then every mind is written "
                   "to her page file"),
    "page.stats": Method(NoParams, lambda s, p, _: _wrap(s.page_stats()), help="the page store's counters"),
    "checkpoint.stats": Method(NoParams, lambda s, p, _: _wrap(s.checkpoint_stats()),
                               help="the checkpoint budget's counters"),
    "stats": Method(StatsParams, _stats, help="memory: what holds the daemon's bytes, RSS and the rest; "
                    "page, checkpoint: those actors' counters"),
    "tokenize": Method(TokenizeParams, _tokenize, help="text -> token ids (with_pieces: and each one's text)"),
    "detokenize": Method(DetokenizeParams, _detokenize, help="token ids -> text"),
    "chat.template": Method(NoParams, _chat_template, help="the chat template chats render with"),
    "apply_template": Method(ApplyTemplateParams, _apply_template,
                             help="messages rendered as a chat renders them, without generating"),
}


async def _wrap(aw: Awaitable[Any]) -> Any:
    return _b(await aw)


async def _const(v: Any) -> Any:
    return v
