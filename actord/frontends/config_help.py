"""Config's own words about each field: why it exists (its comment in actord/vocabulary/config.py),
its unit and its default as a person reads them.

Why a module: `actord serve --help` and the generated configuration reference
(scripts/docs_reference.py, `make docs`) say the same things about every flag, so both read
them here, from the one place a field is documented: the comment it carries. A field's
"why" is its trailing comment, else the comment block above it (a block above several
fields explains them together); a one-line comment that is no sentence heads a section.
"""

from __future__ import annotations

import functools
import inspect
import io
import tokenize
from typing import Any

import msgspec

from actord.vocabulary.config import Config

UNITS = (("_bytes", "bytes"), ("_s", "seconds"), ("_ms", "milliseconds"), ("_tokens", "tokens"))
TOKEN_FIELDS = {"ctx": "tokens (KV cells)", "batch": "tokens", "piece_tile": "positions", "checkpoint_every": "tokens",
                "spec_n_max": "tokens"}


@functools.lru_cache(maxsize=1)
def field_comments() -> tuple[dict[str, str], dict[str, str]]:
    """Config field -> its comment (trailing, else the block above it), and field -> the
    section it stands in (a one-line heading comment such as `# Pages`)."""
    try:
        source = inspect.getsource(Config)
    except SystemError:
        # CPython 3.11 keeps the AST converter's recursion count in state another thread's
        # AST work (a template compiling on a render thread) can disturb (gh-106905, fixed in
        # 3.12): "AST constructor recursion depth mismatch" is the interpreter's race, not
        # the file's, so the source is read once more.
        source = inspect.getsource(Config)
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    names = {f.name for f in msgspec.structs.fields(Config)}
    why: dict[str, str] = {}
    section: dict[str, str] = {}
    block: list[str] = []  # the comment block above the fields that follow it
    fresh = False  # the block ends right above this line
    heading = ""
    for no, line in enumerate(lines, 1):
        text = line.strip()
        if text.startswith(("def ", "@")):
            break
        if text.startswith("#"):
            c = comments.get(no, "")
            if not fresh and _is_heading(c):
                heading, block = c, []
                continue
            block = [*block, c] if fresh else [c]
            fresh = True
            continue
        name = text.split(":", 1)[0].strip()
        if name in names:
            own = comments.get(no, "")
            why[name] = (own + ". " + " ".join(block) if fresh and block else own) if own else " ".join(block)
            section[name] = heading
            fresh = False
            continue
        block, fresh = [], False  # a blank line or other code ends a block
    return why, section


def _is_heading(comment: str) -> bool:
    """`# Pages`: a short comment that is no sentence names the section below it."""
    return bool(comment) and len(comment.split()) <= 6 and not comment.endswith((".", ":", ")")) \
        and "," not in comment


def unit(name: str, typ: Any) -> str:
    if name in TOKEN_FIELDS:
        return TOKEN_FIELDS[name]
    for suffix, u in UNITS:
        if name.endswith(suffix):
            return u
    if typ is bool:
        return "on/off"
    if typ is int:
        return "count"
    if typ is float:
        return "number"
    return "text" if typ in (str, str | None) else "list"


def show_default(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return "[]" if not value else ", ".join(map(str, value))
    if isinstance(value, int) and not isinstance(value, bool) and name.endswith("_bytes") and value >= 1 << 20:
        for n, u in ((1 << 30, "GiB"), (1 << 20, "MiB")):
            if value % n == 0:
                return f"{value} ({value // n} {u})"
        return str(value)
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


