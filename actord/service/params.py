"""The typed arguments of the service's verbs, as a front decodes them: one Struct per
shape of arguments, each checking itself as it decodes.

Why in service: every front that calls a verb from what a client sent (the socket's
methods, llama-server's native routes, the CLI that builds a socket request from its
arguments, a replay re-executing a trace) decodes into these and calls the `Service` verb
itself; no front goes through another's method table to reach a verb. The socket's method
names are its wire, mapped to verbs at its edge (actord/frontends/rpc/methods.py).

Strings a client sends are bounded at decode (`Meta(max_length=...)`), and in-RAM page
names are checked against the stated page-name character set (`storage/paths.py`) as they
decode (a PathRefused), before anything is asked of an actor; file names are confined by
the page folder's own check.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from actord.chat.messages import ChatMessage, Tool
from actord.storage.clientfiles import MAX_PATH
from actord.storage.paths import MAX_NAME, check_page_name
from actord.vocabulary.errors import InvalidParams

PageName = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
FileName = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
ClientPath = Annotated[str, msgspec.Meta(max_length=MAX_PATH)]


class NoParams(msgspec.Struct, forbid_unknown_fields=True):
    pass


class SlotParams(msgspec.Struct, forbid_unknown_fields=True):
    slot: int


class PageParams(msgspec.Struct, forbid_unknown_fields=True):
    page: PageName

    def __post_init__(self) -> None:
        check_page_name(self.page)


class SlotPageParams(msgspec.Struct, forbid_unknown_fields=True):
    slot: int
    page: PageName

    def __post_init__(self) -> None:
        check_page_name(self.page)


class SpillParams(msgspec.Struct, forbid_unknown_fields=True):
    page: PageName
    file: FileName
    drop: bool = False

    def __post_init__(self) -> None:
        check_page_name(self.page)


class SlotFileParams(msgspec.Struct, forbid_unknown_fields=True):
    slot: int
    file: FileName


class GenePathParams(msgspec.Struct, forbid_unknown_fields=True):
    path: ClientPath
    default: bool = False


class GeneIdParams(msgspec.Struct, forbid_unknown_fields=True):
    id: int


class ListParams(msgspec.Struct, forbid_unknown_fields=True):
    """A page of a listing by name: the names after `after`, at most `limit` (0: all)."""

    after: PageName = ""
    limit: Annotated[int, msgspec.Meta(ge=0)] = 0


class StatsParams(msgspec.Struct, forbid_unknown_fields=True):
    what: Literal["memory", "page", "checkpoint"]


class TokenizeParams(msgspec.Struct, forbid_unknown_fields=True):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeParams(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[int]


class ApplyTemplateParams(msgspec.Struct, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    template: str | None = None
    add_generation_prompt: bool = True
    # None when absent, as the embedded call's defaults, so a trace records the same input.
    tools: list[Tool] | None = None  # rendered as a chat with these tools renders them
    template_kwargs: dict[str, Any] | None = None  # more template variables (enable_thinking, ...)


def decode(obj: Any, typ: type) -> Any:
    """`obj` (JSON-shaped: a dict of a body's fields) as the arguments `typ`; a value of the
    wrong shape is an InvalidParams naming its path (a refused page name, a PathRefused)."""
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as e:
        raise InvalidParams(f"invalid request: {e}") from None
