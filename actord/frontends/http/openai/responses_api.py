"""OpenAI's Responses API on the HTTP front: POST /v1/responses, GET and DELETE
/v1/responses/{id} (and the bare /responses paths).

A response is one chat turn (`ActorSystem.chat`, the model's own template, tools through
actord.chat.tools) over a conversation that actord keeps: each stored response remembers its
mind and the conversation up to and including its own output (`ResponseStore`, bounded in
count and bytes, oldest dropped first). A request naming `previous_response_id` continues
that conversation in that mind, so its state is still in the mind's slot, or in its page
(RAM or file) when other minds took the slot meanwhile, and the turn decodes only the new
input: the prompt starts with the exact tokens of the previous prompt and reply
(actord.chat.prompter's turn memory).

Which mind: the `X-Actord-Mind` header, `prompt_cache_key` or `user` when given (as on the
chat route); else the previous response's; else, for a conversation's first response, a
mind named from a digest of how the conversation starts (its instructions and first input
item). So a client that resends the whole history each turn instead of naming the previous
response (the Agents SDK's default) lands in the same mind too. Two conversations that start
identically share that mind (they then take turns in it, each reusing what prefix they
share): name them apart with `prompt_cache_key` where that matters. `store: false` keeps
nothing and names no mind (the turn is placed like a chat without one).

Fields. Honoured: `input` (a string, or items: messages with `input_text` / `output_text`
parts, `function_call` and `function_call_output`), `instructions` (a system message for
this turn only, as OpenAI documents), `previous_response_id`, `max_output_tokens`,
`temperature`, `top_p`, `stream`, `tools` (function tools), `tool_choice`,
`parallel_tool_calls`, `text.format` (text, json_object, json_schema: the grammar of
response_format), `store`, `metadata` (echoed), `user`, `prompt_cache_key`,
`include: ["reasoning.encrypted_content"]` (the turn's thought as an opaque reasoning item,
which comes back as an input item: responses_extras.py); extensions `top_k`, `genes`,
`ignore_eos`. Answered in a lesser form and named in the `X-Actord-Degraded` header
(actord/frontends/http/degraded.py): hosted tools (dropped), `namespace` tools (flattened),
tool schemas the grammar cannot hold (relaxed), other `include` values and reasoning items
this server did not write (dropped), `reasoning.effort` (this model reasons as its template
says), a `text.format` beside a forced tool call (the call's grammar holds the output),
developer and system items where the template refuses them (merged). Refused with a 400
naming the field: images and files, `item_reference`, `background`, `conversation`,
`prompt`, `top_logprobs`, `max_tool_calls`, `truncation: auto`. Ignored by design:
`service_tier`, `safety_identifier`, `stream_options`, `prompt_cache_retention`,
`client_metadata`, unknown fields.

Streaming sends the Responses events (`event:` and `data:` lines, no `[DONE]`):
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta, response.output_text.done,
response.content_part.done, response.output_item.done, response.function_call_arguments.
delta/.done, and response.completed (or response.incomplete when max_output_tokens cut it).
As on the chat route, nothing is sent until the first output (or the error) is ready, so an
error found while the prompt is placed is still an HTTP status. The turn runs inside the
response as every generation does (`streaming.Generation`, a client that hangs up cancels
it); `ResponsesAnswer` is its `streaming.Answer`: the final body, or the events, framed here
(each has its `event:` line, and one chunk may be several events or none).

The route is thin (actord/frontends/http/turns.py): `to_turn` reads the request (and the
stored response it continues) into one turn, pure; `fit` fits it to the template; the
`chat` verb runs it; `from_result` writes the final response object. The answer's shapes
(its output items, usage and streaming events) are `responses_events.py`'s. (Not to be confused with `responses.py`, the answer types every
route shares.)
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.chat.defaults import asked
from actord.chat.messages import ChatMessage, Tool, ToolCall
from actord.vocabulary.errors import ActordError, InvalidParams
from actord.frontends.http.openai.anonymous import forget_past_bound
from actord.policy.lru import DaemonMinds
from actord.frontends.http.openai.answers import llama_timings, new_id
from actord.frontends.http.openai import responses_extras as X
from actord.frontends.http.openai.response_store import ResponseStore, Stored
from actord.frontends.http.openai.responses_events import Events, _usage, output_items
from actord.frontends.http.degraded import Degraded, relax_schema, relax_tools
from actord.frontends.http.openai.tools_wire import tools_from_openai
from actord.frontends.http.responses import HttpError, RouteGroup, error_object, json_response
from actord.frontends.http.streaming import Generation
from actord.frontends.http.turns import Turn, TurnContext, fit, fitted, mind_of
from actord.service import tenancy
from actord.vocabulary.names import RESPONSES_MIND, is_responses_mind
from actord.vocabulary.types import GeneRef

class ResponsesRequest(msgspec.Struct, kw_only=True, frozen=True):
    model: str | None = None
    input: Any = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    stream: bool = False
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    text: Any = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None  # vLLM's: reuse of cells only with requests of the same salt
    genes: list[Any] = []
    # llama-server's, streamed only: `response.in_progress` events with `prompt_progress`
    # while the prompt is decoded; `timings` on each text delta and on the last event.
    return_progress: bool = False
    timings_per_token: bool = False
    ignore_eos: bool = False  # llama-server's: max_output_tokens, not the end token, ends the output
    # Refused unless absent (see the module docstring).
    reasoning: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    include: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    truncation: Any = None


def _refuse(field: str, why: str) -> InvalidParams:
    return InvalidParams(f"unsupported parameter '{field}': {why}", param=field)


def check(req: ResponsesRequest, degraded: Degraded) -> None:
    """A 400 naming the first field that cannot be honoured; what is answered in a lesser
    form noted in `degraded`."""
    for name in ("background", "conversation", "prompt", "max_tool_calls"):
        if getattr(req, name) not in (None, False):
            raise _refuse(name, "not supported by this server")
    if req.reasoning is not None and not isinstance(req.reasoning, dict):
        raise InvalidParams("reasoning is an object", param="reasoning")
    if (req.reasoning or {}).get("effort") not in (None, "none"):
        degraded.add(f"reasoning.effort {str(req.reasoning['effort'])[:20]!r} ignored: "  # type: ignore[index]
                     "this model reasons as its template and chat_template_kwargs say")
    if req.top_logprobs not in (None, 0):
        raise _refuse("top_logprobs", "logprobs are served on /v1/chat/completions")
    if req.truncation not in (None, "disabled"):
        raise _refuse("truncation", "only disabled: an input over the context is a 400")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise InvalidParams("max_output_tokens must be >= 1", param="max_output_tokens")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise InvalidParams("temperature must be in [0, 2]", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise InvalidParams("top_p must be in (0, 1]", param="top_p")
    if req.input is None or req.input == [] or req.input == "":
        raise InvalidParams("input is empty", param="input")


def _text_of(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParams(f"{param} is a string or a list of content parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise InvalidParams(f"{param}[{j}]: only text content parts are supported ({', '.join(kinds)})",
                                param=f"{param}[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(v: Any, degraded: Degraded | None = None) -> list[ChatMessage]:
    """`input` as chat messages: a string is one user message; items are messages (roles as
    sent: turns.py `roles_for` fits `developer` to the template), function calls (joined onto
    the assistant turn before them), their outputs, and (with `degraded`) reasoning items,
    whose thought goes to the assistant turn after them."""
    if isinstance(v, str):
        return [ChatMessage(role="user", content=v)]
    if not isinstance(v, list):
        raise InvalidParams("input is a string or a list of items", param="input")
    out: list[ChatMessage] = []
    thought: str | None = None  # a reasoning item's, for the assistant turn that follows it
    for i, it in enumerate(v):
        p = f"input[{i}]"
        if not isinstance(it, dict):
            raise InvalidParams(f"{p} is an object", param=p)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidParams(f"{p}.role must be user, system, developer or assistant", param=f"{p}.role")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text_of(it.get("content", ""), f"{p}.content", kinds + ("text",))
            out.append(ChatMessage(role=role, content=text,
                                   reasoning_content=thought if role == "assistant" else None))
            thought = None if role == "assistant" else thought
        elif kind == "function_call":
            name, args, cid = it.get("name"), it.get("arguments", "{}"), it.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(cid, str)):
                raise InvalidParams(f"{p}: a function_call has call_id, name and arguments (strings)", param=p)
            call = ToolCall(id=cid, name=name, arguments=args)
            if out and out[-1].role == "assistant":
                last = out[-1]
                out[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or []), call])
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call], reasoning_content=thought))
                thought = None
        elif kind == "function_call_output":
            cid = it.get("call_id")
            if not isinstance(cid, str):
                raise InvalidParams(f"{p}.call_id is the call's id", param=f"{p}.call_id")
            output = it.get("output", "")
            text = output if isinstance(output, str) else _text_of(output, f"{p}.output", ("input_text",))
            out.append(ChatMessage(role="tool", tool_call_id=cid, content=text))
        elif kind == "reasoning" and degraded is not None:
            thought = X.input_reasoning(it, p, degraded)
        else:
            raise InvalidParams(f"{p}: items of type {str(kind)[:40]!r} are not supported "
                                "(message, function_call, function_call_output, reasoning)", param=f"{p}.type")
    return out


def text_grammar(text: Any, degraded: Degraded | None = None) -> str:
    """`text.format` as GBNF ("" for plain text), as response_format on the chat route; its
    schema relaxed where the grammar cannot hold it (noted in `degraded`)."""
    from actord.engine.grammar import JSON_OBJECT_GBNF, schema_grammar

    fmt = text.get("format") if isinstance(text, dict) else None
    if text is None or fmt is None or fmt == {"type": "text"}:
        return ""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return JSON_OBJECT_GBNF
    if kind == "json_schema":
        schema = fmt.get("schema")
        if schema is not None and degraded is not None:
            schema = relax_schema(schema, "text.format.schema", degraded)
        return JSON_OBJECT_GBNF if schema is None else schema_grammar(schema, "text.format")
    raise _refuse("text.format", f"type {str(kind)[:40]!r} is not one of text, json_object, json_schema")


def conversation_mind(instructions: str | None, first: ChatMessage) -> str:
    """The mind a conversation's first response names when nothing else does: a digest of
    how it starts, so resending the whole history lands in the same mind."""
    h = hashlib.blake2b(digest_size=16, person=b"actord-resp")
    role = "system" if first.role == "developer" else first.role  # the name it had before its template fit
    h.update(msgspec.msgpack.encode([instructions or "", role, first.content,
                                     [(c.id, c.name, c.arguments) for c in first.tool_calls or []]]))
    return RESPONSES_MIND + h.hexdigest()


@dataclass
class ResponseTurn(Turn):
    """A Responses request's turn, and what its answer and its store need of it: the
    conversation to keep (without this turn's instructions), whether its mind was named
    from how the conversation starts (`anonymous`, bounded: anonymous.py), and whether the
    thought comes back as an opaque item (`sealed`)."""

    history: list[ChatMessage] = field(default_factory=list)
    anonymous: bool = False
    sealed: bool = False


def conversation(req: ResponsesRequest, prev: Stored | None,
                 degraded: Degraded) -> tuple[list[ChatMessage], list[ChatMessage], list[Tool], Any]:
    """The conversation kept (`prev`'s and this input), the one prompted (this turn's
    instructions first), its tools and tool choice."""
    from actord.chat import tools as T

    history = (prev.messages if prev is not None else []) + input_messages(req.input, degraded=degraded)
    convo = ([ChatMessage(role="system", content=req.instructions)] if req.instructions else []) + history
    tools = relax_tools(tools_from_openai(X.flat_tools(req.tools, degraded), "tools", flat=True), degraded)
    if req.parallel_tool_calls is not None and not isinstance(req.parallel_tool_calls, bool):
        raise InvalidParams("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    T.check_tools(tools, choice)
    return history, convo, tools, choice


def to_turn(req: ResponsesRequest, headers: Mapping[str, str], context: TurnContext,
            prev: Stored | None = None) -> ResponseTurn:
    """A Responses request as one chat turn (actord/frontends/http/turns.py), continuing
    `prev` (the stored response `previous_response_id` names, looked up by the route): every
    field read and checked as the module docstring says; what it leaves unsaid
    (`max_output_tokens`, the sampling) is the chat layer's defaults."""
    degraded = Degraded()  # what is answered in a lesser form (degraded.py): its header
    check(req, degraded)
    sealed = X.wants_reasoning(req.include, degraded)
    history, convo, tools, choice = conversation(req, prev, degraded)
    grammar = text_grammar(req.text, degraded)
    if grammar and tools and choice != "auto" and choice != "none":
        # instructor's RESPONSES_TOOLS: a forced call and text.format with its schema; the
        # call's grammar already holds the output, and two grammars cannot both hold.
        degraded.add("text.format dropped: a forced tool call's grammar holds the output")
        grammar = ""
    mind, label = mind_of(headers, context, req.prompt_cache_key, req.user)
    anonymous = False
    if mind is None and req.store:
        mind = prev.mind if prev is not None else conversation_mind(req.instructions, history[0])
        anonymous = mind is not None and is_responses_mind(mind)
    chat = asked(context.defaults, messages=convo, max_tokens=req.max_output_tokens, temperature=req.temperature,
                 top_p=req.top_p, top_k=req.top_k, mind=mind, stream=req.stream,
                 genes=msgspec.convert(req.genes, list[GeneRef]), grammar=grammar, ignore_eos=req.ignore_eos,
                 tools=tools, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls is not False,
                 return_progress=req.return_progress and req.stream,
                 timings_per_token=req.timings_per_token and req.stream, cache_salt=req.cache_salt)
    return ResponseTurn(chat, degraded, label=label, history=history, anonymous=anonymous, sealed=sealed)


def from_result(base: dict[str, Any], result: Any, *, cut_is_incomplete: bool, sealed: bool,
                output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A turn's ChatResult as the final response object: `base` (the request's echo) with its
    status, output items (`output`: those a stream already built), usage and why it is
    incomplete. `cut_is_incomplete`: a reply cut by max_output_tokens is OpenAI's
    `incomplete` (/v1), else `completed`, as llama-server calls every finished response."""
    c = result.completion
    cut = c.stop_reason in ("length", "context") and cut_is_incomplete
    return {**base, "status": "incomplete" if cut else "completed",
            "output": output if output is not None else output_items(result.message, cut, sealed),
            "usage": _usage(c), "incomplete_details": {"reason": "max_output_tokens"} if cut else None}


# -- the routes ------------------------------------------------------------------------


class ResponsesAnswer:
    """The Responses API's framing of a turn (`streaming.Answer`): the final response object;
    streamed, the Responses events (`Events`), framed here, and no `[DONE]`."""

    done = b""
    error_object = staticmethod(error_object)

    def __init__(self, run: Any, base: dict[str, Any], finish: Any, timings: bool = False,
                 sealed: bool = False) -> None:
        self.run, self.finish, self.timings = run, finish, timings
        self.events = Events(base, sealed)

    async def whole(self) -> Any:
        return self.finish(await self.run(None))

    async def streamed(self, on_token: Any) -> list[Any]:
        r = await self.run(on_token)
        t = llama_timings(r.completion) if self.timings else None
        return [self.events.finish(self.finish(r, self.events.output), t)]

    def first(self) -> Any | None:
        return None  # response.created and .in_progress lead the first chunk's events (Events._lead)

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        t = chunk.get("timings")
        data = self.events.progress(chunk["progress"], t) if "progress" in chunk else b""
        if chunk.get("reasoning"):
            data += self.events.thought(chunk["reasoning"])
        if chunk.get("content"):
            data += self.events.text(chunk["content"], t)
        for made in chunk.get("calls") or []:  # actord.chat.stream.CallMade: the call, whole
            data += self.events.call(made.call)
        return data  # b"": nothing to send (no text, no call)

    def error_event(self, e: HttpError | ActordError) -> bytes:
        err = error_object(e)[1]["error"]
        return self.events.error(0, err["message"], err["code"], err.get("param"))


class Responses(RouteGroup):
    def __init__(self, front: Any) -> None:
        super().__init__(front)
        cfg = front.config
        self.store = ResponseStore(cfg.http_responses_max, cfg.http_responses_max_bytes)
        self.anonymous = DaemonMinds(cfg.http_anonymous_minds, cfg.http_anonymous_mind_bytes)
        front.responses_store = self.store  # what memory_report reads (service/memory.py)

    def routes(self) -> list[Route]:
        g = self.front.guard
        create, one, count = g(self.create, generates=True), g(self.one), g(self.input_tokens)
        return [Route(p, create, methods=["POST"]) for p in ("/v1/responses", "/responses")] + [
            Route(p, count, methods=["POST"]) for p in ("/v1/responses/input_tokens", "/responses/input_tokens")] + [
            Route(p, one, methods=["GET", "DELETE"]) for p in ("/v1/responses/{rid}", "/responses/{rid}")]

    async def one(self, request: Request) -> Response:
        rid = request.path_params["rid"]
        tenant = tenancy.current()
        s = self.store.find(rid, tenant) if request.method == "GET" else self.store.take(rid, tenant)
        if s is None:
            raise HttpError(404, f"no response with id {rid[:80]!r} (not stored, or dropped from the store)",
                            "not_found", "response_id")
        if request.method == "DELETE":
            return json_response({"id": rid, "object": "response.deleted", "deleted": True})
        return json_response(s.body)

    async def input_tokens(self, request: Request) -> Response:
        """OpenAI's input token count of a Responses body (`POST /v1/responses/input_tokens`):
        its conversation (instructions, a stored previous response, tools) counted as `create`
        would prompt it, nothing generated."""
        req: ResponsesRequest = await self.front.decode_json(request, ResponsesRequest)
        degraded = Degraded()
        check(req, degraded)
        _, convo, tools, _ = conversation(req, self._previous(req), degraded)
        n = await self.front.system.count_prompt(await fitted(self.front, convo, degraded), None, True, tools)
        return json_response({"object": "response.input_tokens", "input_tokens": n})

    def _previous(self, req: ResponsesRequest) -> Stored | None:
        if req.previous_response_id is None:
            return None
        prev = self.store.find(req.previous_response_id, tenancy.current())
        if prev is None:
            raise HttpError(400, f"previous response {req.previous_response_id[:80]!r} is not stored "
                            "(never stored, store: false, or dropped from the store)",
                            "previous_response_not_found", "previous_response_id")
        return prev

    async def create(self, request: Request) -> Response:
        front = self.front
        req: ResponsesRequest = await front.decode_json(request, ResponsesRequest)
        turn = to_turn(req, request.headers, TurnContext.of(front), self._previous(req))
        chat = await fit(front, turn)
        mind, history, sealed = chat.mind, turn.history, turn.sealed
        openai_form = request.url.path.startswith("/v1/")
        rid = new_id("resp", "_")
        base = {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": req.model or front.model_id, "output": [], "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": chat.parallel_tool_calls, "tool_choice": chat.tool_choice,
            "tools": req.tools or [], "previous_response_id": req.previous_response_id, "store": req.store,
            "text": req.text if req.text is not None else {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": req.metadata or {}, "user": req.user, "error": None, "incomplete_details": None,
            "usage": None, "background": False,
        }

        def finish(result: Any, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
            body = from_result(base, result, cut_is_incomplete=openai_form, sealed=sealed, output=output)
            if req.store and result.completion.stop_reason != "cancelled":
                msgs = [*history, result.message]
                size = len(msgspec.json.encode(msgs)) + len(msgspec.json.encode(body))
                self.store.put(rid, Stored(mind=mind, messages=msgs, body=body, n_bytes=size,
                                                 tenant=tenancy.current()))
            return body

        async def run(on_token: Any) -> Any:
            result = await front.system.chat(chat, on_token=on_token)
            if turn.anonymous and mind is not None:
                with anyio.CancelScope(shield=True):  # the bound holds whether or not the client stays
                    await forget_past_bound(self.anonymous, front.system, mind, result.completion)
            return result

        return Generation(front, ResponsesAnswer(run, base, finish, chat.timings_per_token, sealed), stream=req.stream,
                          headers=turn.degraded.headers())
