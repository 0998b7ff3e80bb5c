"""The answers every route of the HTTP front shares, OpenAI's and llama-server's alike.

Why a module of its own: the front (`app.py`), the generation in a response
(`streaming.py`) and both APIs' routes raise and answer with these, and none of them should
import another for them. `HttpError` is an error of the HTTP layer itself (a missing key, a
body over its limit); `ClientGone` a client that hung up before its request was read;
`Silent` the answer to it (nothing). `error_response` is OpenAI's error object, which the
front answers with on every route that is not llama-server's, unknown routes included.
`RouteGroup` is what a group of routes holds: the front it stands behind. `stopping_word` is
which stop string ended a completion (llama-server's `stopping_word`, Anthropic's
`stop_sequence`).

`status_of` is the one HTTP status of an error, whichever API answers it: the error's own
`http_status` (actord/vocabulary/errors.py), except that a refused file or page name is 400, as
llama-server answers "Invalid filename". An API shapes only its body around that status
(OpenAI's here, Anthropic's in anthropic/stream.py, llama-server's in native/base.py), so a
client that branches on the status (retry on 503, shorten on 400) branches alike on each.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import Response

from actord.vocabulary.errors import ActordError, PathRefused, StorageError
from actord.vocabulary.log import get

if TYPE_CHECKING:
    from actord.service.protocol import Service
from actord.frontends.http.openai import wire as O

log = get("actord.frontends.http")

_enc = msgspec.json.Encoder()


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class ClientGone(Exception):
    """The client hung up before its request was read: nobody to answer."""

    def __init__(self, phase: str) -> None:
        super().__init__(phase)
        self.phase = phase


class Silent(Response):
    """The answer to a client that is gone: nothing."""

    def __init__(self) -> None:
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        return None


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type="application/json")


def status_of(e: HttpError | ActordError) -> int:
    """The HTTP status of `e` on every API (see the module docstring)."""
    if isinstance(e, HttpError):
        return e.status
    if isinstance(e, PathRefused):
        return 400  # llama-server: "Invalid filename"
    return e.http_status if 400 <= e.http_status < 600 else 500


# An absolute path in an error's words: the daemon's folders, which a client never names
# (it names files relative to the page folder) and need not learn.
_ABSOLUTE = re.compile(r"(?<![\w.~])/(?:[^\s/:'\"(),]+/)+(?=[^\s/:'\"(),]+)")


def for_client(e: HttpError | ActordError) -> HttpError | ActordError:
    """`e` as an HTTP client reads it: the daemon's folders left out of its words and
    fields (a page file is named by its name, a disk failure by its operation and the OS's
    reason; a tenant learns nothing of the host's layout). A storage failure is logged
    whole; the socket, the operator's own, answers every error whole."""
    if not isinstance(e, ActordError) or isinstance(e, PathRefused):  # a refused name is the client's own
        return e
    message = _ABSOLUTE.sub("", e.message)
    data = {k: _ABSOLUTE.sub("", v) if isinstance(v, str) else v for k, v in e.data.items()}
    if message == e.message and data == e.data:
        return e
    if isinstance(e, StorageError):
        log.warning("http.storage_failed", error=e.to_dict())
    return type(e)(message, **data)


def error_object(e: HttpError | ActordError, llama: bool = False) -> tuple[int, dict[str, Any]]:
    """OpenAI's error object for `e`, and its status (`llama`: on llama-server's unprefixed
    aliases, a prompt over the context is its `exceed_context_size_error`)."""
    if isinstance(e, ActordError):
        status = status_of(e)
        body = O.error_body(status, O.error_message(e), O.error_code(e), e.data.get("param"))
        if "n_ctx" in e.data and "n_prompt_tokens" in e.data:  # llama-server's two numbers, beside OpenAI's code
            body["error"].update(n_prompt_tokens=e.data["n_prompt_tokens"], n_ctx=e.data["n_ctx"])
            if llama:
                body["error"]["type"] = "exceed_context_size_error"
        return status, body
    return status_of(e), O.error_body(e.status, e.message, e.code, e.param)


def error_response(e: HttpError | ActordError) -> Response:
    status, body = error_object(e)
    return json_response(body, status)


def llama_error_response(e: HttpError | ActordError) -> Response:
    """`error_response` in llama-server's form (its unprefixed aliases of OpenAI's routes)."""
    status, body = error_object(e, llama=True)
    return json_response(body, status)


async def stopping_word(system: "Service", r: Any, stop: list[str]) -> str:
    """The stop string that ended completion `r` ("" when none did). With one asked for, it
    is that one; with several, the generated text goes on past the content with the one that
    matched (its tokens are the result's: one detokenize)."""
    if r.stop_reason != "stop" or not stop:
        return ""
    if len(stop) == 1:
        return stop[0]
    full = await system.detokenize(r.tokens)
    rest = full[len(r.content):] if full.startswith(r.content) else ""
    return next((s for s in sorted(stop, key=len, reverse=True) if rest.startswith(s)), "")


class RouteGroup:
    """A group of routes on one front (`app.HttpFront`): its system and configuration."""

    def __init__(self, front: Any) -> None:
        self.front = front

    @property
    def system(self) -> "Service":
        """The service the routes speak to (actord/service/protocol.py): attached before any
        route is served."""
        return self.front.system

    @property
    def config(self) -> Any:
        return self.front.config
