"""llama-server's /lora-adapters on actord's genes, with the seed's gene verbs.

Why a module of its own: adapters are actord's genes (actord.serving.gene_residency), whose
residency the seed's verbs move; these routes are their native face, and nothing else of
the native API needs them.

Routes: `GET /lora-adapters` (each gene with llama-server's fields, `resident` and
`n_bytes`), `POST /lora-adapters` (global scales), and the seed's `POST
/lora-adapters/load {path}`, `/unload {id}`, `/page_out {id}`, `/page_in {id}`.

A choice where llama-server and actord differ, stated: `POST /lora-adapters` answers only
a request that sets what is set now (the `--gene` adapters at 1, others at 0): actord's
global genes are fixed at start (501 otherwise). A request's own `lora` list is honoured
(native_completion).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.vocabulary.errors import InvalidParams
from actord.service.params import GeneIdParams, GenePathParams
from actord.frontends.http.native.base import LoraRef, NativeRoutes
from actord.frontends.http.responses import HttpError, json_response


class GeneRoutes(NativeRoutes):
    def routes(self) -> list[Route]:
        g = self._guard
        return [Route("/lora-adapters", g(self.lora_adapters), methods=["GET"]),
                Route("/lora-adapters", g(self.lora_scales), methods=["POST"]),
                Route("/lora-adapters/{verb}", g(self.lora_verb), methods=["POST"])]

    async def _genes(self) -> list[dict[str, Any]]:
        defaults = await self._default_genes()
        return [{"id": g["id"], "path": g["path"], "scale": 1.0 if g["id"] in defaults else 0.0,
                 "task_name": "", "prompt_prefix": "", "resident": g["resident"], "n_bytes": g["n_bytes"],
                 "default": g["id"] in defaults} for g in msgspec.to_builtins(await self.system.gene_list())]

    async def lora_adapters(self, request: Request) -> Response:
        return json_response(await self._genes())

    async def lora_scales(self, request: Request) -> Response:
        obj = await self._json(request)
        if not isinstance(obj, list):
            raise InvalidParams("Request body must be an array")
        want = {g.id: g.scale for g in self._convert(obj, list[LoraRef])}
        now = {g["id"]: g["scale"] for g in await self._genes()}
        unknown = sorted(set(want) - set(now))
        if unknown:
            raise InvalidParams(f"no adapter {unknown[0]}", param="id")
        if any(want.get(gid, 0.0) != scale for gid, scale in now.items()):
            raise HttpError(501, "global adapter scales are fixed at start (the --gene adapters at 1, the "
                                   "others at 0): set a request's own with its \"lora\" field", "not_supported")
        return json_response({"success": True})

    async def lora_verb(self, request: Request) -> Response:
        verb = request.path_params["verb"]
        if verb not in ("load", "unload", "page_out", "page_in"):
            raise HttpError(404, f"no route POST /lora-adapters/{verb[:64]} (load, unload, page_out, page_in)",
                              "not_found")
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        system = self.system
        if verb == "load":
            if "path" not in obj:
                raise InvalidParams('"path" is required', param="path")
            p = self._convert({"path": obj["path"]}, GenePathParams)
            r = await system.gene_load(p.path, default=p.default)
        else:
            if "id" not in obj:
                raise InvalidParams('"id" is required', param="id")
            g = self._convert({"id": obj["id"]}, GeneIdParams)
            r = await {"unload": system.gene_unload, "page_out": system.gene_page_out,
                       "page_in": system.gene_page_in}[verb](g.id)
        r = msgspec.to_builtins(r)
        return json_response({"success": True, **r} if verb == "unload" else r)
