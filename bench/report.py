"""One HTML report of the benchmarks, with plots: `bench/out/report.html`.

Why: the benchmarks print tables, each read alone; what matters is often a shape (how a
page move scales with the state's size, orchestration with slots, first-turn cost with the
number of minds sharing a prefix, memory over a soak), which a plot shows at a glance.
`make bench` runs this last. It reads the figures each benchmark wrote as JSON
(`bench/out/NAME.json`, through bench/_out.py) and draws them with matplotlib, embedded in
the one file as PNG (no other file to carry, nothing loaded from elsewhere); a benchmark
with no figures is shown as "not run", with the command that runs it.

    .venv/bin/python bench/report.py                 # draw what bench/out/ holds
    .venv/bin/python bench/report.py --run           # run each benchmark first, smallest options
    .venv/bin/python bench/report.py --png-dir DIR   # also save each plot as DIR/NAME.png

The plots:
- page_bandwidth: page_out / page_in GB/s (the engine's copy, and end to end through the
  actors) against the state's size, beside memcpy of the same bytes in the same run;
- hot_path: µs per engine step against slots, actord beside the raw llama_cpp loop (and the
  orchestration alone over the stand-in engine);
- soak: the daemon's RSS and open fds over the soak;
- speculative: tokens per target forward against k, per draft;
- shared_prefix: first-turn prompt tokens against the number of minds, with and without
  prefix sharing, beside the floor (bench/shared_prefix.py's rows).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _out  # noqa: E402

# name -> (title, what the plot shows, the arguments of its smallest useful run)
BENCHES: dict[str, tuple[str, str, list[str]]] = {
    "page_bandwidth": ("Page moves against memcpy",
                       "GB/s of page_out and page_in (the engine's copy, and end to end through the actors) "
                       "against the state's size, beside memcpy of the same bytes measured in the same run.",
                       ["--skip-real", "--skip-draft", "--big-layers", "8", "--sizes", "64", "256", "1024", "2048",
                        "--reps", "3", "--threads", "1"]),
    "hot_path": ("Orchestration per step against slots",
                 "µs per engine step: actord beside a raw llama_cpp loop of the same batch shape (tiny f32 "
                 "llama), and the orchestration alone over the stand-in engine that answers at once.",
                 ["--quick", "--no-gemma"]),
    "soak": ("Memory and fds over a soak",
             "The daemon's RSS and open file descriptors, sampled through a mixed socket + HTTP workload "
             "with floods and page moves.",
             ["--minutes", "0.5", "--sample-s", "2"]),
    "speculative": ("Speculation: tokens per target forward",
                    "Tokens per target forward against the draft length k, per draft (k = 0: plain decoding).",
                    ["--cases", "llama", "--k", "1", "2", "3", "4", "6", "--n-predict", "24", "--threads", "1"]),
    "shared_prefix": ("First-turn prompt tokens with shared prefixes",
                      "Prompt tokens processed by the minds' first turns against the number of minds, with and "
                      "without prefix sharing, beside the floor (the tokens no sharing can avoid).",
                      []),
}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on these machines
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "font.size": 9,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


def log_x(fig: Any, ax: Any, ticks: list[float], xlabel: str, ylabel: str, base: int = 10) -> Any:
    """A plot over a logarithmic x axis, ticked at the values measured, labelled, with its legend."""
    ax.set_xscale("log", base=base)
    plain_ticks(ax.xaxis, ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    return fig


def plain_ticks(axis: Any, values: list[float]) -> None:
    """Ticks at the values measured, written as numbers (not 2^3 or 10^1)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    axis.set_major_locator(FixedLocator(values))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    axis.set_minor_locator(NullLocator())


def plot_page_bandwidth(doc: dict[str, Any], plt: Any) -> Any:
    rows = sorted(doc.get("rows", []), key=lambda r: r["state_bytes"])
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_model[r["model"]].append(r)
    markers = iter("osD^v")
    for model, rs in by_model.items():
        x = [r["state_bytes"] / 1e6 for r in rs]
        m = next(markers, "o")
        ax.plot(x, [r["memcpy_gbps"] for r in rs], m + "-", color="0.45", label=f"memcpy ({model})")
        ax.plot(x, [r["page_out_gbps"] for r in rs], m + "-", color="#2f6fdf", label=f"page_out copy ({model})")
        ax.plot(x, [r["page_in_gbps"] for r in rs], m + "-", color="#1f9d74", label=f"page_in copy ({model})")
        ax.plot(x, [r["page_out_e2e_gbps"] for r in rs], m + ":", color="#2f6fdf", label=f"page_out end to end ({model})")
        ax.plot(x, [r["page_in_e2e_gbps"] for r in rs], m + ":", color="#1f9d74", label=f"page_in end to end ({model})")
    return log_x(fig, ax, sorted({r["state_bytes"] / 1e6 for r in rows}), "sequence state (MB, log)", "GB/s")


def plot_hot_path(doc: dict[str, Any], plt: Any) -> Any:
    rows = doc.get("rows", [])
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    a = sorted((r for r in rows if r["part"] == "a"), key=lambda r: r["slots"])
    b = sorted((r for r in rows if r["part"] == "b"), key=lambda r: r["slots"])
    if b:
        xs = [r["slots"] for r in b]
        ax.plot(xs, [r["raw_us_per_step"] for r in b], "s-", color="0.35", label="raw llama_cpp loop (tiny llama)")
        ax.plot(xs, [r["actord_us_per_step"] for r in b], "o-", color="#2f6fdf", label="actord, default depth")
        ax.plot(xs, [r["actord_deep_us_per_step"] for r in b], "o--", color="#7a4fd6",
                label=f"actord, pipeline depth {b[0].get('deep_pipeline_depth', '')}")
    if a:
        ax.plot([r["slots"] for r in a], [r["actord_us_per_step"] for r in a], "^-", color="#b7791f",
                label="orchestration alone (stand-in engine)")
    for r in rows:
        if r["part"] == "c":
            ax.plot([r["slots"]], [r["raw_us_per_step"]], "x", color="0.2", label="raw loop, Gemma 3 270M")
            ax.plot([r["slots"]], [r["actord_us_per_step"]], "+", color="#c2413b", label="actord, Gemma 3 270M")
    ax.set_yscale("log")
    return log_x(fig, ax, sorted({r["slots"] for r in rows}), "slots (log)", "µs per engine step (log)", base=2)


def plot_soak(doc: dict[str, Any], plt: Any) -> Any:
    samples = doc.get("samples", [])
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    t = [s["t_s"] for s in samples]
    ax.plot(t, [s["rss_mb"] for s in samples], "-", color="#2f6fdf", label="RSS (MB)")
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("RSS (MB)", color="#2f6fdf")
    ax2 = ax.twinx()
    ax2.plot(t, [s["fds"] for s in samples], "-", color="#b7791f", label="open fds")
    ax2.set_ylabel("open fds", color="#b7791f")
    ax2.grid(False)
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    return fig


def plot_speculative(doc: dict[str, Any], plt: Any) -> Any:
    rows = doc.get("rows", [])
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(max(6.4, 4.2 * len(cases)), 3.6), squeeze=False)
    for ax, case in zip(axes[0], cases):
        rs = [r for r in rows if r["case"] == case]
        plain = next((r for r in rs if r["draft"] == "plain"), None)
        base = plain["tokens_per_forward"] if plain else 1.0
        for draft in dict.fromkeys(r["draft"] for r in rs if r["draft"] != "plain"):
            d = sorted((r for r in rs if r["draft"] == draft), key=lambda r: r["k"])
            ax.plot([0] + [r["k"] for r in d], [base] + [r["tokens_per_forward"] for r in d], "o-", label=draft)
        ax.axhline(base, color="0.5", lw=0.8, ls="--")
        ax.set_title(case, fontsize=8)
        ax.set_xlabel("k (draft tokens per step)")
        ax.set_ylabel("tokens per target forward")
        ax.legend(fontsize=7)
    return fig


def plot_shared_prefix(doc: dict[str, Any], plt: Any) -> Any:
    """One panel per prefix length: first-turn prompt tokens against the number of minds,
    sharing on and off per slot count, and the floor (one prefix, then the suffixes); the
    model with the most rows (the grid runs on the tiny llama), log scale."""
    rows = doc.get("rows", [])
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[r.get("model", "")] += 1
    model = max(counts, key=lambda m: counts[m]) if counts else ""
    mine = [r for r in rows if r.get("model", "") == model]
    prefixes = sorted({r.get("prefix", 0) for r in mine}) or [0]
    fig, axes = plt.subplots(1, len(prefixes), figsize=(3.4 * len(prefixes) + 0.6, 3.6), squeeze=False)
    colors = ["#2f6fdf", "#1f9d74", "#b7791f", "#7a4fd6"]
    for ax, prefix in zip(axes[0], prefixes):
        rs = [r for r in mine if r.get("prefix", 0) == prefix]
        for k, slots in enumerate(sorted({r.get("slots", 0) for r in rs})):
            for sharing, style in ((True, "o-"), (False, "s--")):
                s = sorted((r for r in rs if r.get("slots", 0) == slots and bool(r.get("sharing")) is sharing),
                           key=lambda r: r["minds"])
                if s:
                    ax.plot([r["minds"] for r in s], [r["first_turn_prompt_tokens"] for r in s], style,
                            color=colors[k % len(colors)],
                            label=f"{slots} slots, {'sharing' if sharing else 'no sharing'}")
        floor = sorted({(r["minds"], r["floor_tokens"]) for r in rs if r.get("floor_tokens") is not None})
        if floor:
            ax.plot([x for x, _ in floor], [y for _, y in floor], ":", color="0.3", label="floor")
        ax.set_yscale("log")
        ax.set_title(f"{model}, prefix {prefix}", fontsize=9)
        ax.set_xlabel("minds")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("first-turn prompt tokens (log)")
    fig.tight_layout()
    return fig


PLOTS: dict[str, Callable[[dict[str, Any], Any], Any]] = {
    "page_bandwidth": plot_page_bandwidth, "hot_path": plot_hot_path, "soak": plot_soak,
    "speculative": plot_speculative, "shared_prefix": plot_shared_prefix,
}


def run_benches(names: list[str]) -> None:
    for name in names:
        args = BENCHES[name][2]
        script = HERE / f"{name}.py"
        if not script.exists():
            print(f"report: {script.name} is not here: not run", flush=True)
            continue
        print(f"report: running {script.name} {' '.join(args)}", flush=True)
        subprocess.run([sys.executable, str(script), *args], check=False)


def figure_png(fig: Any, plt: Any) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def summary(name: str, doc: dict[str, Any]) -> str:
    """A line of the figures' headline numbers beside the plot."""
    rows = doc.get("rows", [])
    if name == "page_bandwidth" and rows:
        r = max(rows, key=lambda r: r["state_bytes"])
        return (f"At {r['state_bytes'] / 1e6:.0f} MB: page_out {r['page_out_gbps']:.1f} GB/s, page_in "
                f"{r['page_in_gbps']:.1f} GB/s, memcpy {r['memcpy_gbps']:.1f} GB/s.")
    if name == "hot_path":
        b = [r for r in rows if r["part"] == "b"]
        return " ".join(f"{r['slots']} slots: actord/raw {r['actord_deep_us_per_step'] / r['raw_us_per_step']:.2f}."
                        for r in b)
    if name == "soak" and doc.get("rss_mb"):
        return (f"{doc.get('requests', 0)} requests, {sum((doc.get('hangs') or {}).values())} hangs; RSS "
                f"{doc['rss_mb']['first']} -> {doc['rss_mb']['last']} MB (max {doc['rss_mb']['max']}), fds "
                f"{doc['fds']['first']} -> {doc['fds']['last']}.")
    if name == "speculative" and rows:
        best = max(rows, key=lambda r: r["tokens_per_forward"])
        return f"Best: {best['tokens_per_forward']:.2f} tokens per forward ({best['draft']}, k={best['k']}, {best['case']})."
    return ""


def section(name: str, plt: Any, png_dir: Path | None) -> str:
    title, what, small = BENCHES[name]
    doc = _out.read(name)
    head = f'<section id="{name}"><h2>{html.escape(title)}</h2><p>{html.escape(what)}</p>'
    if doc is None or not (doc.get("rows") or doc.get("samples")):
        cmd = f".venv/bin/python bench/{name}.py {' '.join(small)}".strip()
        return head + (f'<p class="notrun">not run: no figures in bench/out/{name}.json '
                       f"(<code>{html.escape(cmd)}</code> writes them).</p></section>")
    try:
        png = figure_png(PLOTS[name](doc, plt), plt)
    except (KeyError, TypeError, ValueError) as e:  # figures of another shape: said, not drawn
        return head + f'<p class="notrun">figures in bench/out/{name}.json could not be drawn: {html.escape(repr(e))}</p></section>'
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        (png_dir / f"{name}.png").write_bytes(png)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(doc.get("written", 0)))
    argv = " ".join(doc.get("argv", []))
    host = doc.get("host", {})
    return (head + f'<img alt="{html.escape(title)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
            f"<p>{html.escape(summary(name, doc))}</p>"
            f'<p class="meta">bench/{name}.py {html.escape(argv)} · written {when} · '
            f"{host.get('cpus', '?')} CPUs ({html.escape(str(host.get('machine', '')))})</p></section>")


STYLE = """body{font:14px/1.45 system-ui,sans-serif;color:#1d2330;max-width:980px;margin:2rem auto;padding:0 1rem}
section{border-top:1px solid #dde1ea;padding:.6rem 0 1rem}img{max-width:100%}.meta{color:#6b7385;font-size:.85rem}
.notrun{color:#b7791f;font-weight:600}code{background:#f2f4f8;padding:0 .2rem}"""


def report(png_dir: Path | None) -> str:
    plt = _plt()
    body = "".join(section(name, plt, png_dir) for name in BENCHES)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>actord benchmarks</title>'
            f"<style>{STYLE}</style></head><body><h1>actord benchmarks</h1>"
            f"<p>Each plot is drawn from the figures its benchmark wrote to bench/out/ (measured side by side in "
            f"one run on the machine named under it; these machines are shared, so read ratios, not absolutes). "
            f"Generated {time.strftime('%Y-%m-%d %H:%M')} by bench/report.py.</p>{body}</body></html>\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", nargs="*", choices=sorted(BENCHES), metavar="NAME",
                    help="run these benchmarks first with their smallest options (none named: all)")
    ap.add_argument("--out", default=str(_out.OUT / "report.html"))
    ap.add_argument("--png-dir", default=None, help="also save each plot as PNG here")
    a = ap.parse_args(argv)
    if a.run is not None:
        run_benches(a.run or list(BENCHES))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(Path(a.png_dir) if a.png_dir else None))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
