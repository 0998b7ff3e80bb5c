"""What the router and the daemons exchange (msgspec Structs; Ray pickles them).

A node's answer is an `Answer`: a value, or an actord error as its dict, so a typed error
crosses Ray as itself (`unwrap` raises it again at the caller), never as a Ray error. A Ray
error (`RayActorError` and kin) means the daemon is gone, not that it refused.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.vocabulary.errors import ActordError, from_dict


class Turn(msgspec.Struct, frozen=True):
    mind: str
    epoch: int
    turn: str  # the turn id: a retry carries the same one
    request: dict[str, Any]  # the verb's request fields (the node sets `mind`)
    kind: str = "completion"  # "completion" (CompletionRequest) or "chat" (ChatRequest: the node renders it)


KINDS = ("completion", "chat")


class Answer(msgspec.Struct, frozen=True):
    value: Any = None
    error: dict[str, Any] | None = None

    def unwrap(self) -> Any:
        if self.error is not None:
            raise from_dict(self.error)
        return self.value

    @staticmethod
    def of_error(e: ActordError) -> "Answer":
        return Answer(error=e.to_dict())


class NodeLoad(msgspec.Struct, frozen=True):
    node: str
    incarnation: str  # changes at every (re)start of the daemon
    pid: int
    ray_node_id: str
    free_page_bytes: int
    page_ram_bytes: int
    queue: int  # turns in flight on this node
    minds: int  # minds this node holds (fenced)
    turns_applied: int  # turns applied since this incarnation started


class Holding(msgspec.Struct, frozen=True):
    mind: str
    epoch: int
    durable: bool  # a page file holds its state
    last_turn: str | None = None
    frozen: bool = False  # an export left it frozen (a migration whose router went away)
