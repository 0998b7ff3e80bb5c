"""Confine a client-supplied page-file name to the configured page folder.

A name arrives from a client (JSON-RPC, CLI) and becomes a path we write, rename over and
read. Everything is refused that could make it mean a file outside the folder, or one of
the publisher's own files: an empty name, an absolute path, a `..` component, a NUL byte,
a name that resolves (through symlinks, existing or not) outside the folder, and the
reserved `.actord-` names (stages, commit records, the folder lock). Sub-folders inside
the page folder are allowed.

The character set and depth are stated, not discovered: a name is at most `MAX_DEPTH`
components joined by `/` (so at most MAX_DEPTH - 1 folders), at most `MAX_NAME` bytes in
all, and each component is 1-`MAX_PART` characters of ASCII letters, digits and `_ @ + . -`,
not starting with `.` or `-`. Minds and in-RAM page names are one such component. A name
outside that set is refused before any file system call (a client once made 2000 nested
folders with a 4000-character `d/d/d/...`).

The check resolves symlinks with `Path.resolve`, the one OS call outside `osfs.py`: it is
validation of input, not part of publication, and needs no fault seam. It is a check at
one moment; a symlink swapped in afterwards by someone with write access to the page
folder is out of scope (that user can already rewrite the page files).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from actord.vocabulary.errors import PathRefused
from actord.vocabulary.names import LONGEST_SIDECAR, MAX_FILE_PART, check_part

# Names the publisher keeps for itself inside the page folder.
RESERVED_PREFIX = ".actord-"
LOCK_NAME = ".actord.lock"


MAX_DEPTH = 4
MAX_NAME = 512
def check_page_name(name: str) -> str:
    """An in-RAM page name (one component), or PathRefused."""
    why = check_part(name)
    if why is not None:
        raise PathRefused(f"page name refused: {why}", name=str(name)[:64], reason=why)
    return name


def _refuse(name: str, why: str) -> PathRefused:
    return PathRefused(f"page file name {name[:64]!r} refused: {why}", name=name[:256], reason=why)


def confine_file(root: Path, name: str) -> Path:
    """`confine` for a page file a client names: its last component also leaves room for
    the generation's sidecars (`name + ".ckpt"`, ...), so a save is refused before any work
    rather than once its sidecars are named."""
    path = confine(root, name)
    if len(PurePosixPath(name).name) > MAX_FILE_PART:
        raise _refuse(name, f"a file name is at most {MAX_FILE_PART} characters (its sidecars add up to "
                            f"{LONGEST_SIDECAR})")
    return path


def confine(root: Path, name: str) -> Path:
    """The absolute, symlink-resolved path of `name` inside `root`, or PathRefused."""
    if not isinstance(name, str) or name == "":
        raise _refuse(str(name), "empty name")
    if "\x00" in name:
        raise _refuse(name, "NUL byte in name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or name.startswith("~"):
        raise _refuse(name, "absolute path")
    parts = [p for p in pure.parts if p != "."]
    if ".." in parts:
        raise _refuse(name, "'..' component")
    if not parts or name.endswith("/"):
        raise _refuse(name, "names a folder, not a file")
    if any(p.startswith(RESERVED_PREFIX) or p == LOCK_NAME for p in parts):
        raise _refuse(name, "reserved name")
    if len(name) > MAX_NAME:
        raise _refuse(name, f"over {MAX_NAME} characters")
    if len(parts) > MAX_DEPTH:
        raise _refuse(name, f"deeper than {MAX_DEPTH} components")
    for p in parts:
        why = check_part(p)
        if why is not None:
            raise _refuse(name, why)
    base = Path(root).resolve()
    target = base.joinpath(*parts).resolve()
    if target == base or not target.is_relative_to(base):
        raise _refuse(name, "leads outside the page folder")
    rel = target.relative_to(base).parts
    if any(p.startswith(RESERVED_PREFIX) or p == LOCK_NAME for p in rel):
        raise _refuse(name, "resolves to a reserved name")
    return target
