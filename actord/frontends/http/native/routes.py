"""llama-server's native HTTP API, with the seed's page and gene verbs, on the same front.

A client or tool written for llama-server (or for the seeds' fork of it) talks to actord
unchanged: the routes, request fields, answer shapes and status codes are llama-server's
(tools/server in llama.cpp), and the seed's verbs are added where the fork put them.

Why this module: it is the native API's route table (`Native.routes`, in llama-server's
order), and it holds the routes too small for a module of their own. Each group of routes
lives where its job is:

- `completion.py`: `POST /completion` and `/completions` (llama-server serves both;
  `/v1/completions` is the OpenAI one): its fields, sampling defaults and refusals, prompt
  shapes, and its answer, whole or streamed (no `[DONE]`, the last chunk is the result).
- here: `POST /tokenize` (`content`, `add_special`, `parse_special`, `with_pieces`), `POST
  /detokenize` (`tokens`), `POST /apply-template` (`messages` -> `prompt`); `GET /props`
  (llama-server's shape, `slot_page_version: 1`, `lora_page_version: 1`, and actord's own
  props beside them); `GET /health` (public), `GET /metrics` (actord's registry as it is,
  plus llama-server's `llamacpp:` series, `metrics.py`; 501 with `--no-http-metrics`).
- `slots.py`: `GET /slots`, `POST /slots/{id}?action=save|restore|erase` and the
  seed's `page_out`, `page_in`, `page_drop`, `spill`.
- `genes.py`: `GET /lora-adapters`, `POST /lora-adapters` (global scales: only what
  is set now), and the seed's `POST /lora-adapters/load`, `/unload`, `/page_out`,
  `/page_in`.
- `base.py`: what they all share: llama-server's error object
  (`{"error": {"code": <status>, "message", "type"}}`, actord's typed error beside it in
  `error.actord`), the key guard, JSON bodies, the verbs' typed arguments
  (actord/service/params.py), which each route decodes before it calls the Service verb.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.service.slot_ctx import slot_n_ctx
from actord.vocabulary.errors import InvalidParams
from actord.frontends.http.openai import wire as O
from actord.frontends.http.native.base import NativeRoutes, error_body
from actord.frontends.http.native.completion import CompletionRoutes, generation_defaults
from actord.frontends.http.native.genes import GeneRoutes
from actord.frontends.http.native.metrics import LlamaSeries
from actord.frontends.http.native.slots import SlotRoutes
from actord.frontends.http.responses import HttpError, json_response
from actord.frontends.http.turns import roles_for
from actord.service.params import ApplyTemplateParams, DetokenizeParams, TokenizeParams


class Native(NativeRoutes):
    """The native API's route table: /completion, the slots and the genes from their
    modules, the text verbs, props, health and metrics here."""

    def __init__(self, front: Any) -> None:
        super().__init__(front)
        self.rates = LlamaSeries(front)

    def routes(self) -> list[Route]:
        g = self._guard
        return [
            *CompletionRoutes(self.front).routes(),
            Route("/tokenize", g(self.tokenize), methods=["POST"]),
            Route("/detokenize", g(self.detokenize), methods=["POST"]),
            Route("/apply-template", g(self.apply_template), methods=["POST"]),
            Route("/props", g(self.props), methods=["GET"]),
            *SlotRoutes(self.front).routes(),
            *GeneRoutes(self.front).routes(),
            Route("/health", g(self.health, public=True), methods=["GET"]),
            Route("/v1/health", g(self.health, public=True), methods=["GET"]),
            Route("/metrics", g(self.metrics), methods=["GET"]),
            Route("/cors-proxy", g(self.cors_proxy), methods=["GET", "POST"]),
        ]

    # -- text ------------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        content = obj.get("content")
        if content is None:
            return json_response({"tokens": []})  # llama-server: no content, no tokens
        if isinstance(content, list):  # llama-server tokenizes a mixed list too
            n_max = self.config.request_limits().max_prompt_tokens
            if len(content) > n_max:  # counted before a million entries are converted
                raise InvalidParams(f"content lists {len(content)} entries, at most {n_max}", param="content")
            tokens = await self._mixed(self._convert(content, list[int | str]), "content")
            return json_response({"tokens": tokens})
        p = self._convert({k: obj[k] for k in ("content", "add_special", "parse_special", "with_pieces") if k in obj},
                          TokenizeParams)
        return json_response((await self.system.tokenize(p.content, p.add_special, p.parse_special,
                                                         p.with_pieces)).answer())

    async def detokenize(self, request: Request) -> Response:
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        if "tokens" not in obj:
            return json_response({"content": ""})
        p = self._convert({"tokens": obj["tokens"]}, DetokenizeParams)
        return json_response({"content": await self.system.detokenize(p.tokens)})

    async def apply_template(self, request: Request) -> Response:
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        if "messages" not in obj:
            raise InvalidParams('"messages" is required', param="messages")
        msgs = self._convert(obj["messages"], list[O.Message])
        if not msgs:
            raise InvalidParams("messages is empty", param="messages")
        messages = [msgspec.to_builtins(m) for m in await roles_for(self.front, O.chat_messages(msgs))]
        params: dict[str, Any] = {"messages": messages}
        if "add_generation_prompt" in obj:
            params["add_generation_prompt"] = obj["add_generation_prompt"]
        if obj.get("tools"):  # rendered as a chat with them renders (OpenAI's tools form)
            from actord.frontends.http.openai.tools_wire import tools_from_openai

            params["tools"] = [msgspec.to_builtins(t) for t in tools_from_openai(obj["tools"])]
        kwargs = obj.get("chat_template_kwargs")
        if kwargs is not None:
            if not isinstance(kwargs, dict):
                raise InvalidParams("chat_template_kwargs is an object of template variables",
                                    param="chat_template_kwargs")
            params["template_kwargs"] = kwargs
        p = self._convert(params, ApplyTemplateParams)
        return json_response({"prompt": await self.system.apply_template(p.messages, p.template, p.add_generation_prompt,
                                                                         p.tools, p.template_kwargs)})

    # -- props -----------------------------------------------------------------------------

    async def props(self, request: Request) -> Response:
        system, config = self.system, self.config
        actord = await system.props_dict()
        tpl = await system.chat_template()
        n_ctx = slot_n_ctx(config, system.model_props().n_ctx)  # a slot's (actord/service/slot_ctx.py)
        out = {
            **actord,
            "default_generation_settings": {
                "id": 0, "id_task": -1, "n_ctx": n_ctx, "speculative": False,
                "is_processing": False, "params": generation_defaults(config, n_ctx),
            },
            "total_slots": actord["n_slots"],
            "model_alias": self.front.model_id,
            "model_path": config.model,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
            "chat_template": tpl.template or "",
            "chat_template_caps": {},
            "bos_token": tpl.bos_token, "eos_token": tpl.eos_token,
            "build_info": f"actord {self.front.version}",
            "is_sleeping": system.asleep,
            "slot_page_version": 1, "lora_page_version": 1,
            "cors_proxy_enabled": False,  # llama-server's web UI reads it: no /cors-proxy here
        }
        return json_response(out)

    async def cors_proxy(self, request: Request) -> Response:
        """llama-server's answer with its proxy off (`--ui-mcp-proxy` unset), which is how
        actord always runs: a generic HTTP proxy is not a serving engine's job, and a
        client (its web UI) that probes the route reads 403 as "off", not 404 as "old"."""
        raise HttpError(403, "this server runs no CORS proxy (llama-server's --ui-mcp-proxy)", "forbidden")

    # -- health, metrics -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.front.system is None:
            return json_response(error_body(503, "Loading model"), 503)
        h = await self.system.health()
        if self.system.closing:
            return json_response({**error_body(503, "shutting down"), **h, "status": "shutting_down"}, 503)
        if h["status"] != "ok":
            why = f"actors failed: {', '.join(h['failed_actors'])}"
            return json_response({**error_body(503, why), **h}, 503)
        return json_response(h)

    async def metrics(self, request: Request) -> Response:
        if not self.config.http_metrics:  # llama-server without --metrics
            raise HttpError(501, "This server does not support metrics endpoint. Start it with `--http-metrics`",
                            "not_supported")
        text = self.system.metrics_text() + self.rates.series()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8",
                        headers={"process-start-time-unix": str(int(self.front.created))})
