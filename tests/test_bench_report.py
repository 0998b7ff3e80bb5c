"""bench/report.py draws every benchmark's JSON figures into one self-contained HTML file,
and says "not run" for a benchmark that wrote none (bench/shared_prefix.py's included, in
the row shape it is being written to)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("matplotlib", reason="bench/report.py draws with matplotlib (the bench extra)")


def _figures(out: Path) -> None:
    out.mkdir()
    page = {"model": "synthetic llama", "tokens": 64, "state_bytes": 2e6, "page_bytes": 2.1e6, "reps": 3,
            "memcpy_gbps": 10.0, "cold_dst_gbps": 1.0, "page_out_gbps": 8.0, "page_in_gbps": 9.0,
            "page_out_e2e_gbps": 4.0, "page_in_e2e_gbps": 5.0}
    (out / "page_bandwidth.json").write_text(json.dumps({"rows": [page, {**page, "state_bytes": 8e6}]}))
    (out / "shared_prefix.json").write_text(json.dumps({"rows": [
        {"model": "tiny", "minds": m, "slots": 2, "prefix": 512, "sharing": s,
         "first_turn_prompt_tokens": 512 + 32 * m if s else 544 * m, "floor_tokens": 512 + 32 * m}
        for m in (1, 4, 16) for s in (True, False)]}))
    (out / "soak.json").write_text(json.dumps({"rows": [], "samples": []}))  # a run that sampled nothing


@pytest.mark.slow
def test_the_report_embeds_a_plot_per_benchmark_run_and_says_not_run_for_the_rest(tmp_path):
    out = tmp_path / "out"
    _figures(out)
    report = tmp_path / "report.html"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--out", str(report),
                        "--png-dir", str(tmp_path / "png")],
                       env={**os.environ, "ACTORD_BENCH_OUT": str(out)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    page = report.read_text()
    for name in ("page_bandwidth", "shared_prefix"):
        section = page.split(f'<section id="{name}">')[1].split("</section>")[0]
        assert "data:image/png;base64," in section and "not run" not in section, name
    for name in ("hot_path", "soak", "speculative"):
        section = page.split(f'<section id="{name}">')[1].split("</section>")[0]
        assert "not run" in section and f"bench/{name}.py" in section, name
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["page_bandwidth.png", "shared_prefix.png"]
    assert "http://" not in page and "https://" not in page  # one file, nothing loaded from elsewhere
