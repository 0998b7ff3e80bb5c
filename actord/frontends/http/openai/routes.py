"""The OpenAI-compatible routes: chat and text completions, and the model list.

Why a module of its own: these routes turn OpenAI's requests (shapes and checks in
`wire.py`) into actord's chats and completions and answer in OpenAI's shapes
(`OpenAIAnswer`, run inside the response by `streaming.Generation`, as the native
/completion's answer is); the front that serves them (`app.py`) is the same for both APIs.

Routes, as llama-server names them: POST /v1/chat/completions and /chat/completions (and
their `/input_tokens`: the prompt's token count, `{"input_tokens": n}`), POST
/v1/completions (one prompt or a list: `complete_prompts`), GET /v1/models and /models, GET /v1/models/{id} and /models/{id}. Any
`model` name is served and echoed, as llama-server does; the list names the model once, as
llama-server's (its id the first alias, else the file's stem, with `aliases` and `tags`),
and a lookup answers for the id, the stem and each alias. OpenAI's Responses API and
embeddings have modules of their own (`responses_api.py`: POST /v1/responses, GET/DELETE
/v1/responses/{id}; `embeddings.py`: POST /v1/embeddings; each with its bare path too), and
read their bodies as these routes do (`decode_body`; the Responses API its mind too: turns.py `mind_of`).

Tools (actord.chat.tools): a chat's `tools`, `tool_choice`, `parallel_tool_calls` and the legacy
`functions` / `function_call` become the ChatRequest's tool fields (`wire.chat_tools`);
the answer carries the reply's `tool_calls` (streamed: as `tool_calls` deltas, each call
whole), or, for a legacy request, `function_call`.

Routes are thin (actord/frontends/http/turns.py): a chat's body is read into one turn by
the wire's pure `to_turn` (`wire.py`), fitted to the template, run by the `chat` verb and
answered by `OpenAIAnswer` (`wire.from_result`, or the chunks). The mind a request names:
the `X-Actord-Mind` header, else a session header the operator named, else
`prompt_cache_key`, else `user` (turns.py `mind_of`). The header wins, because it is an
explicit instruction to actord; `prompt_cache_key` beats `user` because it is OpenAI's
field for exactly this (cache routing), while `user` is an end-user id a client may set for
other reasons. With none, a request is placed like llama-server's: the idle slot sharing the
longest prefix.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.chat.defaults import TurnDefaults
from actord.vocabulary.types import CompletionRequest
from actord.vocabulary.errors import ActordError, InvalidParams, ModelNotFound
from actord.service.protocol import Service
from actord.frontends.http.openai import wire as O
from actord.frontends.http.openai.answers import Chunks, new_id, text_completion, verbose_object
from actord.frontends.http.openai.tools_wire import call_deltas
from actord.frontends.http.degraded import Degraded
from actord.frontends.http.turns import TurnContext, fit, fitted, mind_of
from actord.frontends.http.responses import RouteGroup, error_object, json_response, llama_error_response
from actord.frontends.http.streaming import DONE, Generation, sse


class OpenAIAnswer:
    """OpenAI's framing of a generation (`streaming.Answer`): a chat.completion or
    text_completion body; streamed, OpenAI's chunks (the chat's role first), the last with
    the finish reason, the usage chunk when asked, then `data: [DONE]`."""

    done = DONE

    def __init__(self, front: Any, run: Callable[[Any], Awaitable[Any]], *, chat: bool, model: str,
                 stream: bool, include_usage: bool, logprobs: bool, functions: bool = False, n: int = 1,
                 llama: bool = False, prompt_of: Callable[[], Awaitable[str]] | None = None) -> None:
        self.front, self.run, self.chat, self.model = front, run, chat, model
        self.prompt_of = prompt_of  # set: the answer carries llama-server's `__verbose` (verbose_object)
        self.include_usage, self.logprobs = include_usage, logprobs
        self.functions = functions  # legacy function calling: the answer carries function_call
        self.llama = llama  # served on llama-server's unprefixed alias: its forms where OpenAI's differ
        self.chunks = Chunks(chat, model, front.fingerprint, logprobs, functions, n, llama) if stream else None

    def error_object(self, e: Any) -> tuple[int, dict[str, Any]]:
        return error_object(e, llama=self.llama)

    @classmethod
    def response(cls, front: Any, run: Callable[[Any], Awaitable[Any]], *, chat: bool, model: str,
                 stream: bool, include_usage: bool, logprobs: bool = False, functions: bool = False,
                 n: int = 1, llama: bool = False, prompt_of: Callable[[], Awaitable[str]] | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> Generation:
        answer = cls(front, run, chat=chat, model=model, stream=stream, include_usage=include_usage,
                     logprobs=logprobs, functions=functions, n=n, llama=llama, prompt_of=prompt_of)
        return Generation(front, answer, stream=stream, headers=headers)

    async def whole(self) -> Any:
        r = await self.run(None)  # a chat's ChatResult (its message and calls), a completion's result
        created, fp = int(time.time()), self.front.fingerprint
        if self.chat:
            body = O.from_result(r, model=self.model, created=created, fingerprint=fp, logprobs=self.logprobs,
                                 functions=self.functions)
        else:
            body = text_completion(new_id("cmpl"), self.model, r, created, fp, self.logprobs)
        if self.prompt_of is not None:
            body["__verbose"] = verbose_object(self.model, r, await self.prompt_of())
        return body

    async def streamed(self, on_token: Any) -> list[Any]:
        assert self.chunks is not None
        r = await self.run(on_token)  # n > 1: the choices' results, by index
        lasts = self.chunks.lasts(r)
        if self.prompt_of is not None and lasts:  # on the final result's first chunk, as llama-server's
            lasts[0] = {**lasts[0], "__verbose": verbose_object(self.model, r, await self.prompt_of())}
        return [*lasts, *([self.chunks.usage(r)] if self.include_usage else [])]

    def first(self) -> Any | None:
        assert self.chunks is not None
        if self.chunks.n > 1:  # each choice's role delta, framed here: one event per choice
            return b"".join(sse(c) for c in self.chunks.firsts()) or None
        return self.chunks.first()

    def chunk(self, chunk: dict[str, Any]) -> Any:
        assert self.chunks is not None
        if "progress" in chunk:  # return_progress: llama-server's role delta with the prompt's progress
            return self.chunks.progress(chunk["progress"], chunk.get("timings"), chunk.get("index", 0))
        if self.chat and not (chunk["content"] or chunk.get("calls") or chunk.get("logprobs") or chunk.get("reasoning")):
            return b""  # tokens with no text yet (a character's first bytes, a stop's start): no empty delta
        out = self.chunks.delta(chunk["content"], chunk.get("logprobs"), call_deltas(chunk.get("calls")),
                                chunk.get("index", 0), chunk.get("reasoning", ""))
        if "timings" in chunk:  # timings_per_token
            out["timings"] = chunk["timings"]
        return out


async def complete_prompts(system: Service, comps: list[CompletionRequest], n: int,
                           on_token: Any) -> list[list[Any]]:
    """Several prompts (OpenAI's `prompt` as a list), each its own request with its n choices,
    side by side; the results by prompt. Streamed chunks carry their choice's index in the
    whole answer, prompt p's choice i as p x n + i. A typed error in any prompt ends the
    request with that error (the others are cancelled), as one choice's does."""
    results: list[list[Any]] = [[] for _ in comps]
    failed: list[BaseException] = []

    async def one(p: int, comp: CompletionRequest) -> None:
        sink = None
        if on_token is not None:
            def sink(chunk: dict[str, Any], base: int = p * n) -> None:
                on_token({**chunk, "index": base + chunk.get("index", 0)})
        try:
            if n > 1:
                results[p] = await system.complete_n(comp, n, on_token=sink)
            else:
                results[p] = [await system.complete(comp, on_token=sink)]
        except ActordError as e:
            failed.append(e)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for p, comp in enumerate(comps):
            tg.start_soon(one, p, comp)
    if failed:
        raise failed[0]
    return results


async def decode_body(front: Any, request: Request, typ: type) -> Any:
    """The request's body (bounded by the front) decoded as `typ`; a 400 names what is wrong."""
    return await front.decode_json(request, typ)


class OpenAIRoutes(RouteGroup):

    def routes(self) -> list[Route]:
        g = self.front.guard
        # The generating routes are counted against their client's share from the head (app.py guard).
        chat, models, model = g(self.chat_completions, generates=True), g(self.models), g(self.model)
        # llama-server's unprefixed aliases answer in its forms where they differ from
        # OpenAI's (a first stream delta's content null, exceed_context_size_error);
        # /v1 keeps OpenAI's.
        return [
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/chat/completions", g(self.chat_completions, errors=llama_error_response, generates=True),
                  methods=["POST"]),
            Route("/v1/chat/completions/input_tokens", g(self.input_tokens), methods=["POST"]),
            Route("/chat/completions/input_tokens", g(self.input_tokens, errors=llama_error_response),
                  methods=["POST"]),
            Route("/v1/completions", g(self.completions, generates=True), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/models", models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", model, methods=["GET"]),
            Route("/models/{model_id:path}", model, methods=["GET"]),
        ]

    async def _body(self, request: Request, typ: type) -> Any:
        return await decode_body(self.front, request, typ)

    async def chat_completions(self, request: Request) -> Response:
        req: O.ChatCompletionRequest = await self._body(request, O.ChatCompletionRequest)
        turn = O.to_turn(req, request.headers, TurnContext.of(self.front))
        chat = await fit(self.front, turn)

        prompt_of = None
        if self._verbose(req):
            async def prompt_of() -> str:  # the turn's prompt text, rendered again (a debugging aid)
                agp = chat.add_generation_prompt or chat.continue_final_message  # both continue a last reply
                return await self.system.apply_template(chat.messages, chat.template, agp, chat.tools or None,
                                                        chat.template_kwargs or None)

        async def run(on_token: Any) -> Any:
            # A ChatResult (the message and its calls); n > 1: one per choice (actord/chat/choices.py).
            return await self.system.chat(chat, on_token=on_token, n=turn.n)

        return OpenAIAnswer.response(self.front, run, chat=True, model=req.model or self.front.model_id,
                                     stream=req.stream, logprobs=chat.logprobs,
                                     include_usage=bool(req.stream_options and req.stream_options.include_usage),
                                     functions=req.functions is not None or req.function_call is not None,
                                     n=turn.n, llama=not request.url.path.startswith("/v1/"), prompt_of=prompt_of,
                                     headers=turn.degraded.headers())

    async def input_tokens(self, request: Request) -> Response:
        """llama-server's token count of a chat's prompt: its messages rendered as the chat
        would render them (fitted to the template, tools, thinking, prefill) and tokenized as
        the chat would (special tokens parsed, the model's BOS unless the template wrote it),
        nothing generated."""
        req: O.ChatCompletionRequest = await self._body(request, O.ChatCompletionRequest)
        if not req.messages:
            raise InvalidParams("messages is empty", param="messages")
        degraded = Degraded()  # counted as the chat would be prompted: folded, tools relaxed
        fields = O.chat_fields(req)
        n = await self.system.count_prompt(
            await fitted(self.front, O.chat_messages(req.messages), degraded), None,
            fields.get("add_generation_prompt", True), O.chat_tools(req, degraded)["tools"],
            fields["template_kwargs"])
        return json_response({"input_tokens": n, "object": "response.input_tokens"})

    async def completions(self, request: Request) -> Response:
        req: O.TextCompletionRequest = await self._body(request, O.TextCompletionRequest)
        O.refuse_unsupported(req)
        n_choices = O.choices(req, self.config.max_n)
        prompts = O.text_prompts(req.prompt)
        if len(prompts) * n_choices > self.config.max_n:
            raise InvalidParams(f"{len(prompts)} prompts x n={n_choices} ask for {len(prompts) * n_choices} "
                                f"completions; this daemon's --max-n allows {self.config.max_n} in one request",
                                param="prompt", max=self.config.max_n)
        fields = O.sampling(req, self.system.model_props().n_vocab)
        mind, label = mind_of(request.headers, TurnContext.of(self.front), req.prompt_cache_key, req.user)
        if label is not None:
            self.front.mind_labels.note(*label)
        defaults = TurnDefaults(max_tokens=16)  # OpenAI's own for legacy completions
        comps = [CompletionRequest(
            # A mind continues from prompt 0 only, as from choice 0 (actord/chat/choices.py):
            # the other prompts are requests of their own, not turns of hers.
            prompt=p, n_predict=defaults.max_tokens if req.max_tokens is None else req.max_tokens,
            mind=mind if i == 0 else None,
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_k=req.top_k, top_p=defaults.top_p if req.top_p is None else req.top_p, seed=req.seed,
            stop=O.stops(req.stop), stream=req.stream, genes=req.genes, **fields, ignore_eos=req.ignore_eos,
            return_progress=req.return_progress, timings_per_token=req.timings_per_token,
        ).check(self.config.request_limits()) for i, p in enumerate(prompts)]

        async def run(on_token: Any) -> Any:
            if len(comps) > 1:  # each prompt's choices, by prompt
                return await complete_prompts(self.system, comps, n_choices, on_token)
            if n_choices > 1:  # the choices' results, by index, from one prefill (actord/chat/choices.py)
                return await self.system.complete_n(comps[0], n_choices, on_token=on_token)
            return await self.system.complete(comps[0], on_token=on_token)

        return OpenAIAnswer.response(self.front, run, chat=False, model=req.model or self.front.model_id,
                                     stream=req.stream, logprobs=fields["logprobs"],
                                     include_usage=bool(req.stream_options and req.stream_options.include_usage),
                                     n=len(comps) * n_choices, prompt_of=self._prompt_text(comps[0].prompt)
                                     if self._verbose(req) else None)

    def _verbose(self, req: O._Common) -> bool:
        """llama-server's `__verbose`: the request's `verbose`, else --http-verbose."""
        return self.config.http_verbose if req.verbose is None else req.verbose

    def _prompt_text(self, prompt: Any) -> Callable[[], Awaitable[str]]:
        async def text() -> str:
            if isinstance(prompt, str):
                return prompt
            return await self.system.detokenize(list(prompt))
        return text

    def _model_object(self, name: str) -> dict[str, Any]:
        f = self.front  # llama-server lists its aliases and tags beside the id (extra fields to OpenAI)
        return {"id": name, "object": "model", "created": f.created, "owned_by": "actord",
                "aliases": f.aliases, "tags": f.tags}

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_object(n) for n in self.front.names]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        if name not in self.front.known:
            # Requests may name any model (they are all served by this one), but a lookup
            # answers only for the names /v1/models lists, so the list and lookups agree.
            raise ModelNotFound(f"the model {name[:200]!r} does not exist; this daemon lists {self.front.names!r}",
                                param="model")
        return json_response(self._model_object(name))
