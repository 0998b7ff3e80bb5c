"""Browsers at the HTTP front: which origins it serves, and llama-server's CORS answers.

Why a module of its own: a browser page (a request with an `Origin` header) is treated as
llama-server treats it, so the browser UIs built on it connect unchanged, and that is two
ASGI layers outside every route (app.py installs them): `OriginGate` refuses (403) an
origin `--cors-origin` does not list (none listed: any is served, llama-server's default;
the keyword `localhost`: any local origin, http(s)://localhost, 127.0.0.1 or [::1] on any
port); `Cors` reflects an allowed origin in Access-Control-Allow-Origin with credentials
allowed, and answers every OPTIONS request at once (200, before the key: a browser's
preflight carries none) with llama-server's headers: Allow-Methods "GET, POST, DELETE,
OPTIONS", Allow-Headers `--cors-headers` ("*"). Starlette's CORSMiddleware answers a
refused preflight 400 and echoes the requested headers instead. A browser's answer also
carries Access-Control-Expose-Headers naming `X-Actord-Degraded` (degraded.py): without it a
page's script cannot read what its request was answered without.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Protocol

from actord.frontends.http.degraded import HEADER as DEGRADED
from actord.frontends.http.openai import wire as O
from actord.frontends.http.responses import json_response
from actord.vocabulary.config import Config, split_names
from actord.vocabulary.log import get

log = get("actord.frontends.http")


class GateHost(Protocol):
    """What a gate is given of the front (app.py `HttpFront`): its configuration, and where a
    refusal is counted."""

    config: Config

    def refused(self, reason: str) -> None: ...


# A browser's script reads only the headers an answer exposes (besides the CORS-safelisted ones).
EXPOSE = (b"access-control-expose-headers", DEGRADED.title().encode("latin-1"))

_LOCAL_ORIGIN = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?")


def origin_allowed(origin: str, allowed: frozenset[str]) -> bool:
    """Whether a browser page from `origin` may use the front: `allowed` is `--cors-origin`'s
    list (empty or with "*": any origin, llama-server's default; "localhost": any local one)."""
    if not allowed or "*" in allowed or origin in allowed:
        return True
    return "localhost" in allowed and _LOCAL_ORIGIN.fullmatch(origin) is not None


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a request naming `host` (its Host header, port and all) may be served by a
    front without a key: an IP address (never a rebinding: that needs a name the attacker's
    DNS answers), localhost and its subdomains (browsers resolve them to loopback
    themselves), or a name `allowed` (`--http-host`; "*": any) lists."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    if not name:
        return False
    if "*" in allowed or name in allowed or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostGate:
    """Without an API key, refuses (403) a request whose Host is not the front's own
    (`host_allowed`): a page whose name its DNS points at 127.0.0.1 (DNS rebinding) is then
    same-origin with the daemon, so no origin check can stop it; its Host header still
    names it, as llama-server's and Jupyter's checks read it. With a key the key decides."""

    def __init__(self, app: Any, front: GateHost) -> None:
        self.app, self.front = app, front
        self.allowed = frozenset(n.strip().lower().rstrip(".") for n in split_names(front.config.http_host))
        self.on = not front.config.api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.on and scope["type"] == "http":
            host = next((v for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and not host_allowed(host.decode("latin-1"), self.allowed):
                self.front.refused("host")
                log.info("http.host_refused", host=host.decode("latin-1")[:200])
                response = json_response(O.error_body(
                    403, "this Host is not the daemon's own (see --http-host, or set --api-key)",
                    "host_not_allowed"), 403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OriginGate:
    """Refuses browser requests from origins `--cors-origin` does not allow (see the module
    docstring); non-browser clients send no Origin header and pass."""

    def __init__(self, app: Any, front: GateHost) -> None:
        self.app, self.front = app, front
        self.allowed = frozenset(front.config.cors_origin)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.allowed and "*" not in self.allowed:
            origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
            if origin is not None and not origin_allowed(origin.decode("latin-1"), self.allowed):
                self.front.refused("origin")
                log.info("http.origin_refused", origin=origin.decode("latin-1")[:200])
                response = json_response(O.error_body(
                    403, "requests from this origin are not allowed (see --cors-origin)", "origin_not_allowed"), 403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Cors:
    """llama-server's CORS answers (the module docstring); the origin was checked by
    `OriginGate` before."""

    def __init__(self, app: Any, front: GateHost) -> None:
        self.app = app
        self.preflight = [(b"access-control-allow-credentials", b"true"),
                          (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                          (b"access-control-allow-headers", front.config.cors_headers.encode("latin-1")),
                          (b"access-control-max-age", b"600")]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
        extra = [] if origin is None else [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*extra, *self.preflight, (b"content-type", b"text/html"),
                                    (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if origin is not None:
            extra += [(b"access-control-allow-credentials", b"true"), EXPOSE]

        async def send_cors(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_cors if extra else send)
