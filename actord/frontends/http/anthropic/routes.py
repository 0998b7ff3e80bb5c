"""Anthropic's Messages API routes, as llama-server serves them: POST /v1/messages and POST
/v1/messages/count_tokens.

Why a translation layer and nothing more: a message is one chat turn, exactly as OpenAI's
chat route runs it (`Service.chat`: the model's template, tools through actord.chat.tools,
thinking through actord.chat.reasoning, the turn memory and minds), so clients built for
Anthropic (Claude Code-style agents, the `anthropic` SDK, litellm's anthropic provider)
pointed at actord get the same engine. `wire.py` reads the request into a ChatRequest and
writes the answer; `stream.py` is the answer (`streaming.Generation` runs the turn inside
the response, so a client that hangs up cancels it, streamed or not).

Every answer that is not a 200 carries Anthropic's error object (`{"type": "error", "error":
{"type", "message"}}`) with the front's status, a missing or wrong key's 401 included: the
key is `x-api-key` or `Authorization: Bearer` (app.py). What bounds a chat bounds a message:
the body's bytes (--http-max-body-bytes), the conversation's and the tools' bytes (the
prompt's bound, `chat.turn.check_turn`), the tools' count and schemas (`chat.tools`), the
stop sequences' count and bytes and the sampling ranges (`precheck`), each a 4xx before any
work.

The mind: the `X-Actord-Mind` header, else `metadata.user_id` through a digest (as OpenAI's
`user`), else none (the request is placed like llama-server's, by shared prefix).
count_tokens renders the conversation as the turn would (its tools and thinking) and counts
the tokens its prompt would hold, BOS included where the model adds one.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.chat.messages import ChatRequest
from actord.frontends.http.anthropic import wire as W
from actord.frontends.http.anthropic.stream import AnthropicAnswer, error_response
from actord.frontends.http.degraded import Degraded, fold_for
from actord.frontends.http.openai.routes import decode_body, named_mind, precheck
from actord.frontends.http.responses import RouteGroup, json_response, stopping_word
from actord.frontends.http.streaming import Generation


class AnthropicRoutes(RouteGroup):

    def routes(self) -> list[Route]:
        g = self.front.guard
        return [
            Route("/v1/messages", g(self.messages, errors=error_response), methods=["POST"]),
            Route("/v1/messages/count_tokens", g(self.count_tokens, errors=error_response), methods=["POST"]),
        ]

    async def _request(self, request: Request) -> W.MessagesRequest:
        req: W.MessagesRequest = await decode_body(self.front, request, W.MessagesRequest)
        W.check(req)
        return req

    async def messages(self, request: Request) -> Response:
        req = await self._request(request)
        n = req.max_tokens
        if n is None:  # required by Anthropic; llama-server's default instead
            n = min(self.config.http_default_max_tokens, self.system.model_props().n_ctx)
        stops = list(req.stop_sequences or [])
        degraded = Degraded()
        tool_fields = W.chat_tools(req, degraded)
        chat = ChatRequest(
            messages=await fold_for(self.front, W.chat_messages(req), degraded), n_predict=n,
            mind=named_mind(request, None, req.metadata.user_id if req.metadata else None),
            temperature=1.0 if req.temperature is None else req.temperature, top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p, stop=stops, stream=req.stream,
            template_kwargs=W.thinking_kwargs(req), reasoning_budget=W.thinking_budget(req),
            grammar=W.output_grammar(req, degraded), ignore_eos=req.ignore_eos, cache_salt=req.cache_salt,
            **tool_fields,
        ).check()
        precheck(chat, self.config.request_limits())
        system = self.system

        async def run(on_token: Any) -> Any:
            return await system.chat(chat, on_token=on_token)

        async def stop_word(result: Any) -> str:
            return await stopping_word(system, result.completion, stops)

        answer = AnthropicAnswer(run, stop_word, W.new_id(), req.model or self.front.model_id)
        return Generation(self.front, answer, stream=req.stream, headers=degraded.headers())

    async def count_tokens(self, request: Request) -> Response:
        req = await self._request(request)
        degraded = Degraded()  # counted as the message would be prompted: folded, tools relaxed
        tools = W.chat_tools(req, degraded)["tools"]
        n = await self.system.count_prompt(await fold_for(self.front, W.chat_messages(req), degraded), None, True,
                                           tools, W.thinking_kwargs(req))
        return json_response({"input_tokens": n})
