"""Each request's share of the engine's time, and the budget that ends a request past it
(issue 33: no request stalls another).

Why: the scheduler already shares each step between the requests it batches (every
decoding request one token per step, prompts in enrolment order with what the batch has
left, gene groups in turns of `group_quantum` steps), so a request's engine time is its
share of the steps it was in. What was not bounded is how much of it one request may take
in all: a request whose tokens are slow (a costly grammar just below its per-token
budget, a long generation on a slow device) held its slot for as long as it ran. Past `request_engine_s` of its share it ends with `EngineTimeExceeded`.

A step's time is split as the engine spends it: decoding by the tokens each entry fed,
sampling equally between the entries that sampled (the engine times sampling per step,
not per entry).
"""

from __future__ import annotations

from typing import Sequence


def step_shares(decode_s: float, sample_s: float, fed: Sequence[int], sampled: Sequence[bool]) -> list[float]:
    """Each entry's share of one step: `decode_s` split by the tokens fed, `sample_s`
    equally between the entries that sampled (all of them, when none did)."""
    n = len(fed)
    if n == 0:
        return []
    tokens = sum(fed)
    samplers = sum(1 for s in sampled if s)
    out = []
    for i in range(n):
        d = decode_s * fed[i] / tokens if tokens else decode_s / n
        s = (sample_s / samplers if sampled[i] else 0.0) if samplers else sample_s / n
        out.append(d + s)
    return out


def past_budget(spent_s: float, budget_s: float) -> bool:
    """Whether a request that has had `spent_s` of engine time is past its budget (0: none)."""
    return budget_s > 0 and spent_s > budget_s
