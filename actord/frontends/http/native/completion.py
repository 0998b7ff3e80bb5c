"""llama-server's /completion (and /completions) on actord's completions.

Why a module of its own: this is the native API's one generating route, and the larger part
of it: llama-server's request fields (`CompletionBody`), the line between what is honoured
and what is refused (`_NEUTRAL`), its prompt shapes, its answer (`NativeAnswer`, run by
`streaming.Generation` like the OpenAI routes' answers) and result object (`from_result`,
pure, as each chat API's wire has its own). Its length fallback is the chat APIs'
(actord/chat/defaults.py); its sampling defaults are llama-server's (`sampling.py`).

Fields: `prompt` (a string, token ids, ids mixed with strings, a `{prompt_string}` object,
or several prompts; echoed in the answer as evaluated: detokenized, BOS included),
`n_predict` (`max_tokens`), `stream` (SSE `data:` chunks, the last one the whole result,
no `[DONE]`, as llama-server), `id_slot`, `stop`, `ignore_eos`, `lora`, `return_tokens`,
`response_fields` (none listed: every field), `return_progress` (streamed: a chunk per
decoded piece of the prompt, with `prompt_progress` {total, cache, processed, time_ms}, the
first before any is decoded), `timings_per_token` (streamed: each chunk with its `timings`
so far), `n_cmpl` (alias `n`: completions per prompt, 1 to `--max-n`, from one
prefill, completion j seeded seed + j: actord/chat/choices.py), and the sampling fields, with llama-server's defaults
(`sampling.py`: `seed`, `temperature`, `top_k`, `top_p`, `min_p`, `repeat_penalty`,
`repeat_last_n`, `presence_penalty`, `frequency_penalty`, `grammar`, `json_schema`,
`logit_bias`, `n_probs`); the answer has `content`, `tokens`, `id_slot`, `stop`,
`stop_type`, `stopping_word`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached`,
`truncated`, `generation_settings`, `timings`, and `completion_probabilities` when
`n_probs` asks for them.

Choices where llama-server and actord differ, stated:
- A field naming a sampler or feature actord lacks (DRY, XTC, mirostat, typical_p,
  dynatemp, top_n_sigma, min_keep, samplers, n_indent,
  t_max_predict_ms, multimodal data) is refused with a
  400 naming it unless it asks for the neutral value, never ignored (`_NEUTRAL`).
- `seed` absent: the daemon's `--seed` (reproducible); `-1` (or 4294967295): a fresh random
  seed, as llama-server's default does.
- `n_predict` absent: `--http-default-max-tokens` (the analogue of llama-server's `-n`);
  `-1`: until EOS, a stop, or the context is full.
- `cache_prompt` (default true) reuses a slot's cached prefix, as llama-server's default.
  `false` reuses no cells: each prompt is decoded whole under a scope of its own (a one-off
  `cache_salt`), so the same request gives the same logits bit for bit (a reused prefix
  decodes the prompt's last token alone, which rounds differently on some kernels). With a
  mind it is a 400: a mind's turn resumes her own cells.
- The mind is the `X-Actord-Mind` header, as on the OpenAI routes; without one, like
  llama-server, the idle slot sharing the longest prefix serves the request.
- A request's `lora` list is honoured; an adapter it does not list is off for it, as in
  llama-server.
"""

from __future__ import annotations

import secrets
from typing import Any, Awaitable, Callable

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.vocabulary.types import CompletionRequest, CompletionResult
from actord.vocabulary.kv_identity import ONE_OFF_SALT
from actord.chat.choices import check_n
from actord.chat.defaults import max_tokens
from actord.engine.grammar import compiled
from actord.service.slot_ctx import slot_n_ctx
from actord.vocabulary.errors import ActordError, InvalidParams
from actord.frontends.http.native import sampling as S
from actord.frontends.http.openai import wire as O
from actord.frontends.http.openai.answers import llama_timings as timings
from actord.frontends.http.native.base import LoraRef, NativeRoutes, error_object, is_token, unsupported
from actord.frontends.http.responses import HttpError, stopping_word as stopping_word_of
from actord.frontends.http.streaming import Generation, guarded



# -- the request ---------------------------------------------------------------------------------


class CompletionBody(msgspec.Struct, kw_only=True, frozen=True):
    prompt: Any = None
    cache_salt: str | None = None  # vLLM's: reuse of cells only with requests of the same salt
    n_predict: int | None = None
    max_tokens: int | None = None  # llama-server reads it when n_predict is absent
    stream: bool = False
    cache_prompt: bool = True  # false: no reuse (`one_off_salts`)
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
    # Sampling (native_sampling), typed Any so that a bad value's 400 names the field.
    min_p: Any = None
    repeat_penalty: Any = None
    repeat_last_n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    grammar: Any = None
    json_schema: Any = None
    logit_bias: Any = None
    n_probs: Any = None
    logprobs: Any = None  # llama-server's alias of n_probs, read when n_probs is absent
    # Refused unless they ask for the neutral value: typed Any so that the 400 names the
    # field whatever its value.
    dry_multiplier: Any = None
    xtc_probability: Any = None
    mirostat: Any = None
    typical_p: Any = None
    dynatemp_range: Any = None
    top_n_sigma: Any = None
    min_keep: Any = None
    post_sampling_probs: bool = False  # with n_probs: probabilities after the sampler chain
    samplers: Any = None
    n_cmpl: Any = None  # completions per prompt (llama-server's; `n` is its alias): actord/chat/choices.py
    n: Any = None
    n_indent: Any = None
    t_max_predict_ms: Any = None
    timings_per_token: bool = False  # streamed: every chunk with the timings so far
    return_progress: bool = False  # streamed: a chunk per decoded piece of the prompt
    multimodal_data: Any = None


def _off(v: Any) -> bool:
    return v is None or v is False or (not isinstance(v, (list, dict, str)) and v == 0) or v in ([], {}, "")


_NEUTRAL: list[tuple[str, Callable[[Any], bool], str]] = [
    ("dry_multiplier", _off, "the DRY sampler is not supported"),
    ("xtc_probability", _off, "the XTC sampler is not supported"),
    ("mirostat", _off, "mirostat is not supported"),
    ("typical_p", lambda v: v is None or v == 1, "locally typical sampling is not supported"),
    ("dynatemp_range", _off, "dynamic temperature is not supported"),
    ("top_n_sigma", lambda v: v is None or (isinstance(v, (int, float)) and v <= 0), "top-n-sigma is not supported"),
    ("min_keep", _off, "min_keep is not supported"),
    ("samplers", lambda v: v is None, f"the sampler order is fixed ({', '.join(S.SAMPLERS)})"),
    ("n_indent", _off, "indentation limits are not supported"),
    ("t_max_predict_ms", _off, "prediction time limits are not supported"),
    ("multimodal_data", _off, "multimodal input is not supported"),
]


def refuse_unsupported(body: CompletionBody) -> None:
    for name, neutral, why in _NEUTRAL:
        if not neutral(getattr(body, name)):
            raise unsupported(name, why)


def one_off_salts(body: CompletionBody, mind: str | None, n: int) -> list[str | None]:
    """Each of `n` prompts' cache_salt. `cache_prompt: false` gives each a fresh scope of its
    own, so nothing cached is reused (not another prompt's of the same request either), and
    what it leaves in a slot is reused by no later request."""
    if body.cache_prompt:
        return [body.cache_salt] * n
    if mind is not None:
        raise InvalidParams("cache_prompt false decodes the prompt afresh, and a mind's turn resumes her own "
                            "cells: leave out one of the two", param="cache_prompt")
    return [f"{ONE_OFF_SALT}{secrets.token_hex(8)}" for _ in range(n)]


def split_prompts(prompt: Any) -> list[str | list[int | str]]:
    """llama-server's prompt shapes: a string, token ids, ids mixed with strings (one
    prompt), or a list of those (several prompts)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, dict):
        return [_prompt_object(prompt, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidParams("prompt must be a string, token ids, or a list of those", param="prompt")
    if all(is_token(x) or isinstance(x, str) for x in prompt) and any(is_token(x) for x in prompt):
        return [prompt]  # one prompt: ids, or ids mixed with strings
    out: list[str | list[int | str]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p and all(is_token(x) or isinstance(x, str) for x in p):
            out.append(p)
        elif isinstance(p, dict):
            out.append(_prompt_object(p, f"prompt[{i}]"))
        else:
            raise InvalidParams(f"prompt[{i}] must be a string or token ids", param=f"prompt[{i}]")
    return out


def _prompt_object(obj: dict[str, Any], param: str) -> str:
    """llama-server's prompt object: its `prompt_string` (with `multimodal_data`: refused)."""
    if obj.get("multimodal_data"):
        raise unsupported(param, "prompt objects with multimodal_data are not supported (text only)")
    text = obj.get("prompt_string")
    if not isinstance(text, str):
        raise InvalidParams(f"{param} is a prompt object with a prompt_string", param=param)
    return text


def stop_type(stop_reason: str) -> str:
    return {"eos": "eos", "stop": "word", "length": "limit", "context": "limit"}.get(stop_reason, "none")


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


def generation_defaults(config: Any, n_ctx: int) -> dict[str, Any]:
    """What a /completion naming nothing gets (llama-server's `params` shape)."""
    return {"n_predict": max_tokens(config, n_ctx), **S.defaults(config.seed), "stop": [],
            "ignore_eos": False, "stream": False, "lora": []}


# -- the answer (run by streaming.Generation) ------------------------------------------------------


Job = Callable[[Any], Awaitable[list[CompletionResult]]]  # one prompt's n_cmpl results
Finish = Callable[[int, int, CompletionResult], Awaitable[dict[str, Any]]]  # (index, prompt, result)


class NativeAnswer:
    """llama-server's framing of a completion (`streaming.Answer`): one object (or an
    array, for several prompts or `n_cmpl` > 1, run side by side: one fails, the request
    fails; result k*n_cmpl + j is prompt k's completion j, by `index`, as llama-server
    numbers them); streamed, SSE chunks with the text and tokens so far, each with its
    `index`, whose last ones are the whole results, and no `[DONE]`."""

    done = b""
    error_object = staticmethod(error_object)

    def __init__(self, jobs: list[Job], finish: Finish, post: bool = False) -> None:
        self.jobs, self.finish, self.post = jobs, finish, post  # post: post_sampling_probs' shape
        self.n_predicted: dict[int, int] = {}

    @classmethod
    def response(cls, front: Any, jobs: list[Job], finish: Finish, *, stream: bool, post: bool = False) -> Generation:
        return Generation(front, cls(jobs, finish, post), stream=stream)

    async def whole(self) -> Any:
        results: list[list[CompletionResult] | None] = [None] * len(self.jobs)
        errors: list[BaseException] = []
        async with anyio.create_task_group() as tg:
            for i, job in enumerate(self.jobs):
                async def one(i: int = i, job: Job = job) -> None:
                    try:
                        results[i] = await guarded(lambda: job(None))
                    except (ActordError, HttpError) as e:
                        errors.append(e)
                        tg.cancel_scope.cancel()  # one fails, the request fails: the rest stop

                tg.start_soon(one)
        if errors:
            raise errors[0]
        flat = [(k, r) for k, rs in enumerate(results) for r in rs or []]
        bodies = [await self.finish(i, k, r) for i, (k, r) in enumerate(flat)]
        return bodies[0] if len(bodies) == 1 else bodies

    async def streamed(self, on_token: Any) -> list[Any]:
        rs = await self.jobs[0](on_token)
        return [await self.finish(i, 0, r) for i, r in enumerate(rs)]

    def first(self) -> Any | None:
        return None

    def chunk(self, chunk: dict[str, Any]) -> Any:
        i = chunk.get("index", 0)
        self.n_predicted[i] = self.n_predicted.get(i, 0) + len(chunk.get("tokens", ()))
        out = {"index": i, "content": chunk["content"], "tokens": list(chunk.get("tokens", ())),
               "stop": False, "id_slot": chunk.get("slot", -1), "tokens_predicted": self.n_predicted[i]}
        if chunk.get("logprobs"):  # n_probs asked for: this chunk's tokens' (llama-server's shape)
            out["completion_probabilities"] = S.probabilities(chunk["logprobs"], self.post)
        if "timings" in chunk:  # timings_per_token
            out["timings"] = chunk["timings"]
        if "progress" in chunk:  # return_progress
            out["prompt_progress"] = chunk["progress"]
        return out


# -- the route -----------------------------------------------------------------------------------


class CompletionRoutes(NativeRoutes):
    def routes(self) -> list[Route]:
        completion = self._guard(self.completion, generates=True)
        return [Route("/completion", completion, methods=["POST"]),
                Route("/completions", completion, methods=["POST"])]

    def _mind(self, request: Request) -> str | None:
        return request.headers.get("x-actord-mind") or None

    async def _bias_tokens(self, text: str) -> list[int]:
        """A logit_bias text's tokens: no BOS, special tokens as plain text (llama-server's)."""
        return await self._tokens(text, add_special=False, parse_special=False)

    async def completion(self, request: Request) -> Response:
        body: CompletionBody = await self._decode(request, CompletionBody)
        if body.prompt is None:
            raise InvalidParams('"prompt" is required', param="prompt")
        refuse_unsupported(body)
        prompts = split_prompts(body.prompt)
        if len(prompts) > 1 and body.stream:
            raise unsupported("prompt", "several prompts are answered whole: send stream=false, or one prompt")
        n_cmpl = check_n(body.n_cmpl if body.n_cmpl is not None else 1 if body.n is None else body.n,
                         self.config.max_n, "n_cmpl" if body.n_cmpl is not None else "n")
        if len(prompts) * n_cmpl > self.config.max_requests_in_flight:
            raise InvalidParams(f"{len(prompts)} prompts of {n_cmpl} completions, at most "
                                f"{self.config.max_requests_in_flight} in all", param="prompt")
        n_ctx = slot_n_ctx(self.config, self.system.model_props().n_ctx)
        n = body.n_predict if body.n_predict is not None else body.max_tokens
        if n is None:
            n = max_tokens(self.config, n_ctx)  # the chat APIs' fallback (actord/chat/defaults.py)
        elif n == -1:
            n = n_ctx  # until EOS, a stop, or the context is full
        elif n < -1:
            raise InvalidParams(f"n_predict must be >= -1, got {n}", param="n_predict")
        n_vocab = self.system.model_props().n_vocab
        fields, sampling = await S.sampling(body, default_seed=self.config.seed, n_vocab=n_vocab,
                                            max_top=self.config.request_limits().max_top_logprobs,
                                            tokenize=self._bias_tokens)
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
        salts = one_off_salts(body, mind, len(prompts))
        reqs = []
        for p, salt in zip(prompts, salts):
            prompt: str | list[int] = p if isinstance(p, str) else await self._mixed(p)
            try:
                reqs.append(compiled(msgspec.convert(dict(
                    prompt=prompt, n_predict=n, slot=slot, mind=mind, stop=stops, ignore_eos=body.ignore_eos,
                    stream=body.stream, genes=genes, return_progress=body.return_progress,
                    timings_per_token=body.timings_per_token, cache_salt=salt, **fields),
                    CompletionRequest).check(self.config.request_limits())))
            except msgspec.ValidationError as e:
                raise InvalidParams(f"invalid request: {e}") from None
        settings = {
            **generation_defaults(self.config, n_ctx), **sampling, "n_predict": n, "stop": stops,
            "ignore_eos": body.ignore_eos, "stream": body.stream, "lora": genes, "id_slot": body.id_slot, "mind": mind,
            # ignore_eos shown as llama-server shows it: the end token banned (a null bias, -inf).
            **({"logit_bias": [*sampling.get("logit_bias", []), {"token": self.system.model_props().eos, "bias": None}]}
               if body.ignore_eos else {}),
            "n_ctx": n_ctx, "n_cmpl": n_cmpl, "timings_per_token": body.timings_per_token,
            "return_progress": body.return_progress,
        }
        system = self.system

        def job(req: CompletionRequest) -> Job:
            async def run(on_token: Any) -> list[CompletionResult]:
                if n_cmpl > 1:  # from one prefill, seeds seed + j (actord/chat/choices.py)
                    return await system.complete_n(req, n_cmpl, on_token=on_token)
                return [await system.complete(req, on_token=on_token)]
            return run

        async def finish(i: int, k: int, r: CompletionResult) -> dict[str, Any]:
            return await self._result(i, r, reqs[k], prompts[k], body, settings)

        return NativeAnswer.response(self.front, [job(r) for r in reqs], finish, stream=body.stream,
                                     post=fields["post_sampling_probs"])

    async def _result(self, i: int, r: CompletionResult, req: CompletionRequest, prompt: Any,
                      body: CompletionBody, settings: dict[str, Any]) -> dict[str, Any]:
        """What the answer needs beyond the result (the stop string that ended it, the prompt
        as evaluated), then the result object (`from_result`)."""
        word = await stopping_word_of(self.system, r, req.stop)
        fields = body.response_fields or None  # llama-server: none listed is every field
        if fields is not None and "prompt" not in fields:
            prompt_text = ""
        else:  # the prompt as evaluated, detokenized (BOS included), as llama-server echoes it
            tokens = list(req.prompt) if not isinstance(req.prompt, str) else await self._tokens(req.prompt, True)
            prompt_text = await self.system.detokenize(tokens)
        return from_result(i, r, req, body, settings, model=self.front.model_id, prompt_text=prompt_text,
                           stopping_word=word)


def from_result(i: int, r: CompletionResult, req: CompletionRequest, body: CompletionBody, settings: dict[str, Any],
                *, model: str, prompt_text: str, stopping_word: str) -> dict[str, Any]:
    """Completion `i`'s result as llama-server's result object (the last chunk of a stream,
    where content and tokens went with the chunks), cut to `response_fields` when listed."""
    fields = body.response_fields or None
    n_gen = len(r.tokens)
    out = {
        "index": i,
        "content": "" if body.stream else r.content,
        "tokens": [] if body.stream or not body.return_tokens else list(r.tokens),
        "id_slot": r.slot,
        "stop": True,
        "model": model,
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
    if not body.stream and r.logprobs:  # streamed, each chunk carried its tokens'
        out["completion_probabilities"] = S.probabilities(r.logprobs, req.post_sampling_probs)
    return out if fields is None else nested_fields(fields, out)
