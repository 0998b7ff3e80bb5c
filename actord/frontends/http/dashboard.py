"""The dashboard (`GET /dashboard`): one page that shows the daemon's memory, live.

Why it exists: which slot holds which mind, which minds wait in RAM pages and which in page
files, how full the page ceiling, the checkpoint budget and the device budget are, and
which genes are resident were only in JSON verbs and Prometheus counters. llama-server
ships a chat page; no serving engine we know of draws its memory tiers.

How: the page (`dashboard.html`, package data) is static, has no data in it and loads
nothing from elsewhere (no CDN, no build step: its script is inline, its plots are drawn on
canvases by that script). It polls `GET /dashboard/state` every second, a JSON answer built
from the Service's `memory` verb (service/introspection.py), the same actors `slot.list`,
`page.list` and the stats verbs ask, without recording the reads for traces. Polling rather
than server-sent events: an `EventSource` cannot send `Authorization`, and the state route
is held to the API key like every other route.

Where: at `/` too, where llama-server serves its web UI, so a browser pointed at the
daemon's address lands on it; `--no-http-ui` takes the page and its assets away (404), as
llama-server's --no-ui. The assets are llama-server's UI names, public as its are: the
page's manifest (`/manifest.webmanifest`: the dashboard installs as an app), the build's
version (`/_app/version.json`, which an open llama-server UI tab polls to learn of a new
build), and `/sw.js`, a service worker that unregisters itself: a browser that ran
llama-server's UI at this address keeps its worker, which would go on serving that UI from
its cache, until a fetch of /sw.js brings a new one (a 404 leaves the old in place).

Who may see it: the state route stands behind the front's guard (the key, or without one
the peer rules checked when the connection opened, bounds.py). The page itself is the same
for everyone and holds nothing, so it is served like /health; its script takes the key from
the address's fragment (`/dashboard#key=KEY`: a fragment never reaches the server or its
logs) or a field, keeps it for the tab (sessionStorage), and says "refused" when the state
route refuses it. The page's Content-Security-Policy lets it reach its own origin only.

A mind the front named through a digest (`user`, `prompt_cache_key`, a session header:
`u-<digest>`) shows the name the client gave as its label (`MindLabels`: kept in this
process, for the key holder's eyes only, bounded). Pages on a shared prefix are grouped by
the base they stand on, which holds its bytes once for all of them.

The rates (tokens/s, first-token latency, prompt tokens processed vs cached) are the
counters' differences between polls, kept here for `HISTORY_S` so a reload keeps its plots;
nothing is sampled while no page polls. "Last use" is when this front last saw the mind
change (moved, grew, or its slot at work), or a page file's last write.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from importlib.resources import files
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.frontends.http.responses import json_response
from actord.vocabulary.config import Config

if TYPE_CHECKING:
    from actord.service.protocol import MemoryView, Service

HISTORY_S = 600.0  # the plots' span: ten minutes
MIN_INTERVAL_S = 0.5  # polls closer than this (two tabs) share one read of the system
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src data:; manifest-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
# A worker whose only act is to remove itself (and any other this origin registered).
SW_JS = b"""self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (e) => e.waitUntil(self.registration.unregister()));
"""


class MindLabels:
    """The names clients gave the minds the front named through a digest: digest name ->
    (where it came from, the name as given). The newest MAX_LABELS are kept, in memory
    only: a label is a client's own string, shown only to the dashboard's key holder."""

    MAX_LABELS = 4096
    MAX_CHARS = 200

    def __init__(self) -> None:
        self.by_mind: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def note(self, mind: str, source: str, given: str) -> None:
        self.by_mind[mind] = (source, given[: self.MAX_CHARS])
        self.by_mind.move_to_end(mind)
        while len(self.by_mind) > self.MAX_LABELS:
            self.by_mind.popitem(last=False)

    def get(self, mind: str) -> dict[str, str] | None:
        got = self.by_mind.get(mind)
        return {"from": got[0], "label": got[1]} if got is not None else None


def page_html() -> bytes:
    return files("actord.frontends.http").joinpath("dashboard.html").read_bytes()


class DashboardHost(Protocol):
    """What the dashboard is given of the front (app.py `HttpFront`)."""

    config: Config
    version: str
    model_id: str
    service: "Service"
    mind_labels: MindLabels

    def guard(self, endpoint: Callable[[Request], Awaitable[Response]], *, public: bool = False
              ) -> Callable[[Request], Awaitable[Response]]: ...


class Dashboard:
    def __init__(self, front: DashboardHost) -> None:
        self.front = front
        self.samples: deque[tuple[float, dict[str, float]]] = deque()
        self.seen: dict[tuple[str, str], tuple[Any, float]] = {}  # (name, tier) -> (what it was, since)
        self.last: tuple[float, dict[str, Any]] | None = None
        self._html: bytes | None = None

    def routes(self) -> list[Route]:
        f = self.front
        state = [Route("/dashboard/state", f.guard(self.state), methods=["GET"])]
        if not f.config.http_ui:
            return state
        return [Route("/", f.guard(self.page, public=True), methods=["GET"]),
                Route("/dashboard", f.guard(self.page, public=True), methods=["GET"]),
                Route("/manifest.webmanifest", f.guard(self.manifest, public=True), methods=["GET"]),
                Route("/_app/version.json", f.guard(self.version, public=True), methods=["GET"]),
                Route("/sw.js", f.guard(self.worker, public=True), methods=["GET"]),
                *state]

    async def manifest(self, request: Request) -> Response:
        body = msgspec.json.encode({"name": "actord dashboard", "short_name": "actord", "start_url": "/",
                                    "display": "standalone", "background_color": "#ffffff"})
        return Response(body, media_type="application/manifest+json")

    async def version(self, request: Request) -> Response:
        return json_response({"version": self.front.version})

    async def worker(self, request: Request) -> Response:
        return Response(SW_JS, media_type="text/javascript", headers={"cache-control": "no-cache"})

    async def page(self, request: Request) -> Response:
        if self._html is None:
            self._html = page_html()
        return Response(self._html, media_type="text/html; charset=utf-8", headers={
            "content-security-policy": CSP, "x-content-type-options": "nosniff", "cache-control": "no-store",
            "referrer-policy": "no-referrer"})

    async def state(self, request: Request) -> Response:
        """The page's JSON; `?after=NAME&limit=N` pages the minds by name (the answer's
        `next` is the following page's cursor), so 10,000 minds answer a page at a time."""
        q = request.query_params
        if "after" in q or "limit" in q:
            after, limit = q.get("after", ""), q.get("limit", "0")
            if not limit.isdigit() or len(after) > 512:
                return json_response({"error": {"message": "limit is a count >= 0, after a mind name",
                                                "type": "invalid_request_error"}}, 400)
            view = await self.front.service.memory(after, int(limit))
            return json_response({**self.shape(view, time.monotonic()), "next": view.next}, 200)
        now = time.monotonic()
        if self.last is None or now - self.last[0] >= MIN_INTERVAL_S:
            self.last = (now, self.shape(await self.front.service.memory(), now))
        return json_response(self.last[1], 200)

    def shape(self, view: "MemoryView", now: float) -> dict[str, Any]:
        """The page's JSON: the view, each mind's last use, and the rates over the history."""
        self.samples.append((now, view.counters))
        while self.samples and now - self.samples[0][0] > HISTORY_S:
            self.samples.popleft()
        busy = {s.id for s in view.slots if s.state != "idle"}
        minds = []
        present = set()
        for m in view.minds:
            key = (m.name, m.tier)
            present.add(key)
            what = (m.slot, m.n_tokens, m.n_bytes, m.mtime)
            before = self.seen.get(key)
            if before is None or before[0] != what or m.slot in busy:
                since = m.mtime if m.mtime is not None and before is None else view.time
                self.seen[key] = (what, since)
            minds.append({**msgspec.to_builtins(m), "last_use": self.seen[key][1],
                          **(self.front.mind_labels.get(m.name) or {})})
        for key in set(self.seen) - present:
            del self.seen[key]
        bases: dict[int, dict[str, Any]] = {}
        for m in view.minds:
            if m.base is not None:
                b = bases.setdefault(m.base, {"base": m.base, "n_tokens": m.n_base, "n_bytes": m.base_bytes,
                                              "pages": []})
                b["pages"].append(m.name)
        return {
            "time": view.time, "model": self.front.model_id,
            "slots": msgspec.to_builtins(view.slots), "minds": minds,
            "budgets": msgspec.to_builtins(view.budgets), "genes": view.genes, "bases": list(bases.values()),
            "series": series(list(self.samples)),
        }


def series(samples: list[tuple[float, dict[str, float]]]) -> list[dict[str, Any]]:
    """Per interval between two samples: tokens/s generated, the mean first-token latency
    of the completions answered in it (None: none were), prompt tokens processed and
    cached (received but not processed: served from a slot, a page or a checkpoint)."""
    out = []
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        dt = t1 - t0
        if dt <= 0:
            continue
        d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}
        n = d.get("first_token_seconds_count", 0.0)
        processed = max(0.0, d.get("prompt_tokens_processed_total", 0.0))
        out.append({
            "t": t1 - samples[-1][0],  # seconds before the newest sample (<= 0)
            "tokens_per_s": max(0.0, d.get("predicted_tokens_total", 0.0)) / dt,
            "first_token_ms": d.get("first_token_seconds_sum", 0.0) / n * 1e3 if n > 0 else None,
            "prompt_processed": processed,
            "prompt_cached": max(0.0, d.get("prompt_tokens_cached_total", 0.0)),
        })
    return out
