"""Typed errors, one class per failure a caller can act on.

Every error that crosses an interface (JSON-RPC, embedded API, CLI) is an ActordError: its
class name is the `data.type` a client sees, and `code` is the JSON-RPC error code. Bad
input is refused with one of these *before* anything changes, so a caller can retry or
correct without cleaning up after us.
"""

from __future__ import annotations

from typing import Any, ClassVar

# JSON-RPC 2.0 standard codes.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# Domain errors live in the implementation-defined server error range.
DOMAIN_ERROR = -32000


class ActordError(Exception):
    code: ClassVar[int] = DOMAIN_ERROR
    # Rough HTTP analogue, kept because the original server used these (404/503/400).
    http_status: ClassVar[int] = 400

    def __init__(self, message: str = "", **data: Any) -> None:
        super().__init__(message or self.__class__.__name__)
        self.message = message or self.__class__.__name__
        self.data = data

    @property
    def type(self) -> str:
        return type(self).__name__

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, **self.data}


class InvalidParams(ActordError):
    code = INVALID_PARAMS


class PromptTooLong(InvalidParams):
    pass


class ChatTemplateError(InvalidParams):
    """A chat template failed to compile or render, or refused the conversation."""


class NoChatTemplate(InvalidParams):
    """The model ships no chat template and the request named none."""


class ModelNotFound(ActordError):
    """A request named a model this daemon does not serve."""

    http_status = 404


class SlotNotFound(ActordError):
    http_status = 404


class SlotEmpty(ActordError):
    pass


class SlotBusy(ActordError):
    http_status = 409


class NoFreeSlot(ActordError):
    http_status = 503


class PageNotFound(ActordError):
    http_status = 404


class PageRamExceeded(ActordError):
    http_status = 503


class PageDiskExceeded(ActordError):
    """A page file would pass the disk budget (--page-disk-bytes) and no file the daemon
    may evict (a mind's own, not in use) frees enough room."""

    http_status = 507


class PageDoesNotFit(ActordError):
    """A page's state does not fit the context it is being paged into."""

    http_status = 507


class ForeignPage(ActordError):
    """A page file was saved from another model (other weights, shapes or vocab): refused
    before anything changes. Not a PageDoesNotFit: no amount of room would make it fit."""

    http_status = 409


class GenesMissing(ForeignPage):
    """A page file's state was computed under genes this daemon has not loaded (named by
    content: a gene of the same load-order id is another adapter here), or under genes it
    cannot name (saved before genes were named by content): refused before anything changes,
    never served (vocabulary/kv_identity.py)."""


class FileNotFound(ActordError):
    http_status = 404


class CorruptPageFile(ActordError):
    http_status = 422


class PathRefused(ActordError):
    http_status = 403


class StorageError(ActordError):
    """An OS-level failure while publishing or reading page files (fsync, rename, ...)."""

    http_status = 500


class GeneNotFound(ActordError):
    http_status = 404


class GeneIsDefault(ActordError):
    http_status = 409


class GeneInUse(ActordError):
    http_status = 409


class DeviceBudgetExceeded(ActordError):
    http_status = 503


class EngineError(ActordError):
    """A libllama call failed on the engine thread; the engine keeps serving."""

    http_status = 500


class WrongThread(ActordError):
    """A libllama call was attempted off the engine thread."""

    http_status = 500


class ActorFailed(ActordError):
    """The actor that held a pending ask raised or stopped before replying."""

    http_status = 500


class ShuttingDown(ActordError):
    http_status = 503


class Cancelled(ActordError):
    http_status = 499


class ContextFull(ActordError):
    """The shared KV cache has no room for this request, and nothing idle can be freed."""

    http_status = 503


class KvCacheFull(EngineError):
    """llama_decode found no free cells for a step (the scheduler makes room and retries)."""


class StepSkipped(EngineError):
    """A step planned before an earlier step failed was not run: the memory is as it was
    (the scheduler plans it again). `data.epoch` is the engine's epoch now."""


class InternalError(ActordError):
    """A request could not be carried on (a bug or an unexpected failure handling its
    output); it ended, its slot is idle again, the other requests go on."""

    http_status = 500


class AskCycle(ActordError):
    """An ask would close a cycle of waits (a deadlock): refused at once, the chain named."""

    http_status = 500


class AskOrderViolated(ActordError):
    """An actor tried to await a reply from one at or above its place in the ask order."""

    http_status = 500


class AskTimeout(ActordError):
    """An ask was not answered within its bound; `data.chain` names who waited on whom."""

    http_status = 504


# ---- hostile and careless clients (issue 10) ------------------------------------------


class RequestTooLarge(ActordError):
    """A request line longer than `max_line_bytes`, or a batch longer than a connection may
    have in flight. The line is discarded; the connection stays usable."""

    code = INVALID_REQUEST
    http_status = 413


class TooManyRequests(ActordError):
    """The connection already has `max_requests_in_flight` requests (or
    `max_inflight_bytes` of request lines) being served: wait for answers, then retry."""

    http_status = 429


class Overloaded(ActordError):
    """A daemon-wide bound is reached (connections, threads reading client files)."""

    http_status = 503


class PeerRefused(ActordError):
    """The connecting process's uid/gid (SO_PEERCRED) is not allowed to use this daemon."""

    http_status = 403


class SocketInUse(ActordError):
    """Start-up found a live daemon on the socket path (it answered, or holds the lock)."""

    http_status = 409


class NotARegularFile(PathRefused):
    """A client named a FIFO, a device, a folder or a socket where a file is read."""


class FileTooLarge(ActordError):
    http_status = 413


class FileReadTimeout(ActordError):
    """Reading a client-named file took longer than `client_file_timeout` seconds."""

    http_status = 504


class EngineTimeExceeded(ActordError):
    """A request had more engine time than `request_engine_s` allows (its share of the
    steps it was in: policy/engine_time.py); it ended, and its slot serves others."""

    http_status = 429


class DraftVocabMismatch(InvalidParams):
    """The draft model's vocabulary is not the target's (speculative decoding needs the
    same token ids with the same texts): refused at start."""


class SpecUnsupported(InvalidParams):
    """Speculative decoding as configured cannot run on this model (a sliding-window cache
    that is not full, no MTP layer for --spec mtp, ...): refused at start, naming what is
    missing."""


# ---- the cluster (actord[ray], issue 20) -----------------------------------------------


class StaleEpoch(ActordError):
    """A turn (or a migration step) named a mind at an epoch this node does not hold it at:
    the mind moved (a newer epoch owns it elsewhere) or was never placed here. Refused
    before anything runs; `data.held` is the epoch this node holds (None: not at all)."""

    http_status = 409


class DuplicateTurn(ActordError):
    """A turn id this node already applied to the mind: refused, nothing runs again.
    `data.result` carries the answer recorded when it was applied (when still kept), so a
    retry after a lost reply gets the one answer the turn had."""

    http_status = 409


class NodeUnavailable(ActordError):
    """No node can serve the mind now (its node is gone and re-homing failed, or the
    cluster has no live node)."""

    http_status = 503


class MigrationFailed(ActordError):
    """A migration stopped part way; the mind stays with its one owner (`data.owner`,
    `data.epoch`) and the destination's partial copy is dropped."""

    http_status = 500


class NotServed(ActordError):
    """A route or verb this front does not serve (the cluster's HTTP front serves the
    OpenAI generation routes, not one node's slots, genes, embeddings or native API)."""

    http_status = 501


ERROR_TYPES: dict[str, type[ActordError]] = {
    cls.__name__: cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, ActordError)
}


def from_dict(data: dict[str, Any]) -> ActordError:
    """Rebuild a typed error on the client side from a JSON-RPC error's `data`."""
    data = dict(data)
    cls = ERROR_TYPES.get(data.pop("type", ""), ActordError)
    message = data.pop("message", "")
    return cls(message, **data)
