"""What every route of llama-server's native API shares: its error object and a base
class for the route groups (`NativeRoutes`).

Why a module of its own: the route groups (`completion.py`, `slots.py`, `genes.py`, and
`routes.py`'s text, props, health and metrics routes) each need the
same guard (the key, llama-server's error object for a typed error), JSON bodies (an empty
body is `{}`), the JSON-RPC verbs the routes call with those verbs' own parameter checks,
and llama-server's mixed prompts (token ids with strings); none should import another for
them.

Errors are llama-server's object, `{"error": {"code": <status>, "message", "type"}}`, with
actord's typed error beside it (`error.actord`). The status is every API's
(`responses.status_of`: the error's own `http_status`, 404 unknown page, slot or gene; 503
over the page ceiling or device budget; 400 an empty slot or a refused file name; 409 a
gene in use).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actord.vocabulary.errors import ActordError, InvalidParams, PromptTooLong
from actord.frontends.http.responses import HttpError, RouteGroup, json_response, status_of
from actord.service.params import decode

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, kind: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": status, "message": message, "type": kind or error_type(status), **extra}}


def error_object(e: HttpError | ActordError) -> tuple[int, dict[str, Any]]:
    if isinstance(e, ActordError):
        status = status_of(e)
        extra: dict[str, Any] = {"actord": e.to_dict()}
        kind = None
        if isinstance(e, PromptTooLong) and "n_ctx" in e.data and "n_prompt_tokens" in e.data:
            kind = "exceed_context_size_error"  # llama-server's, with its two numbers
            extra.update(n_prompt_tokens=e.data["n_prompt_tokens"], n_ctx=e.data["n_ctx"])
        return status, error_body(status, e.message, kind, **extra)
    named = {"param": e.param} if e.param else {}
    return status_of(e), error_body(e.status, e.message, actord={"type": e.code, "message": e.message, **named})


def error_response(e: HttpError | ActordError) -> Response:
    status, body = error_object(e)
    return json_response(body, status)


def unsupported(field: str, why: str) -> InvalidParams:
    return InvalidParams(f"unsupported parameter '{field}': {why}", param=field)


def is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


MAX_MIXED_TEXTS = 256  # strings in one mixed prompt list (`_mixed`)


class LoraRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """llama-server's `{id, scale}` of an adapter (a gene)."""

    id: int
    scale: float = 1.0


class NativeRoutes(RouteGroup):
    """A group of native routes on one front (see the module docstring)."""

    def _guard(self, endpoint: Callable[[Request], Awaitable[Response]], *,
               public: bool = False, generates: bool = False) -> Callable[[Request], Awaitable[Response]]:
        return self.front.guard(endpoint, errors=error_response, public=public, generates=generates)

    async def _json(self, request: Request) -> Any:
        """The body as JSON (an empty body is `{}`: llama-server's erase sends none)."""
        return await self.front.decode_json(request)

    async def _decode(self, request: Request, typ: type) -> Any:
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        return self._convert(obj, typ)

    @staticmethod
    def _convert(obj: Any, typ: type) -> Any:
        """`obj` as `typ` (a verb's arguments: actord/service/params.py); a 400 names what is wrong."""
        return decode(obj, typ)

    async def _tokens(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        """`text` tokenized by the Service's `tokenize` verb (recorded for traces)."""
        return (await self.system.tokenize(text, add_special, parse_special)).tokens

    async def _default_genes(self) -> set[int]:
        return self.system.default_gene_ids()

    async def _mixed(self, prompt: list[int | str], field: str = "prompt") -> list[int]:
        """Token ids mixed with strings: each string tokenized in place; a leading string
        gets the model's BOS (llama-server's tokenize_mixed). Its cost is counted first: at
        most MAX_MIXED_TEXTS strings (each one engine job: a million of them ran 329 s) of a
        prompt's bytes together, else a 400 naming `field` (the tokens are counted after,
        as a prompt's are)."""
        limits = self.config.request_limits()
        texts = [x for x in prompt if isinstance(x, str)]
        if not texts:
            return list(prompt)  # type: ignore[arg-type]
        n_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if len(texts) > MAX_MIXED_TEXTS or n_bytes > limits.max_prompt_bytes:
            raise InvalidParams(f"{field} lists {len(texts)} strings of {n_bytes} bytes, at most {MAX_MIXED_TEXTS} "
                                f"of {limits.max_prompt_bytes} bytes together", param=field)
        out: list[int] = []
        for i, x in enumerate(prompt):
            if isinstance(x, str):
                out += await self._tokens(x, add_special=i == 0)
            else:
                out.append(x)
        return out
