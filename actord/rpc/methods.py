"""The method table: JSON-RPC method name -> typed params Struct and a call on the system.

One table serves the daemon, the CLI's `call` and the docs, so a method's name and shape
are defined once. Later issues add rows (page.*, gene.*).

Strings a client sends are bounded at decode (`Meta(max_length=...)`), and in-RAM page
names are checked against the stated page-name character set (`storage/paths.py`) before
anything is asked of an actor; file names are confined by the page folder's own check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Awaitable, Callable

import msgspec

from actord.api import CompletionRequest
from actord.chat import ChatRequest
from actord.storage.clientfiles import MAX_PATH
from actord.storage.paths import MAX_NAME, check_page_name

PageName = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
FileName = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
ClientPath = Annotated[str, msgspec.Meta(max_length=MAX_PATH)]


class NoParams(msgspec.Struct, forbid_unknown_fields=True):
    pass


class SlotParams(msgspec.Struct, forbid_unknown_fields=True):
    slot: int


class PageParams(msgspec.Struct, forbid_unknown_fields=True):
    page: PageName


class SlotPageParams(msgspec.Struct, forbid_unknown_fields=True):
    slot: int
    page: PageName


class SpillParams(msgspec.Struct, forbid_unknown_fields=True):
    page: PageName
    file: FileName
    drop: bool = False


class SlotFileParams(msgspec.Struct, forbid_unknown_fields=True):
    slot: int
    file: FileName


class GenePathParams(msgspec.Struct, forbid_unknown_fields=True):
    path: ClientPath
    default: bool = False


class GeneIdParams(msgspec.Struct, forbid_unknown_fields=True):
    id: int


Handler = Callable[[Any, Any, Callable[[Any], None] | None], Awaitable[Any]]


@dataclass(frozen=True)
class Method:
    params: type
    call: Handler
    streams: bool = False
    # A control call: it waits for a turn under the per-connection and global bounds on
    # control work (Config.max_control_in_flight / max_control_total). Generation and the
    # calls that ask no actor (props, health, metrics) never wait there.
    control: bool = True


def _b(x: Any) -> Any:
    return msgspec.to_builtins(x)


async def _completion(system: Any, p: CompletionRequest, sink: Any) -> Any:
    return _b(await system.complete(p, on_token=sink if p.stream else None))


async def _chat(system: Any, p: ChatRequest, sink: Any) -> Any:
    return _b(await system.chat(p, on_token=sink if p.stream else None))


METHODS: dict[str, Method] = {
    "completion": Method(CompletionRequest, _completion, streams=True, control=False),
    "chat": Method(ChatRequest, _chat, streams=True, control=False),
    "slot.list": Method(NoParams, lambda s, p, _: _wrap(s.slot_list())),
    "slot.erase": Method(SlotParams, lambda s, p, _: _wrap(s.slot_erase(p.slot))),
    "props": Method(NoParams, lambda s, p, _: _wrap(s.props_dict()), control=False),
    "health": Method(NoParams, lambda s, p, _: _wrap(s.health()), control=False),
    "metrics": Method(NoParams, lambda s, p, _: _const({"text": s.metrics_text()}), control=False),
    "page.out": Method(SlotPageParams, lambda s, p, _: _wrap(s.page_out(p.slot, check_page_name(p.page)))),
    "page.in": Method(SlotPageParams, lambda s, p, _: _wrap(s.page_in(p.slot, check_page_name(p.page)))),
    "page.drop": Method(PageParams, lambda s, p, _: _wrap(s.page_drop(check_page_name(p.page)))),
    "page.list": Method(NoParams, lambda s, p, _: _wrap(s.page_list())),
    "page.spill": Method(SpillParams, lambda s, p, _: _wrap(s.page_spill(check_page_name(p.page), p.file, p.drop))),
    "slot.save": Method(SlotFileParams, lambda s, p, _: _wrap(s.slot_save(p.slot, p.file))),
    "slot.restore": Method(SlotFileParams, lambda s, p, _: _wrap(s.slot_restore(p.slot, p.file))),
    "gene.load": Method(GenePathParams, lambda s, p, _: _wrap(s.gene_load(p.path, default=p.default))),
    "gene.unload": Method(GeneIdParams, lambda s, p, _: _wrap(s.gene_unload(p.id))),
    "gene.page_out": Method(GeneIdParams, lambda s, p, _: _wrap(s.gene_page_out(p.id))),
    "gene.page_in": Method(GeneIdParams, lambda s, p, _: _wrap(s.gene_page_in(p.id))),
    "gene.list": Method(NoParams, lambda s, p, _: _wrap(s.gene_list())),
    "page.stats": Method(NoParams, lambda s, p, _: _wrap(s.page_stats())),
    "checkpoint.stats": Method(NoParams, lambda s, p, _: _wrap(s.checkpoint_stats())),
}


async def _wrap(aw: Awaitable[Any]) -> Any:
    return _b(await aw)


async def _const(v: Any) -> Any:
    return v
