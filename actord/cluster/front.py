"""The OpenAI HTTP front served at the router (`actord cluster up --http HOST:PORT`), so a
client does not know whether it speaks to one node or many.

Why this shape: the single-node front (actord/frontends/http/app.py, `HttpFront`) is written
against the `Service` protocol (actord/service/protocol.py): `model_props()`, `chat_info()`,
`chat(...)`, `complete(...)`, `complete_n(...)`, `health()`. `ClusterFront` implements that
part for the cluster, over the router in the same process (the router's Ray actor, where its
JSON-RPC socket runs too), so every route, check, answer shape, error object and
streaming rule is the single node's own code, not a copy of it. Rejected: a front that
proxies HTTP to the nodes' own fronts (a second hop, and the router would have to parse
each request anyway to find its mind); a front in the keeper process talking to the
router over Ray (every streamed chunk would cross a second process).

- Minds: a request's mind comes from where the single-node front takes it (the
  `X-Actord-Mind` header, else `prompt_cache_key`, else `user`, through `http/turns.py mind_for`;
  the Responses API adds its conversation's mind), and its turn is the router's
  (`MindRouter.turn`): placed on its first turn, on its directory node after, exactly once
  per turn id, moved with its pages. A request that names no mind is run on the least
  loaded node and placed there as one daemon places it (`MindRouter.free_turn`), not given
  a generated mind: such a mind would never be named again, and the directory and its
  node would hold its state for nothing; a client that wants its cache kept names it,
  as on one daemon.
- Chats are rendered on the node (`Turn.kind` "chat": the node's `system.chat`), where the
  model's template and the node's turn memory are, so a mind's second turn reuses its first
  exactly as on one daemon (`cached_tokens`).
- Streaming: each chunk the node generates is relayed as it comes (Ray's streaming
  generator, then the router's sink, then the response's outbox); a client that hangs up
  cancels the node's work (`ray.cancel`).
- Errors: the nodes' and the router's typed errors cross Ray as themselves (`Answer`), so
  each gets the single-node status and error object.
- Not served, refused with a typed error and never a crash: `n` > 1 (400 naming `n`: n
  choices share one prefill in one slot, and a mind's turn is one reply), and, 501
  `NotServed`, the embeddings route and llama-server's native API (slots, genes, pages,
  tokenize, /completion, /props, /metrics): those are one node's, reached at that node's
  daemon. /health answers for the cluster.
- The Responses API's stored conversations live in this process (as they live in one
  daemon's): a restarted router has forgotten them (`previous_response_id` answers 400).
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.vocabulary.types import CompletionRequest, CompletionResult
from actord.chat.messages import ChatRequest, ChatResult
from actord.vocabulary.errors import InvalidParams, NotServed
from actord.vocabulary.metrics import Metrics
from actord.frontends.http.native import base as native_base
from actord.frontends.http.app import HttpFront
from actord.service import tenancy
from actord.frontends.http.openai.embeddings import Embeddings
from actord.frontends.http.native.routes import Native
from actord.frontends.http.openai.routes import OpenAIRoutes
from actord.frontends.http.openai.responses_api import Responses

OnToken = Callable[[Any], None] | None

HEALTH = ("/health", "/v1/health")


def _fields(request: Any) -> dict[str, Any]:
    """A request's fields for a turn: no mind (the turn names it) and no slot (the cluster
    places minds, not slots)."""
    out = msgspec.to_builtins(request)
    out.pop("mind", None)
    out.pop("slot", None)
    return out


def _one_choice() -> InvalidParams:
    return InvalidParams("unsupported parameter 'n': the cluster answers one choice per request (n choices share "
                         "one prefill in one slot; ask again for another sample)", param="n")


class ClusterFront:
    """What `HttpFront` calls on its system, served by the router's turns (see the module
    docstring). `info` is the router's `model_info()`: the model's props and chat info."""

    def __init__(self, router: Any, info: dict[str, Any]) -> None:
        self.router = router
        self._props = info["props"]
        self._chat_info = info["chat"]
        self.closing = False
        self.metrics = Metrics()  # the front's own connection and refusal counts

    def model_props(self) -> Any:
        return self._props

    async def chat_info(self) -> Any:
        return self._chat_info

    async def _turn(self, kind: str, mind: str | None, request: Any, on_token: OnToken) -> dict[str, Any]:
        # The key's tenant travels in the request's fields: the node scopes reuse by it.
        fields = _fields(tenancy.stamp(request))
        if mind is None:
            out = await self.router.free_turn(fields, on_token, kind=kind)
        else:
            out = await self.router.turn(mind, fields, None, on_token, kind=kind)
        return out.result

    async def chat(self, request: ChatRequest, *, on_token: OnToken = None, n: int = 1) -> ChatResult:
        if n != 1:
            raise _one_choice()
        return msgspec.convert(await self._turn("chat", request.mind, request, on_token), ChatResult)

    async def complete(self, request: CompletionRequest, *, on_token: OnToken = None) -> CompletionResult:
        return msgspec.convert(await self._turn("completion", request.mind, request, on_token), CompletionResult)

    async def complete_n(self, request: CompletionRequest, n: int, *, on_token: OnToken = None) -> Any:
        raise _one_choice()

    async def health(self) -> dict[str, Any]:
        """/health: ok while a node is live (the router re-homes a lost node's minds)."""
        st = self.router.dir.state
        live = [n for n in st.nodes if n not in st.lost]
        return {"status": "ok" if live else "no_live_node", "router": self.router.incarnation,
                "nodes": len(st.nodes), "live_nodes": len(live), "minds": len(st.minds),
                "failed_actors": [] if live else [f"node {n}" for n in st.nodes]}


class ClusterHttpFront(HttpFront):
    """The single-node front with the cluster's route table: the OpenAI routes and the
    Responses API as they are, /health for the cluster, every other route 501."""

    def routes(self) -> list[Route]:
        served = [*OpenAIRoutes(self).routes(), *Responses(self).routes()]
        refused = [self._refusal(r, self.guard) for r in Embeddings(self).routes()]
        for r in Native(self).routes():
            if r.path in HEALTH:
                served.append(r)
            else:  # llama-server's error object on its routes, as one daemon answers them
                refused.append(self._refusal(r, lambda ep: self.guard(ep, errors=native_base.error_response)))
        return served + refused

    @staticmethod
    def _refusal(route: Route, guard: Callable[[Any], Any]) -> Route:
        path = route.path

        async def refuse(request: Request) -> Response:
            raise NotServed(f"{request.method} {path} is not served by the cluster: it serves the OpenAI chat, "
                            "completions, models and Responses routes; one node's slots, genes, pages, embeddings "
                            "and native API are served by that node's own daemon", route=path)

        return Route(path, guard(refuse), methods=list(route.methods or ["GET"]))
