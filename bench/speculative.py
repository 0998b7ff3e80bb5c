"""Speculative decoding: tokens per target forward, acceptance and tokens/s, with and without
a draft model, measured side by side in one run through the embedded API.

Why these figures: on this CPU a k-token verify costs about k single decode steps (the
matmuls are bandwidth- and compute-bound the same way for 1 row or 5), so speculation does
not buy wall time here unless the draft is nearly free and agrees often; tokens per target
forward is the figure that carries to an accelerator, where a verify of k+1 rows costs
about one step. tokens/s is printed beside it for honesty. No assertion on any of it.

Cases:
1. A generated f32 llama (n_embd 256, 4 blocks, the tests' 512-token vocabulary) drafted by
   (a) a copy of itself: acceptance near 1, the ceiling; (b) a differently-seeded llama of
   the same vocabulary: acceptance near 0, the floor, i.e. what a useless draft costs;
   (c) its own first block (write_pruned_draft): a real, partial draft.
2. Recurrent and hybrid targets, whose rejected drafts are rolled back inside the verify
   (props.spec_rollback): a generated f32 qwen35 (Gated DeltaNet + attention, one MTP
   layer; rollback "rs": n_rs_seq snapshots) drafted by (a) itself (a hybrid draft model,
   whose own rejected drafts are restored and replayed): the ceiling; (b) its MTP head
   (`--spec mtp`; random weights, so acceptance near 0: what driving the head costs);
   (c) a tiny llama of the same vocabulary: the floor. And a generated f32 mamba2 (rollback
   "replay": the state copied before each verify, restored, the accepted tokens decoded
   again) drafted by itself and by the tiny llama: what a replay costs when every draft
   is rejected.
3. The registry's Gemma 3 270M (Q4_K_M) drafted by layer-pruned copies of itself. Its
   262k-token head is ~60% of a token's compute, so even a 1-block draft costs well over
   half a target token: the draft model here is a correctness and acceptance exercise, not
   a speed-up. Greedy output is identical at k=2 (a 3-row verify runs the 1-row kernels);
   at k >= 3 the quantized matmuls take their 4-row path and outputs may differ (printed).

Each case runs the same prompts plain and with speculation (greedy, ignore_eos), and prints
per configuration: output tokens, target forwards (engine steps), tokens per forward,
accepted / drafted, tokens/s of generation, and the ratio of each to plain; "same" says
whether the output tokens equal the plain run's.

Run: .venv/bin/python bench/speculative.py   (about 4 minutes on 2 busy cores; --skip-gemma
runs the tiny model only, --n-predict and --k shorten or widen it, --cases picks cases; the
smallest: --cases llama --k 1 2 4 --n-predict 16. The rows also go to
bench/out/speculative.json, which bench/report.py plots as tokens per target forward vs k.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actord.vocabulary import log  # noqa: E402
from actord.vocabulary.config import Config  # noqa: E402
from actord.service.system import ActorSystem  # noqa: E402

TEXTS = [
    "The history of the Roman Empire spans more than a thousand years. It began when Augustus became the first "
    "emperor in 27 BC, and",
    "The harbour town of Veln sits between two cliffs. Its lighthouse has burned for three hundred years, tended "
    "by one family at a time. Fishing boats leave at dawn and",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
]


async def run(model: str, draft: str | None, k: int, n_predict: int, threads: int) -> dict[str, Any]:
    """`draft`: a draft model's path, "mtp" (the model's own MTP head) or None (plain)."""
    kw: dict[str, Any] = {}
    if draft == "mtp":
        kw = dict(spec="mtp", spec_n_max=k)
    elif draft:
        kw = dict(spec_draft_model=draft, spec_n_max=k)
    cfg = Config(model=model, slots=1, ctx=2048, batch=512, threads=threads, **kw)
    out: dict[str, Any] = {"tokens": [], "n": 0, "steps": 0.0, "drafted": 0, "accepted": 0, "gen_s": 0.0}
    async with ActorSystem(cfg) as s:
        out["rollback"] = s.props.spec_rollback
        for text in TEXTS:
            await s.slot_erase(0)
            steps0 = s.metrics.snapshot()["engine_steps_total"]
            t0 = time.perf_counter()
            r = await s.complete(prompt=text, n_predict=n_predict, slot=0, ignore_eos=True)
            wall = time.perf_counter() - t0
            out["steps"] += s.metrics.snapshot()["engine_steps_total"] - steps0
            out["tokens"].append(r.tokens)
            out["n"] += len(r.tokens)
            out["drafted"] += r.timings.draft_n
            out["accepted"] += r.timings.draft_n_accepted
            out["gen_s"] += r.timings.predicted_ms / 1e3 if r.timings.predicted_ms > 0 else wall
    return out


# One row per configuration run: bench/out/speculative.json (bench/_out.py), for bench/report.py.
ROWS: list[dict[str, Any]] = []


def record(title: str, name: str, k: int, x: dict[str, Any], plain: dict[str, Any]) -> None:
    ROWS.append({"case": title, "draft": name, "k": k, "tokens": x["n"], "forwards": x["steps"],
                 "tokens_per_forward": x["n"] / x["steps"] if x["steps"] else 0.0,
                 "drafted": x["drafted"], "accepted": x["accepted"],
                 "tokens_per_s": x["n"] / x["gen_s"] if x["gen_s"] else 0.0,
                 "rollback": x.get("rollback") or "", "same_as_plain": x["tokens"] == plain["tokens"]})


def line(name: str, x: dict[str, Any], plain: dict[str, Any]) -> str:
    tpf = x["n"] / x["steps"] if x["steps"] else 0.0
    tpf0 = plain["n"] / plain["steps"] if plain["steps"] else 1.0
    tps = x["n"] / x["gen_s"] if x["gen_s"] else 0.0
    tps0 = plain["n"] / plain["gen_s"] if plain["gen_s"] else 1.0
    acc = f"{x['accepted']}/{x['drafted']} ({x['accepted'] / x['drafted']:.0%})" if x["drafted"] else "-"
    same = "same" if x["tokens"] == plain["tokens"] else "DIFFERS"
    if x.get("rollback"):
        name = f"{name} [{x['rollback']}]"
    return (f"  {name:<34} {x['n']:>5} tok {int(x['steps']):>5} fwd  {tpf:5.2f} tok/fwd ({tpf / tpf0:4.2f}x)  "
            f"acc {acc:<15} {tps:7.1f} tok/s ({tps / tps0:4.2f}x)  {same}")


async def case(title: str, model: str, drafts: list[tuple[str, str]], ks: list[int], n_predict: int,
               threads: int) -> None:
    print(f"\n{title}: {len(TEXTS)} prompts x {n_predict} tokens, greedy", flush=True)
    plain = await run(model, None, 0, n_predict, threads)
    print(line("plain", plain, plain), flush=True)
    record(title, "plain", 0, plain, plain)
    for name, path in drafts:
        for k in ks:
            x = await run(model, path, k, n_predict, threads)
            print(line(f"{name}, k={k}", x, plain), flush=True)
            record(title, name, k, x, plain)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--skip-gemma", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--cases", nargs="+", choices=["llama", "hybrid", "gemma"], default=["llama", "hybrid", "gemma"],
                    help="which cases to run (hybrid: the qwen35 and mamba2 ones); smallest: --cases llama")
    a = ap.parse_args()
    log.configure(level="warning")
    from actord.testing.draft_models import write_pruned_draft
    from actord.testing.models import gemma3_270m_path, write_tiny_llama, write_tiny_mamba2, write_tiny_qwen35

    tmp = Path(tempfile.mkdtemp(prefix="actord-spec-"))
    if not a.skip_tiny and "llama" in a.cases:
        shape = dict(n_embd=256, n_layer=4, n_head=8, n_head_kv=4, n_ff=768)
        target = str(write_tiny_llama(tmp / "llama.gguf", seed=1, **shape))
        other = str(write_tiny_llama(tmp / "llama-s2.gguf", seed=2, **shape))
        first = str(write_pruned_draft(target, tmp / "llama-first1.gguf", 1))
        await case("f32 llama (256 x 4 blocks)", target,
                   [("draft = target copy", target), ("draft = another seed", other), ("draft = first block", first)],
                   a.k, a.n_predict, a.threads)
    if not a.skip_tiny and "hybrid" in a.cases:
        hshape = dict(n_embd=256, n_layer=8, n_head=8, n_head_kv=4, head_dim=32, n_ff=768, d_state=32,
                      n_k_heads=4, n_v_heads=8)
        hybrid = str(write_tiny_qwen35(tmp / "qwen35.gguf", seed=1, mtp=True, **hshape))
        small = str(write_tiny_llama(tmp / "llama-small.gguf", seed=2))
        await case("f32 qwen35 hybrid (256 x 6 DeltaNet + 2 attention blocks, 1 MTP layer)", hybrid,
                   [("draft = target copy", hybrid), ("MTP head (--spec mtp)", "mtp"),
                    ("draft = tiny llama", small)], a.k, a.n_predict, a.threads)
        mamba = str(write_tiny_mamba2(tmp / "mamba2.gguf", seed=1, n_embd=256, n_layer=4, d_inner=512, n_heads=16))
        await case("f32 mamba2 recurrent (256 x 4 blocks)", mamba,
                   [("draft = target copy", mamba), ("draft = tiny llama", small)], a.k, a.n_predict, a.threads)
    gemma = gemma3_270m_path()
    if not a.skip_gemma and "gemma" in a.cases and gemma is not None:
        drafts = []
        for n, last in ((4, 0), (10, 2), (14, 2)):
            name = f"first {n}" + (f" + last {last}" if last else "") + " of 18 blocks"
            t0 = time.perf_counter()
            p = write_pruned_draft(gemma, tmp / f"gemma-{n}-{last}.gguf", n, last)
            print(f"wrote {name}: {p.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s", flush=True)
            drafts.append((name, str(p)))
        await case("Gemma 3 270M Q4_K_M", str(gemma), drafts, a.k, a.n_predict, a.threads)
    elif gemma is None:
        print("Gemma 3 270M is not installed: skipped")
    import _out

    _out.write("speculative", rows=ROWS, n_predict=a.n_predict, prompts=len(TEXTS))


if __name__ == "__main__":
    anyio.run(main)
