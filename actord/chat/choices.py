"""n choices of one prompt (OpenAI's `n`, llama-server's `n_cmpl`): n independent samples
from one prefill.

How, and why this way: the prompt but its last token is prefilled once, as a request of its
own (`n_predict` 0) where choice 0 runs: the mind's slot, the slot the request names, or the
idle slot the placement picks (the longest cached prefix). That slot's sequence is then
forked into idle slots (`Fork`: llama_memory_seq_cp, as llama-server copies an `n_cmpl`
parent's sequence to its children; with the unified KV cache the prompt's cells are shared,
not copied), and the n choices run side by side, each on its own slot, each decoding the
prompt's last token (its logits are the choice's own first sample) and then generating: the
prompt is processed once, plus one token per choice. Reusing the slots and their prefix is
the nearest real thing actord has: a fork is what its slots already are (one sequence per
slot, placed and cut back by their own actors), and a choice on a forked slot is an ordinary
request whose cached prefix is the whole prompt but one token, so everything a request does
(genes, grammars, stops, logprobs, checkpoints, cancellation) holds for each choice unchanged.
Fewer idle slots than choices: the choices left over queue on the slots that have the prefix
and run one after another there, each cutting its slot back to the prompt (the prefix cache's
ordinary reuse); choice 0 always runs last on its slot, so that slot ends holding the prompt
and choice 0's reply.

Stated choices:
- Seeds: choice i samples with seed + i (mod 2^32; the request's `seed`, else the daemon's
  `--seed`), as llama-server seeds its children; so with a seed every choice is
  deterministic, and choice i of a seeded n-request is the n=1 answer for seed + i from the
  same cache state. (A prompt whose KV came from a different history, a prefix cached by
  another prompt's prefill, can differ in the last bits of its logits, as libllama's numbers
  do with how a prompt was batched; that can change a temperature sample, never greedy's
  choice short of a near tie. That holds for any actord request, n = 1 included.)
- A mind (a named session: `X-Actord-Mind`, `user`, `prompt_cache_key`) continues from
  choice 0: choice 0 runs in the mind's slot and is the reply its history keeps (and the chat
  turn memory remembers); the other choices run on forked slots and are forgotten.
- Usage counts the prompt once and sums the choices' generated tokens (`merge_usage`).
  Choice 0's result carries the shared prefill (`shared_prefill`): its `n_cached` is what
  the cache held before the request, its `n_prompt_processed` the prefill's tokens plus its
  own one; every other choice's says 1 processed, the prompt but one token cached.
- A typed error in any choice ends the whole request with that error (the other choices are
  cancelled); a caller that goes away cancels all n.
- Cells: the scheduler charges each forked slot its prompt's cells, as if copied (a
  conservative count: the cells are shared; counting them once would leave them uncharged
  when the source lets go of its copy), so a fork is made only where `MakeRoom` grants them
  from cells free now, evicting nobody (an eviction to make room for cells that are shared
  anyway could even take the source's prefix); a refused fork's choice queues on a slot
  that has the prefix.
- Not replayed: a trace records the request once, as its verb (a replay runs it as n = 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio
import msgspec

from actord.vocabulary.types import CompletionRequest, CompletionResult
from actord.vocabulary.errors import ActordError, InvalidParams, PromptTooLong
from actord.vocabulary.log import get

if TYPE_CHECKING:
    from actord.chat.host import ChatHost

log = get("actord.chat.choices")

OnToken = Callable[[dict[str, Any]], None]


def check_n(n: Any, max_n: int, param: str = "n") -> int:
    """`n` as an integer in [1, max_n], else a 400 naming `param`."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
        raise InvalidParams(f"{param} must be an integer in [1, {max_n}] (this daemon's --max-n), got {n!r}"[:200],
                            param=param, max=max_n)
    return n


def choice_seed(seed: int, i: int) -> int:
    """Choice i's sampling seed (the module docstring)."""
    return (seed + i) & 0xFFFFFFFF


def merge_usage(results: list[CompletionResult]) -> dict[str, int]:
    """The request's usage: the prompt once (from choice 0's result, which carries the shared
    prefill: `cached_tokens` is what the cache held before the request), the completions summed."""
    r0 = results[0]
    n_out = sum(len(r.tokens) for r in results)
    return {"prompt_tokens": r0.n_prompt_tokens, "completion_tokens": n_out,
            "total_tokens": r0.n_prompt_tokens + n_out, "cached_tokens": r0.n_cached}


def plan(n: int, source: int, forks: list[int]) -> dict[int, list[int]]:
    """Which choices run on which slot, in order: choice 0 on `source`, choice i on the i-th
    fork, the rest round robin over the slots holding the prefix, choice 0 last on its slot."""
    slots = [source, *forks]
    runs: dict[int, list[int]] = {s: [] for s in slots}
    for i in range(1, n):
        runs[slots[i] if i < len(slots) else slots[i % len(slots)]].append(i)
    runs[source].append(0)
    return {s: ids for s, ids in runs.items() if ids}


def with_index(sink: OnToken | None, i: int) -> OnToken | None:
    """A choice's stream sink: each chunk goes on tagged with the choice's `index`."""
    if sink is None:
        return None

    def tagged(chunk: dict[str, Any]) -> None:
        sink({**chunk, "index": i})
    return tagged


async def _tokens(system: "ChatHost", req: CompletionRequest) -> list[int]:
    if isinstance(req.prompt, str):  # as the slot tokenizes a text prompt
        return await system.tokens_of(req.prompt)
    return list(req.prompt)


async def complete_choices(system: "ChatHost", request: CompletionRequest, n: int, on_token: OnToken | None = None,
                           sinks: list[OnToken | None] | None = None) -> list[CompletionResult]:
    """n completions of one prompt, prefilled once (the module docstring); results by index.
    Chunks go to `on_token` tagged with their choice's `index`, or to `sinks[i]` as they are."""
    request = request.check(system.request_limits())
    system.check_open()
    check_n(n, system.config.max_n)
    sinks = sinks if sinks is not None else [with_index(on_token, i) for i in range(n)]
    if n == 1:
        return [await system.complete(request, on_token=sinks[0], _input=False)]
    tokens = await _tokens(system, request)
    cells = system.model_props().kv_cells
    if cells and len(tokens) + 1 > cells:  # as the slot refuses it, before the prefill runs
        raise PromptTooLong(f"prompt of {len(tokens)} tokens does not fit n_ctx {cells}",
                            n_prompt_tokens=len(tokens), n_ctx=cells)
    seed = request.seed if request.seed is not None else system.config.seed
    mind, slot = request.mind, request.slot
    source: int | None = slot
    forks: list[int] = []
    pre: CompletionResult | None = None
    if len(tokens) > 1:
        prefill = msgspec.structs.replace(
            request, prompt=tokens[:-1], n_predict=0, stream=False, logprobs=False, top_logprobs=0, grammar="",
            grammar_triggers=[], preserve=[], stop=[], stop_tokens=[], logit_bias=[], seed=seed)
        pre = await system.complete(prefill, _input=False, _cached=False)
        source = pre.slot
        # Idle slots made to hold the prefix (actord/service/placement.py: a fork is made only
        # where cells free now hold it, evicting nobody).
        forks = await system.fork_prefix(source, tokens[:-1], n - 1)
    base = msgspec.structs.replace(request, prompt=tokens, mind=None, slot=None)
    reqs = [msgspec.structs.replace(base, seed=choice_seed(seed, i)) for i in range(n)]
    results: list[CompletionResult | None] = [None] * n
    failed: list[BaseException] = []

    async def run(slot_id: int | None, ids: list[int]) -> None:
        try:
            for i in ids:
                req = reqs[i]
                if mind is not None and (slot_id == source if slot_id is not None else i == 0):
                    # On the mind's own slot every choice is a turn of hers (the same prompt;
                    # choice 0 runs last, so hers is its reply): a slot-addressed request
                    # would write over her state and drop her name.
                    req = msgspec.structs.replace(req, mind=mind)
                elif slot_id is not None:
                    req = msgspec.structs.replace(req, slot=slot_id)
                results[i] = await system.complete(req, on_token=sinks[i], _input=False, _cached=False)
        except ActordError as e:
            failed.append(e)
            tg.cancel_scope.cancel()  # one choice fails, the request fails: the others stop

    async with anyio.create_task_group() as tg:
        if source is None:  # a one-token prompt: nothing to share, every choice placed as it comes
            for i in range(n):
                tg.start_soon(run, None, [i])
        else:
            for s, ids in plan(n, source, forks).items():
                tg.start_soon(run, s, ids)
    if failed:
        raise failed[0]
    log.debug("choices.done", n=n, source=source, forks=forks)
    out = [r for r in results if r is not None]
    return [shared_prefill(out[0], pre), *out[1:]] if pre is not None else out


def shared_prefill(r0: CompletionResult, pre: CompletionResult) -> CompletionResult:
    """Choice 0's result with the shared prefill in it: the prompt tokens the cache held
    before the request (`n_cached`), those processed for it, and the time that took."""
    ms = r0.timings.prompt_ms + pre.timings.prompt_ms
    n = r0.n_prompt_processed + pre.n_prompt_processed
    t = msgspec.structs.replace(r0.timings, prompt_ms=ms, prompt_per_second=n / ms * 1e3 if ms > 0 else 0.0)
    return msgspec.structs.replace(r0, n_cached=pre.n_cached, n_prompt_processed=n, timings=t)


def reply_message(scanner: Any, sink: Any, result: CompletionResult, thought: Any = None, outer: Any = None) -> Any:
    """A chat reply's message: the text, or (tools) the scanner's content and calls; with
    its thought parsed out first (`thought`, actord.chat.reasoning; `outer`: the stream sink
    its parser fed, flushed here before the scanner's)."""
    from actord.chat.messages import ChatMessage
    from actord.chat.reasoning import ReasoningSink
    from actord.chat.tool_output import StreamAdapter

    reasoning, content = thought.split(result.content) if thought is not None else (None, result.content)
    if isinstance(outer, ReasoningSink):
        outer.finish(result.slot)
    if scanner is None:
        return ChatMessage(role="assistant", content=content, reasoning_content=reasoning)
    cut = result.stop_reason in ("length", "context")
    if isinstance(sink, StreamAdapter):
        sink.finish(result.slot, cut)
    else:
        scanner.feed(content)
        scanner.finish(cut)
    return ChatMessage(role="assistant", content=scanner.content, tool_calls=scanner.calls or None,
                       reasoning_content=reasoning)


async def chat_choices(system: "ChatHost", completion: CompletionRequest, n: int, turn: Any, on_token: OnToken | None,
                       end: Callable[[CompletionResult, Any], Awaitable[Any]], thought: Any = None) -> list[Any]:
    """A chat turn's n choices: each parsed by its own scanner (tools), streamed with its
    index; choice 0's reply is the one `end` remembers (the others' ChatResults only)."""
    from actord.chat.messages import ChatResult
    from actord.chat.tool_output import StreamAdapter

    scanners = [turn.scanner() if turn is not None and turn.parses else None for _ in range(n)]
    sinks: list[Any] = []
    for i, sc in enumerate(scanners):
        tagged = with_index(on_token, i)
        sinks.append(StreamAdapter(sc, tagged) if sc is not None and tagged is not None else tagged)
    outers = [thought.sink(s) if thought is not None else s for s in sinks]
    results = await complete_choices(system, completion, n, sinks=outers)
    first = await end(results[0], reply_message(scanners[0], sinks[0], results[0], thought, outers[0]))
    return [first, *(ChatResult(message=reply_message(scanners[i], sinks[i], r, thought, outers[i]), completion=r,
                                reused_turn=first.reused_turn) for i, r in enumerate(results) if i)]

