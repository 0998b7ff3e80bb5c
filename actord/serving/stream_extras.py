"""What a streamed chunk carries beyond its text, for a request that asked: its prompt's
progress (llama-server's `return_progress`) and its timings so far (`timings_per_token`).

Why a module of its own, beside the Scheduler: both read a running request's record
(`steps.records.Request`) and its start time, which live there, and both must cost nothing
to a request that did not ask. So nothing here is looked up per token: progress comes from
the core's `Progress` events, which it makes only while an enrolled request asked for them,
and the timings ride on the request's own stream sink, wrapped once at enrolment
(`timed`), so the Scheduler's route of a token is the same for every other request.

The numbers are llama-server's (its server_slot_stats and result_prompt_progress):
- progress: `total` prompt tokens, `cache` (in the KV before the request ran), `processed`
  (in the KV now, cached ones included), `time_ms` since the request started;
- timings: `cache_n`, `prompt_n` (prompt tokens decoded so far), `prompt_ms` (0 until one
  is; then to the last piece decoded, or to the first token once there is one),
  `predicted_n` and `predicted_ms` (from the first token), each with its per-token and
  per-second rate, as the final answer's (`openai.answers.llama_timings`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from actord.serving.steps.records import Request


def progress(r: Request, t_start: float, now: float) -> dict[str, Any]:
    return {"total": r.n_prompt, "cache": r.n_cached, "processed": min(r.n_done, r.n_prompt),
            "time_ms": int((now - t_start) * 1e3)}


class LiveTimings:
    """One request's timings as its stream goes (see the module docstring)."""

    __slots__ = ("r", "t_start", "t_prompt")

    def __init__(self, r: Request, t_start: float) -> None:
        self.r, self.t_start, self.t_prompt = r, t_start, 0.0

    def prompt_step(self, now: float) -> None:
        """A piece of the prompt was decoded by `now`."""
        if self.r.n_done > self.r.n_cached:
            self.t_prompt = now

    def now(self, now: float) -> dict[str, Any]:
        r = self.r
        n_proc = min(r.n_done, r.n_prompt) - r.n_cached
        end = r.t_first or self.t_prompt
        prompt_ms = (end - self.t_start) * 1e3 if end and n_proc > 0 else 0.0
        n_gen = len(r.out)
        gen_ms = (now - r.t_first) * 1e3 if n_gen and r.t_first else 0.0
        return {
            "cache_n": r.n_cached, "prompt_n": n_proc, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_proc if n_proc else 0.0,
            "prompt_per_second": n_proc / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": n_gen, "predicted_ms": gen_ms,
            "predicted_per_token_ms": gen_ms / n_gen if n_gen else 0.0,
            "predicted_per_second": n_gen / gen_ms * 1e3 if gen_ms > 0 else 0.0,
        }


def timed(sink: Callable[[dict[str, Any]], None], live: LiveTimings) -> Callable[[dict[str, Any]], None]:
    """`sink`, each chunk given the request's timings so far."""

    def send(chunk: dict[str, Any]) -> None:
        chunk["timings"] = live.now(time.perf_counter())
        sink(chunk)

    return send
