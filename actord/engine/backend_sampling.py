"""Backend sampling: a sequence's sampler chain runs inside the decode's own graph.

libllama 0.3.36 (`llama_set_sampler`, experimental) can attach a sampler chain to a
sequence; the chain's samplers then run as graph ops on the device that computed the
logits, and `llama_sampler_sample` (the step's sampling call, unchanged) finds the token
already picked (`llama_get_sampled_token_ith`) and only accepts it into the chain. When
every output row of a decode belongs to such a sequence, libllama does not copy the logits
to the host at all: a GPU step moves one token per sequence instead of n_vocab floats
(262,144 for Gemma 3: 1 MiB per sequence per step).

What can run there (vendored llama.cpp, src/llama-sampler.cpp, each sampler's
`backend_init`): greedy, top_k, top_p, min_p, temp, dist and logit_bias. Not here:

* grammar (no backend implementation; actord also checks the chain's pick against the
  grammar on the raw logits row, which a backend-sampled step does not copy), lazy
  grammars included (they turn into a grammar mid-output);
* penalties: its backend_init refuses a context that allows more than one output per
  sequence (`n_outputs_max_per_seq`, which speculative verification and prompt batches
  need), and a chain whose backend part stops early would still skip the logits copy;
* logprobs: computed by actord from the raw logits row;
* speculative decoding (a draft context): verification samples several rows per sequence
  and reads them in order; kept on the CPU chain.

A chain is attached only when all of it can run there: then the backend picks the token and
the CPU chain only accepts it. Greedy picks the same token either way (argmax; pinned by
tests/engine/test_backend_sampling.py); a seeded dist draws from the backend's copy of the
generator and picks over the backend's own sort and cumulative sum, so a seeded temperature
request is reproducible per setting, not across the two (on the CPU backend some chains
matched, top_k + min_p did not).

Costs. Attaching or detaching a chain makes libllama re-reserve its compute graph at the
next decode (`sched_need_reserve`): once per request start, not measurable next to a Gemma
step here. Every attached chain runs in every decode's graph, its sequence in the batch or
not (libllama gives an inactive one a dummy row), so chains are detached when their request
ends (FreeSampler). top_p/top_k in the graph sort the whole vocabulary: cheap on a GPU, slow
on the CPU backend (ggml's argsort, one thread: 0.39x the CPU chain's tokens/s for top_p on
Gemma 3's 262k vocabulary), while greedy and logit_bias cost nothing there
(bench/sampling_cost.py --backend measures both ways side by side).

`Config.backend_sampling`: "auto" (on where the model runs on a GPU backend, off on the
CPU, where the logits are already in host memory), "on", "off".
"""

from __future__ import annotations

from typing import Any

from actord.engine import jobs as J
from actord.engine.llama import lib

MODES = ("auto", "on", "off")


def resolve(mode: str, gpu_offload: bool, drafting: bool) -> bool:
    """Whether this engine attaches eligible chains to the backend."""
    if drafting:
        return False
    return mode == "on" or (mode == "auto" and gpu_offload)


def eligible(p: J.SamplingParams) -> bool:
    """Can this request's whole chain run in the graph? (see the module docstring)"""
    penalties = p.penalty_last_n and (p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)
    return not p.grammar and not p.grammar_triggers and p.top_logprobs < 0 and not penalties


def attach(ctx: Any, seq: int, chain: Any) -> bool:
    """Attach `chain` to sequence `seq`; False when libllama keeps it on the CPU."""
    return bool(lib.llama_set_sampler(ctx, seq, chain))


def detach(ctx: Any, seq: int) -> None:
    """Before the chain is freed: libllama holds its pointer while attached."""
    lib.llama_set_sampler(ctx, seq, None)
