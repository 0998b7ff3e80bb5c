"""Per-token cost of TextState.push: it must stay flat as the output grows.

Why: the scheduler core calls `push` once per generated token, so a cost that grows with
the text (re-decoding, slicing or searching all of it) turns a long completion quadratic.
This pushes 10,000 realistic pieces (ASCII words, CJK characters, emoji and accented
letters split across byte-level pieces, newlines and '<' that start stop strings but never
finish one) with 4 stop strings and streaming on, times every push, and prints the mean
cost per token over tokens 10-100, 1,000-1,100 and 9,900-10,000. Each window's figure is
the median over several runs (a shared machine's noise hits single runs, not the median).
Exit status 1 if the last window costs more than 3x the first: O(n) work per token at
10,000 tokens (~40 kB of text) would cost tens of times more than the first window.

    .venv/bin/python bench/text_cost.py
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time

from actord.serving.steps.text import TextState

N_TOKENS = 10_000
RUNS = 15
WINDOWS = [(10, 100), (1_000, 1_100), (9_900, 10_000)]
STOPS = ["</s>", "\n\nUser:", "###", "日本語"]
MAX_RATIO = 3.0


def pieces(n: int, seed: int = 7) -> list[bytes]:
    """Token pieces as a byte-level BPE vocabulary gives them, multi-byte chars split too."""
    rng = random.Random(seed)
    words = [f" {w}".encode() for w in "the model of a request slot page mind state token text and is to".split()]
    whole = [c.encode() for c in "中文字本語日。、é"] + [b".", b",", b"\n", b"<", b"/s", b"User"]
    split = [c.encode() for c in "😀👍🏽€𝄞ß"]
    out: list[bytes] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.7:
            out.append(rng.choice(words))
        elif r < 0.9:
            out.append(rng.choice(whole))
        else:  # a character cut inside its UTF-8 sequence, as byte-fallback tokens do
            b = rng.choice(split)
            k = rng.randrange(1, len(b))
            out.extend([b[:k], b[k:]])
    return out[:n]


def one_run(ps: list[bytes]) -> list[int]:
    ts = TextState(STOPS, stream=True)
    cost = [0] * len(ps)
    clock = time.perf_counter_ns
    for i, p in enumerate(ps):
        t0 = clock()
        _, stopped = ts.push(p)
        cost[i] = clock() - t0
        if stopped:
            sys.exit(f"bench invalid: a stop string hit at token {i}; the pieces must never complete one")
    ts.finish()
    return cost


def main() -> int:
    ps = pieces(N_TOKENS)
    per_window: list[list[float]] = [[] for _ in WINDOWS]
    gc.disable()  # collector pauses are noise unrelated to the code measured
    try:
        for _ in range(RUNS):
            cost = one_run(ps)
            for w, (a, b) in enumerate(WINDOWS):
                per_window[w].append(statistics.fmean(cost[a:b]) / 1e3)
    finally:
        gc.enable()
    means = [statistics.median(v) for v in per_window]
    n_bytes = sum(map(len, ps))
    print(f"TextState.push: {N_TOKENS} tokens ({n_bytes} bytes), {len(STOPS)} stop strings, streaming, "
          f"median of {RUNS} runs")
    for (a, b), m in zip(WINDOWS, means):
        print(f"  tokens {a:>5}-{b:<5}  {m:6.2f} us/token")
    ratio = means[-1] / means[0]
    verdict = "flat" if ratio <= MAX_RATIO else f"GROWS (limit {MAX_RATIO}x)"
    print(f"  last/first window  {ratio:6.2f}x  {verdict}")
    return 0 if ratio <= MAX_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
