"""llama-server's sampling fields on /completion, mapped onto actord's samplers
(actord.vocabulary.types.SamplingFields), and its token probabilities (`completion_probabilities`).

Why a module of its own: llama-server's fields have their own shapes and defaults
(`logit_bias` as pairs, texts or an object, `false` for a ban; `json_schema: {}` for any
object; `n_probs` for the likeliest tokens; min_p 0.05 and a 64-token penalty window unless
told otherwise), and each needs its checks (a 400 naming the field, before anything runs);
/completion (`completion.py`) only hands the body over and gets back what to
sample with and what to report in `generation_settings`.

Honoured, with llama-server's defaults (tools/server/README.md, llama.cpp's
common_params_sampling):
- `temperature` (0.8; <= 0 greedy), `top_k` (40; <= 0 off), `top_p` (0.95; <= 0 keeps the
  one likeliest token: greedy), `min_p` (0.05; clamped to [0, 1], as llama-server does),
  `seed` (absent: the daemon's `--seed`; -1 or 4294967295: a fresh random one).
- `repeat_penalty` (1.0 = off), `presence_penalty` and `frequency_penalty` (0 = off),
  `repeat_last_n` (64; 0 turns the penalties off; -1 the whole context, as llama.cpp's
  `--repeat-last-n -1`).
- `grammar` (GBNF, root rule `root`) or `json_schema` (through the converter
  llama-cpp-python ships, actord.engine.grammar; `{}` is any JSON object, as llama-server
  makes it).
- `logit_bias`: `[[id, bias], ...]`, `[["text", bias], ...]` or `{"id" or "text": bias}`;
  `false` as the bias bans the token; a text's tokens (tokenized without BOS, special
  tokens as plain text, as llama-server does) each get its bias; a token named twice gets
  the sum (libllama adds every entry).
- `n_probs` (or `logprobs`, its alias when `n_probs` is absent): each generated token's
  `completion_probabilities` entry, `{id, token, bytes, logprob, top_logprobs: [{id, token,
  bytes, logprob}] * n_probs}`, on the whole answer or on each streamed chunk (not on the
  stream's last, as llama-server).

Where actord differs, stated:
- Penalties count the tokens this request generates (the OpenAI routes' definition, the
  engine's); llama-server also feeds the prompt's tokens into the penalty window.
- A bias of -100 or less bans the token, as on the OpenAI routes (llama-server adds it as
  is, which bans it in practice too).
- What llama-server skips silently is a 400 naming the field: a malformed `logit_bias`
  entry, a token id outside the vocabulary, a non-finite number. A non-empty `grammar`
  with a `json_schema` is a 400 too (llama-server takes the grammar; with `grammar: ""` it
  would drop the schema, which actord honours).
- `n_probs` is at most 20 (`RequestLimits.max_top_logprobs`). The probabilities are the
  model's (a softmax of the step's raw logits), as llama-server's without
  `post_sampling_probs`; with it (and `n_probs`), each entry has `prob` and `top_probs`:
  probabilities among the candidates the sampler chain (top_k, top_p, min_p, temperature)
  left, read on the engine thread from libllama's own candidate array, none with
  probability 0 (a greedy chain computes none: its pick has probability 1). An entry's `token`/`bytes` are its token's own
  piece (`token` cut to whole UTF-8 characters, as llama-server cuts it); llama-server's
  chosen-token entry shows the text sent with the token instead, which differs only where
  a stop word or a partial UTF-8 character held text back.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Awaitable, Callable

from actord.vocabulary.types import BAN, TokenLogprob
from actord.vocabulary.errors import InvalidParams
from actord.frontends.http.native.base import is_token

DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, DEFAULT_MIN_P = 0.8, 40, 0.95, 0.05
DEFAULT_REPEAT_LAST_N = 64
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama-server's LLAMA_DEFAULT_SEED: "pick one"
SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]  # the chain's order (logit biases first)
MAX_BIAS_TEXT_BYTES = 65536  # the texts of one request's logit_bias, together, before tokenizing
_LOWEST = -3.4028234663852886e38  # llama-server's logprob for p = 0 (JSON has no -inf)

Tokenize = Callable[[str], Awaitable[list[int]]]


def defaults(seed: int) -> dict[str, Any]:
    """The sampling part of llama-server's `generation_settings` for a request naming none."""
    return {
        "seed": seed, "temperature": DEFAULT_TEMPERATURE, "top_k": DEFAULT_TOP_K, "top_p": DEFAULT_TOP_P,
        "min_p": DEFAULT_MIN_P, "typical_p": 1.0, "repeat_last_n": DEFAULT_REPEAT_LAST_N, "repeat_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "mirostat": 0, "n_probs": 0, "grammar": "",
        "logit_bias": [], "samplers": list(SAMPLERS),
        # The samplers actord lacks, at the neutral values that leave them off (a request
        # asking for another is refused: completion._NEUTRAL), named as llama-server reports them.
        "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
        "xtc_threshold": 0.1, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
        "dry_penalty_last_n": -1, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0,
        "adaptive_decay": 0.9, "min_keep": 0, "backend_sampling": False,
    }


def _bad(name: str, why: str) -> InvalidParams:
    return InvalidParams(f"{name} {why}", param=name)


def _number(body: Any, name: str, default: float) -> float:
    v = getattr(body, name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, "must be a finite number")
    return float(v)


async def sampling(body: Any, *, default_seed: int, n_vocab: int, max_top: int,
                   tokenize: Tokenize) -> tuple[dict[str, Any], dict[str, Any]]:
    """What `body` (a /completion body) samples with: (CompletionRequest's sampling fields,
    their llama-server `generation_settings`). Bad values are a 400 naming the field."""
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
    if seed in RANDOM_SEEDS:
        seed = secrets.randbelow(0xFFFFFFFF)
    elif seed is not None and not 0 <= seed < 0xFFFFFFFF:
        raise InvalidParams(f"seed must be -1 or in [0, 2^32 - 1), got {seed}", param="seed")
    min_p = min(max(_number(body, "min_p", DEFAULT_MIN_P), 0.0), 1.0)
    last_n = DEFAULT_REPEAT_LAST_N if body.repeat_last_n is None else body.repeat_last_n
    if not is_token(last_n) or last_n < -1:
        raise _bad("repeat_last_n", "must be an integer >= -1 (0: no penalties, -1: the whole context)")
    n_probs = _n_probs(body, max_top)
    grammar = _grammar(body)
    bias = await _logit_bias(body.logit_bias, n_vocab, tokenize)
    fields = {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "min_p": min_p,
        "repeat_penalty": _number(body, "repeat_penalty", 1.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        # A ban as BAN, not -inf, so that the request stays plain JSON (traced, replayed).
        "repeat_last_n": last_n, "grammar": grammar, "logit_bias": [(t, max(b, BAN)) for t, b in bias],
        "logprobs": n_probs > 0, "top_logprobs": n_probs,
        "post_sampling_probs": n_probs > 0 and bool(body.post_sampling_probs),
    }
    settings = {
        **defaults(default_seed if seed is None else seed),
        **{k: fields[k] for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                                  "frequency_penalty", "repeat_last_n", "grammar")},
        "post_sampling_probs": bool(body.post_sampling_probs),
        # llama-server's shape; a ban shows as null, as its -inf does.
        "n_probs": n_probs, "logit_bias": [{"bias": b if b > BAN else -math.inf, "token": t} for t, b in bias],
    }
    return fields, settings


def _n_probs(body: Any, hi: int) -> int:
    name, v = ("n_probs", body.n_probs) if body.n_probs is not None else ("logprobs", body.logprobs)
    if v is None:
        return 0
    if isinstance(v, bool):
        v = int(v)  # as llama-server reads a JSON boolean as a number
    if not is_token(v) or not 0 <= v <= hi:
        raise _bad(name, f"must be an integer in [0, {hi}]")
    return v


def _grammar(body: Any) -> str:
    from actord.engine.grammar import check_grammar, schema_grammar

    g, schema = body.grammar, body.json_schema
    if g is not None and not isinstance(g, str):
        raise _bad("grammar", "is GBNF text")
    if schema is not None:
        if g:
            raise InvalidParams("grammar and json_schema both constrain the output: send one", param="json_schema")
        return schema_grammar({"type": "object"} if schema == {} else schema, "json_schema")
    return check_grammar(g) if g else ""


def _bias_value(key: Any, v: Any) -> float:
    if v is False:
        return -math.inf  # llama-server: false bans the token
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad("logit_bias", f"of {str(key)[:40]!r} must be a finite number, or false to ban it")
    return float(v)


def _is_id(key: str) -> bool:
    digits = key[1:] if key.startswith("-") else key
    return digits.isascii() and digits.isdigit() and len(digits) <= 10


async def _logit_bias(v: Any, n_vocab: int, tokenize: Tokenize) -> list[tuple[int, float]]:
    """llama-server's logit_bias shapes (see the module docstring) as sorted (token, bias)."""
    if v is None or v == [] or v == {}:
        return []
    items: list[tuple[Any, Any]] = []
    if isinstance(v, list):
        for i, el in enumerate(v):
            if not (isinstance(el, list) and len(el) == 2 and (is_token(el[0]) or isinstance(el[0], str))):
                raise _bad("logit_bias", f"[{i}] must be a [token id or text, bias] pair")
            items.append((el[0], el[1]))
    elif isinstance(v, dict):  # OpenAI's shape: a key is a token id, else a text
        items = [(int(k) if _is_id(k) else k, b) for k, b in v.items()]
    else:
        raise _bad("logit_bias", "must be a list of [token id or text, bias] pairs, or an object")
    texts = sum(len(k.encode("utf-8", "surrogatepass")) for k, _ in items if isinstance(k, str))
    if texts > MAX_BIAS_TEXT_BYTES:
        raise _bad("logit_bias", f"texts are {texts} bytes, at most {MAX_BIAS_TEXT_BYTES}")
    out: dict[int, float] = {}
    for key, value in items:
        bias = _bias_value(key, value)
        if isinstance(key, str):
            tokens = await tokenize(key)
        elif 0 <= key < n_vocab:
            tokens = [key]
        else:
            raise _bad("logit_bias", f"names token {key}, outside the vocabulary [0, {n_vocab})")
        for tok in tokens:
            out[tok] = out.get(tok, 0.0) + bias
    return sorted(out.items())


# -- completion_probabilities ------------------------------------------------------------------


def _utf8_whole(b: bytes) -> bytes:
    """`b` without a multi-byte character cut off at its end (llama-server's validate_utf8)."""
    n = len(b)
    for i in range(1, min(4, n) + 1):
        c = b[n - i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) or (c & 0xF8 == 0xF0 and i < 4):
            return b[: n - i]
    return b


def _entry(token: int, piece: list[int], logprob: float) -> dict[str, Any]:
    return {"id": token, "token": _utf8_whole(bytes(piece)).decode("utf-8", "replace"), "bytes": piece,
            "logprob": logprob if math.isfinite(logprob) else _LOWEST}


def _post_entry(token: int, piece: list[int], logprob: float) -> dict[str, Any]:
    return {"id": token, "token": _utf8_whole(bytes(piece)).decode("utf-8", "replace"), "bytes": piece,
            "prob": math.exp(logprob)}


def probabilities(lps: list[TokenLogprob], post: bool = False) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities` for these tokens; `post` (post_sampling_probs):
    probabilities after the sampler chain, as `prob` and `top_probs`."""
    if post:
        return [{**_post_entry(t.token, t.bytes, t.logprob),
                 "top_probs": [_post_entry(a.token, a.bytes, a.logprob) for a in t.top]} for t in lps]
    return [{**_entry(t.token, t.bytes, t.logprob),
             "top_logprobs": [_entry(a.token, a.bytes, a.logprob) for a in t.top]} for t in lps]
