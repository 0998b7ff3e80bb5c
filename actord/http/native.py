"""llama-server's native HTTP API, with the seed's page and gene verbs, on the same front.

A client or tool written for llama-server (or for the seeds' fork of it) talks to actord
unchanged: the routes, request fields, answer shapes and status codes are llama-server's
(tools/server in llama.cpp), and the seed's verbs are added where the fork put them.

Routes:
- `POST /completion` and `/completions` (llama-server serves both; `/v1/completions` is the
  OpenAI one): `prompt` (a string, token ids, ids mixed with strings, or several prompts),
  `n_predict` (`max_tokens`), `stream` (SSE `data:` chunks, the last one the whole result,
  no `[DONE]`, as llama-server), `id_slot`, `seed`, `temperature`, `top_k`, `top_p`, `stop`,
  `ignore_eos`, `lora`, `return_tokens`, `response_fields`; the answer has `content`,
  `tokens`, `id_slot`, `stop`, `stop_type`, `stopping_word`, `tokens_predicted`,
  `tokens_evaluated`, `tokens_cached`, `truncated`, `generation_settings`, `timings`.
- `POST /tokenize` (`content`, `add_special`, `parse_special`, `with_pieces`), `POST
  /detokenize` (`tokens`), `POST /apply-template` (`messages` -> `prompt`).
- `GET /props`: llama-server's shape, `slot_page_version: 1`, `lora_page_version: 1`, and
  actord's own props beside them.
- `GET /slots` (`?fail_on_no_slot=1`), `POST /slots/{id}?action=save|restore|erase`
  (`filename` in the body), and the seed's `?action=page_out&page=NAME`, `page_in`,
  `page_drop`, `spill` (`filename`/`file` and `drop` in the body).
- `GET /lora-adapters`, `POST /lora-adapters` (global scales: only what is set now), and the
  seed's `POST /lora-adapters/load {path}`, `/unload {id}`, `/page_out {id}`, `/page_in {id}`.
- `GET /health` (public), `GET /metrics`: actord's registry as it is, plus llama-server's
  `llamacpp:` series and the seed's series under that prefix, read from the same registry.

Errors are llama-server's object, `{"error": {"code": <status>, "message", "type"}}`, with
actord's typed error beside it (`error.actord`). The status is the error's own
`http_status` (actord.errors: 404 unknown page, slot or gene; 503 over the page ceiling or
device budget; 400 an empty slot; 409 a gene in use), except that a refused file or page
name is 400, as llama-server answers "Invalid filename".

Choices where llama-server and actord differ, stated:
- Sampling defaults are llama-server's where actord has the sampler (temperature 0.8, top_k
  40, top_p 0.95); llama-server's default min_p 0.05 is not applied (there is no min-p
  sampler). A field naming a sampler actord lacks (min_p, penalties, DRY, XTC, mirostat,
  typical_p, dynatemp, grammar, json_schema, logit_bias, n_probs, samplers, ...) is refused
  with a 400 naming it unless it asks for the neutral value, never ignored.
- `seed` absent: the daemon's `--seed` (reproducible); `-1` (or 4294967295): a fresh random
  seed, as llama-server's default does.
- `n_predict` absent: `--http-default-max-tokens` (the analogue of llama-server's `-n`);
  `-1`: until EOS, a stop, or the context is full.
- `cache_prompt` is ignored by design: a slot always reuses its cached prefix (llama-server's
  default); `false` would only re-decode the same tokens.
- The mind is the `X-Actord-Mind` header, as on the OpenAI routes; without one, like
  llama-server, the idle slot sharing the longest prefix serves the request.
- `POST /lora-adapters` (global scales) answers only a request that sets what is set now
  (the `--gene` adapters at 1, others at 0): actord's global genes are fixed at start.
  A request's `lora` list is honoured; an adapter it does not list is off for it, as in
  llama-server.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Awaitable, Callable

import anyio
import msgspec
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.api import CompletionRequest, CompletionResult
from actord.errors import ActordError, InvalidParams, PathRefused, PromptTooLong
from actord.http import app as A
from actord.http import openai as O
from actord.log import get
from actord.rpc.methods import METHODS

log = get("actord.http")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}

DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 0.8, 40, 0.95
_RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama-server's LLAMA_DEFAULT_SEED: "pick one"


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_status(e: ActordError) -> int:
    if isinstance(e, PathRefused):
        return 400  # llama-server: "Invalid filename"
    return e.http_status if 400 <= e.http_status < 600 else 500


def error_body(status: int, message: str, kind: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": status, "message": message, "type": kind or error_type(status), **extra}}


def error_object(e: A.HttpError | ActordError) -> tuple[int, dict[str, Any]]:
    if isinstance(e, ActordError):
        status = error_status(e)
        extra: dict[str, Any] = {"actord": e.to_dict()}
        kind = None
        if isinstance(e, PromptTooLong) and "n_ctx" in e.data and "n_prompt_tokens" in e.data:
            kind = "exceed_context_size_error"  # llama-server's, with its two numbers
            extra.update(n_prompt_tokens=e.data["n_prompt_tokens"], n_ctx=e.data["n_ctx"])
        return status, error_body(status, e.message, kind, **extra)
    return e.status, error_body(e.status, e.message, actord={"type": e.code, "message": e.message})


def error_response(e: A.HttpError | ActordError) -> Response:
    status, body = error_object(e)
    return A.json_response(body, status)


def _refuse(field: str, why: str) -> InvalidParams:
    return InvalidParams(f"unsupported parameter '{field}': {why}", param=field)


# -- /completion's fields ------------------------------------------------------------------


class LoraRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: int
    scale: float = 1.0


class CompletionBody(msgspec.Struct, kw_only=True, frozen=True):
    prompt: Any = None
    n_predict: int | None = None
    max_tokens: int | None = None  # llama-server reads it when n_predict is absent
    stream: bool = False
    cache_prompt: bool = True  # ignored by design (see the module docstring)
    id_slot: int = -1
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    return_tokens: bool = False
    response_fields: list[str] | None = None
    lora: list[LoraRef] | None = None
    # Refused unless they ask for the neutral value: typed Any so that the 400 names the
    # field whatever its value.
    min_p: Any = None
    repeat_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    dry_multiplier: Any = None
    xtc_probability: Any = None
    mirostat: Any = None
    typical_p: Any = None
    dynatemp_range: Any = None
    top_n_sigma: Any = None
    min_keep: Any = None
    grammar: Any = None
    json_schema: Any = None
    logit_bias: Any = None
    n_probs: Any = None
    post_sampling_probs: Any = None
    samplers: Any = None
    n_cmpl: Any = None
    n_indent: Any = None
    t_max_predict_ms: Any = None
    timings_per_token: Any = None
    return_progress: Any = None
    multimodal_data: Any = None


def _off(v: Any) -> bool:
    return v is None or v is False or (not isinstance(v, (list, dict, str)) and v == 0) or v in ([], {}, "")


_NEUTRAL: list[tuple[str, Callable[[Any], bool], str]] = [
    ("min_p", _off, "there is no min-p sampler"),
    ("repeat_penalty", lambda v: v is None or v == 1, "repetition penalties are not supported"),
    ("presence_penalty", _off, "repetition penalties are not supported"),
    ("frequency_penalty", _off, "repetition penalties are not supported"),
    ("dry_multiplier", _off, "the DRY sampler is not supported"),
    ("xtc_probability", _off, "the XTC sampler is not supported"),
    ("mirostat", _off, "mirostat is not supported"),
    ("typical_p", lambda v: v is None or v == 1, "locally typical sampling is not supported"),
    ("dynatemp_range", _off, "dynamic temperature is not supported"),
    ("top_n_sigma", lambda v: v is None or (isinstance(v, (int, float)) and v <= 0), "top-n-sigma is not supported"),
    ("min_keep", _off, "min_keep is not supported"),
    ("grammar", _off, "constrained decoding is not supported"),
    ("json_schema", lambda v: v is None, "constrained decoding is not supported"),
    ("logit_bias", _off, "logit biases are not supported"),
    ("n_probs", _off, "token probabilities are not supported"),
    ("post_sampling_probs", _off, "token probabilities are not supported"),
    ("samplers", lambda v: v is None, "the sampler order is fixed (top_k, top_p, temperature)"),
    ("n_cmpl", lambda v: v is None or v == 1, "one completion per prompt"),
    ("n_indent", _off, "indentation limits are not supported"),
    ("t_max_predict_ms", _off, "prediction time limits are not supported"),
    ("timings_per_token", _off, "timings come with the last chunk only"),
    ("return_progress", _off, "prompt progress is not reported"),
    ("multimodal_data", _off, "multimodal input is not supported"),
]


def refuse_unsupported(body: CompletionBody) -> None:
    for name, neutral, why in _NEUTRAL:
        if not neutral(getattr(body, name)):
            raise _refuse(name, why)


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def split_prompts(prompt: Any) -> list[str | list[int | str]]:
    """llama-server's prompt shapes: a string, token ids, ids mixed with strings (one
    prompt), or a list of those (several prompts)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, dict):
        raise _refuse("prompt", "prompt objects (multimodal_data) are not supported")
    if not isinstance(prompt, list) or not prompt:
        raise InvalidParams("prompt must be a string, token ids, or a list of those", param="prompt")
    if all(_is_token(x) or isinstance(x, str) for x in prompt) and any(_is_token(x) for x in prompt):
        return [prompt]  # one prompt: ids, or ids mixed with strings
    out: list[str | list[int | str]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p and all(_is_token(x) or isinstance(x, str) for x in p):
            out.append(p)
        elif isinstance(p, dict):
            raise _refuse(f"prompt[{i}]", "prompt objects (multimodal_data) are not supported")
        else:
            raise InvalidParams(f"prompt[{i}] must be a string or token ids", param=f"prompt[{i}]")
    return out


def stop_type(stop_reason: str) -> str:
    return {"eos": "eos", "stop": "word", "length": "limit", "context": "limit"}.get(stop_reason, "none")


def timings(r: CompletionResult) -> dict[str, Any]:
    t, n_gen, n_proc = r.timings, len(r.tokens), r.n_prompt_processed
    spec = {"draft_n": t.draft_n, "draft_n_accepted": t.draft_n_accepted} if t.draft_n else {}  # as llama-server
    return {
        "cache_n": r.n_cached,
        "prompt_n": n_proc,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": t.prompt_ms / n_proc if n_proc else 0.0,
        "prompt_per_second": t.prompt_per_second,
        "predicted_n": n_gen,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": t.predicted_ms / n_gen if n_gen else 0.0,
        "predicted_per_second": t.predicted_per_second,
        **spec,
    }


def nested_fields(paths: list[str], obj: dict[str, Any]) -> dict[str, Any]:
    """llama-server's `response_fields`: each path ("a/b") that exists, under its own name."""
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = obj
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


def llama_metrics(system: Any) -> str:
    """llama-server's series (`llamacpp:`), and the seed's under that prefix, read from the
    one registry at scrape time; no second registry, no second count."""
    reg = system.metrics.registry

    def v(name: str) -> float:
        x = reg.get_sample_value(name)
        return 0.0 if x is None else float(x)

    deferred = float(sum(s.deferred_count() for s in getattr(system, "slots", [])))
    series: list[tuple[str, str, str, float]] = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens",
         v("prompt_tokens_processed_total")),
        ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache",
         v("prompt_tokens_total") - v("prompt_tokens_processed_total")),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed", v("predicted_tokens_total")),
        ("n_decode_total", "counter", "Total number of llama_decode() calls", v("engine_steps_total")),
        ("requests_processing", "gauge", "Number of requests processing", v("requests_in_flight")),
        ("requests_deferred", "gauge", "Number of requests deferred", deferred),
        ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated",
         v("spec_decode_num_draft_tokens_total")),
        ("spec_decode_num_accepted_tokens_total", "counter",
         "Speculative: Total draft tokens accepted by the target model", v("spec_decode_num_accepted_tokens_total")),
        ("spec_decode_num_drafts_total", "counter", "Speculative: Total speculative decoding verification steps",
         v("spec_decode_num_drafts_total")),
    ]
    for name, kind in SEED_SERIES:
        family = name[: -len("_total")] if kind == "counter" else name
        doc = next((f.documentation for f in reg.collect() if f.name == family), name)
        series.append((name, kind, doc, v(name)))
    lines = []
    for name, kind, doc, value in series:
        lines += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}",
                  f"llamacpp:{name} {floatToGoString(value)}"]
    return "\n".join(lines) + "\n"


SEED_SERIES: list[tuple[str, str]] = [
    ("page_store_bytes", "gauge"), ("page_store_pages", "gauge"), ("ctx_checkpoint_bytes", "gauge"),
    ("page_out_total", "counter"), ("page_in_total", "counter"), ("page_failed_total", "counter"),
    ("ctx_checkpoints_evicted_budget_total", "counter"), ("ctx_checkpoints_skipped_budget_total", "counter"),
    ("lora_page_out_total", "counter"), ("lora_page_in_total", "counter"),
    ("lora_page_in_on_demand_total", "counter"), ("lora_page_failed_total", "counter"),
    ("lora_device_bytes", "gauge"), ("lora_host_bytes", "gauge"),
]


# -- a generation in the response ------------------------------------------------------------


Job = Callable[[Any], Awaitable[CompletionResult]]
Finish = Callable[[int, CompletionResult], Awaitable[dict[str, Any]]]


class _Completion(Response):
    """Runs the completions inside the response, so a client that hangs up cancels them
    (as `app._Generation` does for the OpenAI routes), and answers llama-server's way: one
    object (or an array, for several prompts), or SSE chunks whose last is the result."""

    def __init__(self, front: Any, jobs: list[Job], finish: Finish, *, stream: bool) -> None:
        self.front, self.jobs, self.finish, self.stream = front, jobs, finish, stream
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.stream:
            await self._streamed(scope, receive, send)
        else:
            await self._whole(scope, receive, send)

    async def _run(self, job: Job, on_token: Any) -> CompletionResult:
        try:
            return await job(on_token)
        except ActordError:
            raise
        except Exception as e:  # a bug in one request must not take down its peers
            log.exception("http.internal_error", error=repr(e))
            raise A.HttpError(500, f"internal error: {type(e).__name__}", "internal_error") from None

    async def _all(self) -> Any:
        results: list[CompletionResult | None] = [None] * len(self.jobs)
        errors: list[BaseException] = []
        async with anyio.create_task_group() as tg:
            for i, job in enumerate(self.jobs):
                async def one(i: int = i, job: Job = job) -> None:
                    try:
                        results[i] = await self._run(job, None)
                    except (ActordError, A.HttpError) as e:
                        errors.append(e)
                        tg.cancel_scope.cancel()  # one fails, the request fails: the rest stop

                tg.start_soon(one)
        if errors:
            raise errors[0]
        bodies = [await self.finish(i, r) for i, r in enumerate(results) if r is not None]
        return bodies[0] if len(bodies) == 1 else bodies

    async def _whole(self, scope: Any, receive: Any, send: Any) -> None:
        outcome: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            async def work() -> None:
                try:
                    outcome["result"] = await self._all()
                except (ActordError, A.HttpError) as e:
                    outcome["error"] = e
                finally:
                    tg.cancel_scope.cancel()

            tg.start_soon(work)
            await A._until_disconnect(receive)
            if not outcome:
                self.front.client_gone("generation", stream=False)
            tg.cancel_scope.cancel()
        if "error" in outcome:
            response = error_response(outcome["error"])
        elif "result" in outcome:
            response = A.json_response(outcome["result"])
        else:
            return  # the client went away: nobody to answer
        await response(scope, receive, send)

    async def _streamed(self, scope: Any, receive: Any, send: Any) -> None:
        job = self.jobs[0]
        tx, rx = anyio.create_memory_object_stream[tuple[str, Any]](A.OUTBOX)
        finished = False  # from then on, http.disconnect is the end of the answer
        n_predicted = 0

        async with anyio.create_task_group() as tg:
            def on_token(chunk: dict[str, Any]) -> None:
                nonlocal n_predicted
                n_predicted += len(chunk.get("tokens", ()))
                partial = {"index": 0, "content": chunk["content"], "tokens": list(chunk.get("tokens", ())),
                           "stop": False, "id_slot": chunk.get("slot", -1), "tokens_predicted": n_predicted}
                try:
                    tx.send_nowait(("data", A._sse(partial)))
                except anyio.WouldBlock:
                    log.warning("http.client_too_slow")
                    tg.cancel_scope.cancel()
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass

            async def work() -> None:
                async with tx:
                    try:
                        r = await self._run(job, on_token)
                        last = await self.finish(0, r)
                    except (ActordError, A.HttpError) as e:
                        await tx.send(("error", e))
                        return
                    await tx.send(("data", A._sse(last)))

            async def watch() -> None:
                await A._until_disconnect(receive)
                if not finished:
                    self.front.client_gone("generation", stream=True)
                    tg.cancel_scope.cancel()

            tg.start_soon(work)
            tg.start_soon(watch)
            started = False
            async with rx:
                async for kind, payload in rx:
                    if not started:
                        if kind == "error":  # before the first chunk: still an HTTP status
                            finished = True
                            await error_response(payload)(scope, receive, send)
                            break
                        await send({"type": "http.response.start", "status": 200, "headers": A._SSE_HEADERS})
                        started = True
                    if kind == "error":
                        payload = A._sse(error_object(payload)[1])
                    else:  # what queued while the last write was under way goes in one write
                        while True:
                            try:
                                more_kind, more = rx.receive_nowait()
                            except (anyio.WouldBlock, anyio.EndOfStream):
                                break
                            if more_kind != "data":
                                payload += A._sse(error_object(more)[1])
                                break
                            payload += more
                    await send({"type": "http.response.body", "body": payload, "more_body": True})
                else:
                    if started:
                        finished = True
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
            tg.cancel_scope.cancel()


# -- the routes ----------------------------------------------------------------------------------


class Native:
    def __init__(self, front: Any) -> None:
        self.front = front

    @property
    def system(self) -> Any:
        return self.front.system

    @property
    def config(self) -> Any:
        return self.front.config

    def routes(self) -> list[Route]:
        g = self._guard
        completion = g(self.completion)
        return [
            Route("/completion", completion, methods=["POST"]),
            Route("/completions", completion, methods=["POST"]),
            Route("/tokenize", g(self.tokenize), methods=["POST"]),
            Route("/detokenize", g(self.detokenize), methods=["POST"]),
            Route("/apply-template", g(self.apply_template), methods=["POST"]),
            Route("/props", g(self.props), methods=["GET"]),
            Route("/slots", g(self.slots), methods=["GET"]),
            Route("/slots/{id_slot}", g(self.slot_action), methods=["POST"]),
            Route("/lora-adapters", g(self.lora_adapters), methods=["GET"]),
            Route("/lora-adapters", g(self.lora_scales), methods=["POST"]),
            Route("/lora-adapters/{verb}", g(self.lora_verb), methods=["POST"]),
            Route("/health", g(self.health, public=True), methods=["GET"]),
            Route("/v1/health", g(self.health, public=True), methods=["GET"]),
            Route("/metrics", g(self.metrics), methods=["GET"]),
        ]

    def _guard(self, endpoint: Callable[[Request], Awaitable[Response]], *,
               public: bool = False) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            try:
                if not public:
                    self.front._authorize(request)
                return await endpoint(request)
            except A._ClientGone as e:
                self.front.client_gone(e.phase)
                return A._Silent()
            except (A.HttpError, ActordError) as e:
                return error_response(e)
        return guarded

    async def _json(self, request: Request) -> Any:
        """The body as JSON (an empty body is `{}`: llama-server's erase sends none)."""
        raw = await self.front.read_body(request)
        if not raw.strip():
            return {}
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as e:
            raise A.HttpError(400, f"malformed JSON: {e}", "invalid_json") from None

    async def _decode(self, request: Request, typ: type) -> Any:
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        return self._convert(obj, typ)

    @staticmethod
    def _convert(obj: Any, typ: type) -> Any:
        try:
            return msgspec.convert(obj, typ)
        except msgspec.ValidationError as e:
            raise InvalidParams(f"invalid request: {e}") from None

    async def _call(self, method: str, params: dict[str, Any]) -> Any:
        """A JSON-RPC verb, with its own parameter checks (actord/rpc/methods.py)."""
        m = METHODS[method]
        return await m.call(self.system, self._convert(params, m.params), None)

    # -- /completion ---------------------------------------------------------------------

    def _mind(self, request: Request) -> str | None:
        return request.headers.get("x-actord-mind") or None

    async def _default_genes(self) -> set[int]:
        residency = getattr(self.system, "residency", None)
        return {g.id for g in getattr(residency, "genes", {}).values() if g.default}

    def generation_defaults(self) -> dict[str, Any]:
        """What a /completion naming nothing gets (llama-server's `params` shape)."""
        return {
            "n_predict": min(self.config.http_default_max_tokens, self.system.props.n_ctx),
            "seed": self.config.seed, "temperature": DEFAULT_TEMPERATURE, "top_k": DEFAULT_TOP_K,
            "top_p": DEFAULT_TOP_P, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "mirostat": 0, "stop": [],
            "ignore_eos": False, "stream": False, "n_probs": 0, "grammar": "",
            "samplers": ["top_k", "top_p", "temperature"], "lora": [],
        }

    async def completion(self, request: Request) -> Response:
        body: CompletionBody = await self._decode(request, CompletionBody)
        if body.prompt is None:
            raise InvalidParams('"prompt" is required', param="prompt")
        refuse_unsupported(body)
        prompts = split_prompts(body.prompt)
        if len(prompts) > 1 and body.stream:
            raise _refuse("prompt", "several prompts are answered whole: send stream=false, or one prompt")
        if len(prompts) > self.config.max_requests_in_flight:
            raise InvalidParams(f"{len(prompts)} prompts, at most {self.config.max_requests_in_flight}",
                                param="prompt")
        n_ctx = self.system.props.n_ctx
        n = body.n_predict if body.n_predict is not None else body.max_tokens
        if n is None:
            n = min(self.config.http_default_max_tokens, n_ctx)
        elif n == -1:
            n = n_ctx  # until EOS, a stop, or the context is full
        elif n < -1:
            raise InvalidParams(f"n_predict must be >= -1, got {n}", param="n_predict")
        temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
        if not math.isfinite(temperature):
            raise InvalidParams("temperature must be finite", param="temperature")
        temperature = max(0.0, temperature)  # llama-server: <= 0 is greedy
        top_k = DEFAULT_TOP_K if body.top_k is None else max(0, body.top_k)  # <= 0: off
        top_p = DEFAULT_TOP_P if body.top_p is None else body.top_p
        if not math.isfinite(top_p):
            raise InvalidParams("top_p must be finite", param="top_p")
        if top_p <= 0:
            temperature, top_p = 0.0, 1.0  # keeps the one most likely token: greedy
        top_p = min(top_p, 1.0)
        seed = body.seed
        if seed in _RANDOM_SEEDS:
            seed = secrets.randbelow(0xFFFFFFFF)
        elif seed is not None and not 0 <= seed < 0xFFFFFFFF:
            raise InvalidParams(f"seed must be -1 or in [0, 2^32 - 1), got {seed}", param="seed")
        genes: list[dict[str, Any]] = []
        if body.lora is not None:
            listed = {g.id: g.scale for g in body.lora}
            if len(listed) != len(body.lora):
                raise InvalidParams("an adapter is listed twice in lora", param="lora")
            # As llama-server: an adapter the request does not list is off for it.
            off = {gid: 0.0 for gid in await self._default_genes() if gid not in listed}
            genes = [{"id": g, "scale": s} for g, s in sorted({**off, **listed}.items())]
        stops = O.stops(body.stop)
        slot = body.id_slot if body.id_slot >= 0 else None
        mind = self._mind(request)
        reqs = []
        for p in prompts:
            prompt: str | list[int] = p if isinstance(p, str) else await self._mixed(p)
            try:
                reqs.append(msgspec.convert(dict(
                    prompt=prompt, n_predict=n, slot=slot, mind=mind, temperature=temperature, top_k=top_k,
                    top_p=top_p, seed=seed, stop=stops, ignore_eos=body.ignore_eos, stream=body.stream,
                    genes=genes), CompletionRequest).check(self.config.request_limits()))
            except msgspec.ValidationError as e:
                raise InvalidParams(f"invalid request: {e}") from None
        settings = {
            **self.generation_defaults(), "n_predict": n, "seed": self.config.seed if seed is None else seed,
            "temperature": temperature, "top_k": top_k, "top_p": top_p, "stop": stops, "ignore_eos": body.ignore_eos,
            "stream": body.stream, "lora": genes, "id_slot": body.id_slot, "mind": mind, "n_ctx": n_ctx,
        }
        system = self.system

        def job(req: CompletionRequest) -> Job:
            async def run(on_token: Any) -> CompletionResult:
                return await system.complete(req, on_token=on_token)
            return run

        async def finish(i: int, r: CompletionResult) -> dict[str, Any]:
            return await self._result(i, r, reqs[i], prompts[i], body, settings)

        return _Completion(self.front, [job(r) for r in reqs], finish, stream=body.stream)

    async def _mixed(self, prompt: list[int | str]) -> list[int]:
        """Token ids mixed with strings: each string tokenized in place; a leading string
        gets the model's BOS (llama-server's tokenize_mixed)."""
        if all(_is_token(x) for x in prompt):
            return list(prompt)  # type: ignore[arg-type]
        out: list[int] = []
        for i, x in enumerate(prompt):
            if isinstance(x, str):
                out += (await self._call("tokenize", {"content": x, "add_special": i == 0}))["tokens"]
            else:
                out.append(x)
        return out

    async def _result(self, i: int, r: CompletionResult, req: CompletionRequest, prompt: Any,
                      body: CompletionBody, settings: dict[str, Any]) -> dict[str, Any]:
        stopping_word = ""
        if r.stop_reason == "stop" and req.stop:
            if len(req.stop) == 1:
                stopping_word = req.stop[0]
            else:  # the generated text goes on, past the content, with the stop that matched
                full = (await self._call("detokenize", {"tokens": r.tokens}))["content"]
                rest = full[len(r.content):] if full.startswith(r.content) else ""
                stopping_word = next((s for s in sorted(req.stop, key=len, reverse=True) if rest.startswith(s)),
                                     "")
        fields = body.response_fields
        if isinstance(prompt, str):
            prompt_text = prompt
        elif fields is not None and "prompt" not in fields:
            prompt_text = ""
        else:
            prompt_text = (await self._call("detokenize", {"tokens": list(req.prompt)}))["content"]
        n_gen = len(r.tokens)
        out = {
            "index": i,
            "content": "" if body.stream else r.content,
            "tokens": [] if body.stream or not body.return_tokens else list(r.tokens),
            "id_slot": r.slot,
            "stop": True,
            "model": self.front.model_id,
            "tokens_predicted": n_gen,
            "tokens_evaluated": r.n_prompt_tokens,
            "generation_settings": settings,
            "prompt": prompt_text,
            "has_new_line": "\n" in r.content,
            "truncated": r.stop_reason == "context",
            "stop_type": stop_type(r.stop_reason),
            "stopping_word": stopping_word,
            # What the slot's cache holds after the request: the prompt and the generated
            # tokens but the last sampled one, which is never decoded.
            "tokens_cached": r.n_prompt_tokens + max(0, n_gen - 1),
            "timings": timings(r),
            "stop_reason": r.stop_reason,  # actord's own words, beside stop_type
            "resumed_from_checkpoint": r.resumed_from_checkpoint,
        }
        return out if fields is None else nested_fields(fields, out)

    # -- text ------------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        content = obj.get("content")
        if content is None:
            return A.json_response({"tokens": []})  # llama-server: no content, no tokens
        if isinstance(content, list):  # llama-server tokenizes a mixed list too
            tokens = await self._mixed(self._convert(content, list[int | str]))
            return A.json_response({"tokens": tokens})
        params = {k: obj[k] for k in ("content", "add_special", "parse_special", "with_pieces") if k in obj}
        return A.json_response(await self._call("tokenize", params))

    async def detokenize(self, request: Request) -> Response:
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        if "tokens" not in obj:
            return A.json_response({"content": ""})
        return A.json_response(await self._call("detokenize", {"tokens": obj["tokens"]}))

    async def apply_template(self, request: Request) -> Response:
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        if "messages" not in obj:
            raise InvalidParams('"messages" is required', param="messages")
        if obj.get("tools"):
            raise _refuse("tools", "tool calling is not supported")
        msgs = self._convert(obj["messages"], list[O.Message])
        if not msgs:
            raise InvalidParams("messages is empty", param="messages")
        developer = any(m.role == "developer" for m in msgs) and await self.front._template_names_developer()
        messages = [msgspec.to_builtins(m) for m in O.chat_messages(msgs, developer_is_system=not developer)]
        params: dict[str, Any] = {"messages": messages}
        if "add_generation_prompt" in obj:
            params["add_generation_prompt"] = obj["add_generation_prompt"]
        return A.json_response(await self._call("apply_template", params))

    # -- props, slots ----------------------------------------------------------------------

    async def props(self, request: Request) -> Response:
        system, config = self.system, self.config
        actord = await system.props_dict()
        tpl = await self._call("chat.template", {})
        out = {
            **actord,
            "default_generation_settings": {
                "id": 0, "id_task": -1, "n_ctx": system.props.n_ctx, "speculative": False,
                "is_processing": False, "params": self.generation_defaults(),
            },
            "total_slots": len(system.slots),
            "model_alias": self.front.model_id,
            "model_path": config.model,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
            "chat_template": tpl["template"] or "",
            "chat_template_caps": {},
            "bos_token": tpl["bos_token"], "eos_token": tpl["eos_token"],
            "build_info": f"actord {A._version()}",
            "is_sleeping": False,
            "slot_page_version": 1, "lora_page_version": 1,
        }
        return A.json_response(out)

    async def slots(self, request: Request) -> Response:
        infos = await self.system.slot_list()
        n_ctx = self.system.props.n_ctx
        out = [{"id": i.id, "id_task": -1, "n_ctx": n_ctx, "speculative": False,
                "is_processing": i.state == "processing", **msgspec.to_builtins(i)} for i in infos]
        if request.query_params.get("fail_on_no_slot") and not any(i.state == "idle" for i in infos):
            raise A.HttpError(503, "no slot available", "unavailable")
        return A.json_response(out)

    async def slot_action(self, request: Request) -> Response:
        try:
            slot = int(request.path_params["id_slot"])
        except ValueError:
            raise InvalidParams("Invalid slot ID", param="id_slot") from None
        action = request.query_params.get("action", "")
        if action not in ("save", "restore", "erase", "page_out", "page_in", "page_drop", "spill"):
            raise InvalidParams(f"Invalid action {action[:64]!r}: one of save, restore, erase, page_out, "
                                "page_in, page_drop, spill", param="action")
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")

        def field(name: str, *, query: bool = False, alias: str | None = None) -> Any:
            vals = [v for v in ((obj.get(name) if name in obj else None),
                                (obj.get(alias) if alias and alias in obj else None),
                                (request.query_params.get(name) if query else None)) if v is not None]
            if not vals:
                raise InvalidParams(f'"{name}" is required for action={action}', param=name)
            if any(v != vals[0] for v in vals):
                raise InvalidParams(f'"{name}" is given twice, with different values', param=name)
            return vals[0]

        if action == "erase":
            held = next((i.n_tokens for i in await self.system.slot_list() if i.id == slot), 0)
            await self._call("slot.erase", {"slot": slot})
            return A.json_response({"id_slot": slot, "n_erased": held, "erased": True})
        if action in ("save", "restore"):
            filename = field("filename", alias="file")
            r = await self._call(f"slot.{action}", {"slot": slot, "file": filename})
            if action == "save":
                shaped = {"n_saved": r["n_tokens"], "n_written": r["n_bytes"], "timings": {"save_ms": r["t_ms"]}}
            else:
                shaped = {"n_restored": r["n_tokens"], "n_read": r["n_bytes"], "timings": {"restore_ms": r["t_ms"]}}
            return A.json_response({"id_slot": slot, "filename": filename, **shaped, **r})
        page = field("page", query=True)
        if action in ("page_out", "page_in"):
            r = await self._call(f"page.{action[5:]}", {"slot": slot, "page": page})
            return A.json_response({"id_slot": slot, **r, "timings": {f"{action}_ms": r["t_ms"]}})
        if action == "page_drop":
            r = await self._call("page.drop", {"page": page})
            return A.json_response({"id_slot": slot, **r, "dropped": True})
        drop = obj.get("drop", request.query_params.get("drop", False))
        if isinstance(drop, str):
            drop = drop.lower() in ("1", "true", "yes")
        r = await self._call("page.spill", {"page": page, "file": field("filename", alias="file"), "drop": drop})
        return A.json_response({"id_slot": slot, "filename": r["file"], **r, "timings": {"spill_ms": r["t_ms"]}})

    # -- LoRA adapters (genes) ---------------------------------------------------------

    async def _genes(self) -> list[dict[str, Any]]:
        defaults = await self._default_genes()
        return [{"id": g["id"], "path": g["path"], "scale": 1.0 if g["id"] in defaults else 0.0,
                 "task_name": "", "prompt_prefix": "", "resident": g["resident"], "n_bytes": g["n_bytes"],
                 "default": g["id"] in defaults} for g in await self._call("gene.list", {})]

    async def lora_adapters(self, request: Request) -> Response:
        return A.json_response(await self._genes())

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
            raise A.HttpError(501, "global adapter scales are fixed at start (the --gene adapters at 1, the "
                                   "others at 0): set a request's own with its \"lora\" field", "not_supported")
        return A.json_response({"success": True})

    async def lora_verb(self, request: Request) -> Response:
        verb = request.path_params["verb"]
        if verb not in ("load", "unload", "page_out", "page_in"):
            raise A.HttpError(404, f"no route POST /lora-adapters/{verb[:64]} (load, unload, page_out, page_in)",
                              "not_found")
        obj = await self._json(request)
        if not isinstance(obj, dict):
            raise InvalidParams("the request body must be a JSON object")
        if verb == "load":
            if "path" not in obj:
                raise InvalidParams('"path" is required', param="path")
            r = await self._call("gene.load", {"path": obj["path"]})
        else:
            if "id" not in obj:
                raise InvalidParams('"id" is required', param="id")
            r = await self._call(f"gene.{verb}", {"id": obj["id"]})
        return A.json_response({"success": True, **r} if verb == "unload" else r)

    # -- health, metrics -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.system is None:
            return A.json_response(error_body(503, "Loading model"), 503)
        h = await self.system.health()
        if getattr(self.system, "closing", False):
            return A.json_response({**error_body(503, "shutting down"), **h, "status": "shutting_down"}, 503)
        if h["status"] != "ok":
            why = f"actors failed: {', '.join(h['failed_actors'])}"
            return A.json_response({**error_body(503, why), **h}, 503)
        return A.json_response(h)

    async def metrics(self, request: Request) -> Response:
        text = self.system.metrics_text() + llama_metrics(self.system)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
