"""The single-node daemon does not depend on the cluster: only actord/cluster imports ray,
and nothing outside it imports actord.cluster (the CLI reaches it lazily, by name)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "actord"


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_only_the_cluster_package_imports_ray():
    outside = [p for p in PKG.rglob("*.py") if PKG / "cluster" not in p.parents]
    assert [str(p) for p in outside if any(m == "ray" or m.startswith("ray.") for m in _imports(p))] == []


def test_nothing_outside_the_cluster_imports_it_at_module_level():
    for p in PKG.rglob("*.py"):
        if PKG / "cluster" in p.parents:
            continue
        top = ast.parse(p.read_text()).body
        mods = {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in mods if m.startswith("actord.cluster")], p


def test_the_cluster_cli_does_not_reach_back_into_the_daemon_cli():
    """frontends/cli.py reaches the cluster's CLI by name; what both need (Config's flags)
    lives below both, in frontends/config_flags.py: no import circle."""
    for p in (PKG / "cluster").rglob("*.py"):
        assert "actord.frontends.cli" not in _imports(p), p
