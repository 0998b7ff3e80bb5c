"""The house rules a newcomer relies on, checked over every import (lazy ones included):
the parts stand on floors, asks and imports go down, and nothing goes round in a circle.

    floor 9  __main__.py          `python -m actord`: the program, by its module name
    floor 8  cli.py               the program: dispatches to every part's subcommands
    floor 7  cluster/, replay/, testing/
    floor 6  frontends/           the socket, the HTTP fronts, the daemon, the client
    floor 5  service/             the façade a host holds (ActorSystem), its builder
    floor 4  chat/                prompts from messages, tools, choices, the chat turn
    floor 3  serving/             the actors and the pure per-token core (serving/steps)
    floor 2  engine/              the one thread that owns libllama, and its jobs
    floor 1  policy/, storage/
    floor 0  vocabulary/          errors, request types, config, log, metrics, models, the
                                  trace format: spoken on every floor

A module may import its own floor or one below, with no exception; replay/ reads traces
from above (vocabulary/trace.py is the format the service's recorder writes). Each folder
stands on one floor.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path
from typing import Iterator

PKG = Path(__file__).resolve().parents[1] / "actord"

FLOORS = {
    "actord.__main__": 9, "actord.cli": 8,
    "actord.cluster": 7, "actord.replay": 7, "actord.testing": 7,
    "actord.frontends": 6,
    "actord.service": 5,
    "actord.chat": 4,
    "actord.serving": 3,
    "actord.engine": 2,
    "actord.policy": 1, "actord.storage": 1,
    "actord.vocabulary": 0,
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def parse(path: Path) -> ast.Module:
    """`ast.parse` of a source file. CPython 3.11 keeps the AST converter's recursion count in
    state that another thread's AST work can disturb (gh-106905, fixed in 3.12): a parse that
    meets "AST constructor recursion depth mismatch" is a race in the interpreter, not in the
    file, so it is parsed once more."""
    source = path.read_text()
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of import nodes under `if TYPE_CHECKING:` (they never run)."""
    out: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            out.update(id(m) for s in n.body for m in ast.walk(s))
    return out


def imported(path: Path, *, runtime: bool = False) -> Iterator[str]:
    """Every name the file's imports reach, at module level or inside a function: `import a.b`
    gives "a.b", `from a.b import c` gives "a.b.c" (c a module or a name in a.b); relative
    imports are not followed (actord uses none). `runtime`: leave out imports for type
    checkers only."""
    tree = parse(path)
    skip = _type_only(tree) if runtime else set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            yield from (a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            yield from (f"{n.module}.{a.name}" for a in n.names)


def _edges(runtime: bool = False) -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = collections.defaultdict(set)
    for m, p in mods.items():
        for x in imported(p, runtime=runtime):
            r = resolve(x) if x.startswith("actord") else None
            if r and r not in (m, "actord"):
                edges[m].add(r)
    return edges


def floor(m: str) -> int:
    best = max((pre for pre in FLOORS if m == pre or m.startswith(pre + ".")), key=len)
    return FLOORS[best]


def test_every_module_stands_on_a_floor():
    assert [m for m in _modules() if m != "actord" and not any(m == p or m.startswith(p + ".") for p in FLOORS)] == []


def test_imports_go_down_the_floors_lazy_ones_included():
    up = sorted((m, d) for m, ds in _edges().items() if m != "actord" for d in ds if floor(d) > floor(m))
    assert up == []


def test_no_import_goes_round_in_a_circle():
    edges = _edges()  # every kind: lazy, and a type checker's own (a circle of annotations is one too)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_top_of_the_package_holds_at_most_five_modules():
    assert len(list(PKG.glob("*.py"))) <= 5


def test_each_folder_stands_on_one_floor():
    floors: dict[str, set[int]] = collections.defaultdict(set)
    for m in _modules():
        parts = m.split(".")
        if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()):
            floors[".".join(parts[:2])].add(floor(m))
    assert {f: sorted(fs) for f, fs in floors.items() if len(fs) > 1} == {}


def _own_classes() -> dict[str, list[tuple[str, list[str]]]]:
    """Each class of the package by name, with its module and its bases as written."""
    out: dict[str, list[tuple[str, list[str]]]] = collections.defaultdict(list)
    for m, p in _modules().items():
        for n in ast.walk(parse(p)):
            if isinstance(n, ast.ClassDef):
                out[n.name].append((m, [ast.unparse(b).split("[")[0].rpartition(".")[2] for b in n.bases]))
    return out


# None left: the Slot holds its memory, share and page-move parts (issue 36 part 1). This set
# may only shrink.
ASSEMBLED: set[str] = set()


def test_no_class_is_assembled_from_two_or_more_of_the_projects_own_classes():
    classes = _own_classes()
    assembled = {f"{m}.{name}" for name, defs in classes.items() for m, bases in defs
                 if sum(b in classes for b in bases) >= 2}
    assert assembled <= ASSEMBLED
