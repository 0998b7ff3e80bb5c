"""The docs' generated references (scripts/docs_reference.py) cover what they are generated
from: every `Config` field has a row with its flag and why, every JSON-RPC method an entry,
every HTTP route a line, and every page under docs/ is in mkdocs.yml's nav.

The generator is tested, not a built site: the suite stays fast and needs no mkdocs
(`make docs` builds the site, strict)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import msgspec
import pytest

from actord.frontends.rpc.methods import METHODS, Method, NoParams
from actord.vocabulary.config import Config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_field_has_a_row_with_its_flag_default_unit_and_why(gen):
    page = gen.config_reference()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", page, re.M)}
    for f in msgspec.structs.fields(Config):
        assert f.name in rows, f"Config.{f.name} has no entry in the configuration reference"
        cells = [c.strip() for c in rows[f.name].strip("|").split(" | ")]
        assert cells[1].startswith("`--" + f.name.replace("_", "-") + "`"), cells
        assert cells[2] and cells[3], cells
        assert cells[4] and cells[4] != "(undocumented)", f"Config.{f.name} has no comment saying why"


def test_a_config_field_without_a_comment_is_reported_undocumented(gen, monkeypatch):
    why, section = gen.field_comments()
    assert why["ctx"].startswith("total KV cells")  # a trailing comment
    assert "draft model" in why["spec_draft_model"]  # the block above several fields
    assert section["page_dir"] == "Pages"
    monkeypatch.setattr(gen, "field_comments", lambda: ({}, {}))
    assert gen.config_reference().count("(undocumented)") == len(msgspec.structs.fields(Config))


def test_every_rpc_method_has_an_entry(gen, monkeypatch):
    page = gen.rpc_reference()
    for name in METHODS:
        assert f"\n## {name}\n" in page, f"{name} has no entry in the JSON-RPC reference"
        assert f"[`{name}`]" in page
    monkeypatch.setitem(METHODS, "mind.probe", Method(NoParams, None, help="look at a mind"))  # type: ignore[arg-type]
    assert "\n## mind.probe\n" in gen.rpc_reference()  # a new method is in the next build


def test_every_http_route_is_listed(gen):
    from actord.frontends.http.app import HttpFront

    page = gen.http_routes()
    for r in HttpFront(None, Config(model="m.gguf")).routes():
        assert f"| `{r.path}` |" in page, r.path
    assert "| other |" not in page  # each route is named for its API


def test_every_docs_page_is_in_the_nav():
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")
             if p.parent.name != "reference"}
    assert pages <= nav, pages - nav
    assert {"reference/configuration.md", "reference/rpc.md", "reference/http-routes.md"} <= nav


@pytest.mark.slow
def test_the_site_builds_strict_with_no_warning(tmp_path):
    """What `make docs` runs, so CI (which runs the suite) checks the docs: a broken link or
    anchor, or a page out of the nav, fails here. Skipped where mkdocs is not installed."""
    import os
    import shutil
    import subprocess
    import sys

    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (scripts/bootstrap.sh installs the docs extra)")
    site = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", site, ignore=shutil.ignore_patterns("reference"))
    conf = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {site}")
    if f"docs_dir: {site}" not in conf:
        conf += f"\ndocs_dir: {site}\n"
    (tmp_path / "mkdocs.yml").write_text(conf)
    gen_run = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_reference.py"), str(site / "reference")],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert gen_run.returncode == 0, gen_run.stderr
    built = subprocess.run([str(mkdocs), "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"),
                            "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    assert "WARNING" not in built.stderr, built.stderr[-3000:]
