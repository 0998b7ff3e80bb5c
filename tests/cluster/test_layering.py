"""The single-node daemon does not depend on the cluster: only actord/cluster imports ray,
and nothing outside it imports actord.cluster (the CLI reaches it lazily, by name)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_house import PKG, imported, parse


def _reaches(path: Path, module: str) -> bool:
    """Whether an import in the file (lazy ones included) reaches `module` or a name in it."""
    return any(m == module or m.startswith(module + ".") for m in imported(path))


def test_only_the_cluster_package_imports_ray():
    outside = [p for p in PKG.rglob("*.py") if PKG / "cluster" not in p.parents]
    assert [str(p) for p in outside if _reaches(p, "ray")] == []


def test_nothing_outside_the_cluster_imports_it_at_module_level():
    for p in PKG.rglob("*.py"):
        if PKG / "cluster" in p.parents:
            continue
        top = parse(p).body
        mods = {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in mods if m.startswith("actord.cluster")], p


def test_the_cluster_cli_does_not_reach_back_into_the_daemon_cli():
    """cli.py reaches the cluster's CLI by name; what both need (Config's flags)
    lives below both, in frontends/config_flags.py: no import circle."""
    for p in (PKG / "cluster").rglob("*.py"):
        assert not _reaches(p, "actord.cli"), p
