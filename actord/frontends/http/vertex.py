"""Google Vertex AI's prediction protocol, for a daemon Vertex runs as a custom container.

Why: Vertex sends every prediction to one route, `POST AIP_PREDICT_ROUTE` with
`{"instances": [...]}`, and expects `{"predictions": [...]}` in the same order; each
instance here names the route it is for by `@requestFormat`, as llama-server's does: a
route's path in camelCase ("chatCompletions" for /v1/chat/completions, a leading /v1
dropped, the first route of a name winning) or the path itself. The variables Vertex sets
are read once, into `Config` (`aip_*`); with `AIP_MODE=PREDICTION` the front adds these
routes (and listens on AIP_HTTP_PORT, app.py).

How: each instance, its `@requestFormat` removed and `stream` forced off, is served by
the front's own router as a request of its own, with the caller's headers (so the key and
every route's checks hold), all at once; an instance's answer is the route's JSON, an error
object included. A bad instance gets llama-server's `{"error": {...}}` in its place; a bad
body, a 400 for the whole.
"""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.frontends.http.native.base import NativeRoutes, error_body
from actord.frontends.http.responses import HttpError, json_response
from actord.vocabulary.errors import InvalidParams

MAX_INSTANCES = 128  # llama-server's bound on one prediction request


def request_format(path: str) -> str:
    """`/v1/chat/completions` -> `chatCompletions`, `/apply-template` -> `applyTemplate`."""
    s = path[3:] if path.startswith("/v1") and len(path) > 3 else path
    out, cap = [], False
    for c in s.lstrip("/"):
        if c in "{:":
            break
        if c in "/-_":
            cap = True
        else:
            out.append(c.upper() if cap else c)
            cap = False
    return "".join(out)


class Vertex(NativeRoutes):
    """The prediction route (and the health route where AIP_HEALTH_ROUTE names one)."""

    def routes(self) -> list[Route]:
        c = self.config
        if not c.vertex:
            return []
        routes = [Route(c.aip_predict_route, self._guard(self.predict), methods=["POST"])]
        if c.aip_health_route:
            from actord.frontends.http.native.routes import Native

            routes.append(Route(c.aip_health_route, self._guard(Native(self.front).health, public=True),
                                methods=["GET"]))
        return routes

    def formats(self) -> dict[str, str]:
        """`@requestFormat` -> path, for every POST route without path parameters."""
        out: dict[str, str] = {}
        for r in self.front.app.routes:
            path = getattr(r, "path", "")
            if "POST" in (getattr(r, "methods", None) or ()) and "{" not in path \
                    and path != self.config.aip_predict_route:
                out.setdefault(request_format(path), path)
                out.setdefault(path, path)
        return out

    async def predict(self, request: Request) -> Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            raise InvalidParams("request body must be a JSON object")
        instances = body.get("instances")
        if not isinstance(instances, list):
            raise InvalidParams("request body must include an array field named instances")
        if len(instances) > MAX_INSTANCES:
            raise HttpError(400, f"instances array exceeds maximum size of {MAX_INSTANCES}", "invalid_request")
        formats = self.formats()
        out: list[Any] = [None] * len(instances)

        async def one(i: int, instance: Any) -> None:
            out[i] = await self._one(request, formats, instance)

        async with anyio.create_task_group() as tg:
            for i, instance in enumerate(instances):
                tg.start_soon(one, i, instance)
        return json_response({"predictions": out})

    async def _one(self, request: Request, formats: dict[str, str], instance: Any) -> Any:
        if not isinstance(instance, dict):
            return error_body(400, "each instance must be a JSON object")
        fmt = instance.get("@requestFormat")
        if not isinstance(fmt, str):
            return error_body(400, "each instance must include a string @requestFormat")
        path = formats.get(fmt)
        if path is None:
            return error_body(400, f"no handler registered for @requestFormat: {fmt[:200]}")
        payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
        if "stream" in payload:
            payload["stream"] = False  # one answer per instance: no streams here
        return await self._serve(request, path, msgspec.json.encode(payload))

    async def _serve(self, request: Request, path: str, data: bytes) -> Any:
        """`data` POSTed to `path` through the front's router, as a request of its own."""
        headers = [(k, v) for k, v in request.scope["headers"] if k not in (b"content-length", b"transfer-encoding")]
        scope = {**request.scope, "path": path, "raw_path": path.encode(), "query_string": b"", "method": "POST",
                 "headers": [*headers, (b"content-length", str(len(data)).encode())]}
        scope.pop("router", None)
        scope.pop("endpoint", None)
        scope.pop("path_params", None)
        sent = False
        status, parts = 500, []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await request.receive()  # the caller's own disconnect, if it comes

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        await self.front.app.router(scope, receive, send)
        raw = b"".join(parts)
        if not raw:
            return None if status < 400 else error_body(status, "no answer")
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return raw.decode("utf-8", "replace")
