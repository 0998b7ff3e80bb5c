"""POST /v1/embeddings (and /embeddings), where the model pools (actord/engine/embed.py).

`input`: a string, a list of strings, a token list, or a list of token lists (at most
MAX_INPUTS); `encoding_format` float or base64 (little-endian float32, what the openai SDK
asks for and decodes); `model` any name, echoed; `user` ignored (no mind: embeddings keep no
state). `dimensions` is refused with a 400 naming it (the vectors are the model's, whole).
A model that does not pool (a generative one, whose GGUF names no pooling type) is a 400
naming `model`: actord runs one model, and does not load a second for embeddings.
Vectors are L2-normalized, as OpenAI's are.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.vocabulary.errors import InvalidParams
from actord.frontends.http.openai.routes import decode_body
from actord.frontends.http.responses import RouteGroup, json_response

MAX_INPUTS = 256


class EmbeddingsRequest(msgspec.Struct, kw_only=True, frozen=True):
    input: Any = None
    model: str | None = None
    encoding_format: str = "float"
    dimensions: Any = None
    user: str | None = None


def _inputs(v: Any) -> list[str | list[int]]:
    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(v, str):
        items: list[Any] = [v]
    elif ids(v):
        items = [v]
    elif isinstance(v, list) and v and all(isinstance(x, str) or ids(x) for x in v):
        items = v
    else:
        raise InvalidParams("input is a string, a list of strings, a token list or a list of token lists",
                            param="input")
    if len(items) > MAX_INPUTS:
        raise InvalidParams(f"{len(items)} inputs, at most {MAX_INPUTS}", param="input")
    if any(x == "" for x in items):
        raise InvalidParams("an input is empty", param="input")
    return items


class Embeddings(RouteGroup):
    def routes(self) -> list[Route]:
        g = self.front.guard(self.create)
        return [Route(p, g, methods=["POST"]) for p in ("/v1/embeddings", "/embeddings")]

    async def create(self, request: Request) -> Response:
        front = self.front
        req: EmbeddingsRequest = await decode_body(front, request, EmbeddingsRequest)
        if req.dimensions is not None:
            raise InvalidParams("unsupported parameter 'dimensions': the vectors are the model's, whole",
                                param="dimensions")
        if req.encoding_format not in ("float", "base64"):
            raise InvalidParams("encoding_format is float or base64", param="encoding_format")
        system = self.system
        if system.model_props().pooling not in (1, 2, 3):
            raise InvalidParams("this model cannot embed: it names no pooling type (a generative model), and "
                                "actord serves one model in one generative context; serve an embedding model "
                                "(a GGUF with a pooling type) for /v1/embeddings", param="model")
        items = _inputs(req.input)
        limit = system.request_limits().max_prompt_bytes
        if sum(len(x.encode()) if isinstance(x, str) else 4 * len(x) for x in items) > limit:
            raise InvalidParams(f"the inputs are over {limit} bytes", param="input")
        out = await system.embed(items)
        data = []
        for i, v in enumerate(out.vectors):
            emb: Any = v if req.encoding_format == "float" else \
                base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = out.n_tokens
        return json_response({"object": "list", "data": data, "model": req.model or front.model_id,
                                "usage": {"prompt_tokens": n, "total_tokens": n}})
