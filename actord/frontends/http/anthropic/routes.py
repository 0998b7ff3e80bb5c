"""Anthropic's Messages API routes, as llama-server serves them: POST /v1/messages and POST
/v1/messages/count_tokens.

Why a translation layer and nothing more: a message is one chat turn, exactly as OpenAI's
chat route runs it (`Service.chat`: the model's template, tools through actord.chat.tools,
thinking through actord.chat.reasoning, the turn memory and minds), so clients built for
Anthropic (Claude Code-style agents, the `anthropic` SDK, litellm's anthropic provider)
pointed at actord get the same engine. `wire.py`'s pure `to_turn` reads the request into
one turn (actord/frontends/http/turns.py) and its `from_result` writes the whole answer;
`stream.py` is the answer (`streaming.Generation` runs the turn inside
the response, so a client that hangs up cancels it, streamed or not).

Every answer that is not a 200 carries Anthropic's error object (`{"type": "error", "error":
{"type", "message"}}`) with the front's status, a missing or wrong key's 401 included: the
key is `x-api-key` or `Authorization: Bearer` (app.py). What bounds a chat bounds a message:
the body's bytes (--http-max-body-bytes), the conversation's and the tools' bytes (the
prompt's bound, `chat.turn.check_turn`), the tools' count and schemas (`chat.tools`), the
stop sequences' count and bytes and the sampling ranges (`chat.turn.precheck`), each a 4xx
before any work.

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

from actord.frontends.http.anthropic import wire as W
from actord.frontends.http.anthropic.stream import AnthropicAnswer, error_response
from actord.frontends.http.degraded import Degraded
from actord.frontends.http.responses import RouteGroup, json_response, stopping_word
from actord.frontends.http.streaming import Generation
from actord.frontends.http.turns import TurnContext, fit, fitted


class AnthropicRoutes(RouteGroup):

    def routes(self) -> list[Route]:
        g = self.front.guard
        return [
            Route("/v1/messages", g(self.messages, errors=error_response, generates=True), methods=["POST"]),
            Route("/v1/messages/count_tokens", g(self.count_tokens, errors=error_response), methods=["POST"]),
        ]

    async def _request(self, request: Request) -> W.MessagesRequest:
        return await self.front.decode_json(request, W.MessagesRequest)

    async def messages(self, request: Request) -> Response:
        req = await self._request(request)
        turn = W.to_turn(req, request.headers, TurnContext.of(self.front))
        chat = await fit(self.front, turn)
        system = self.system

        async def run(on_token: Any) -> Any:
            return await system.chat(chat, on_token=on_token)

        async def stop_word(result: Any) -> str:
            return await stopping_word(system, result.completion, chat.stop)

        answer = AnthropicAnswer(run, stop_word, W.new_id(), req.model or self.front.model_id)
        return Generation(self.front, answer, stream=req.stream, headers=turn.degraded.headers())

    async def count_tokens(self, request: Request) -> Response:
        req = await self._request(request)
        W.check(req)
        degraded = Degraded()  # counted as the message would be prompted: folded, tools relaxed
        tools = W.chat_tools(req, degraded)["tools"]
        n = await self.system.count_prompt(await fitted(self.front, W.chat_messages(req), degraded), None, True,
                                           tools, W.thinking_kwargs(req))
        return json_response({"input_tokens": n})
