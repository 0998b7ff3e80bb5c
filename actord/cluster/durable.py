"""Small JSON files written crash-safely: a reader sees the old contents or the new, whole.

Write the new contents to a temporary name in the same folder (fsynced by the OS adapter's
`write_file`), rename it over the real name, fsync the folder (`durable_rename`). Used for
the router's directory and each node's fence records; page files have their own protocol
(storage/publish.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from actord.storage.osfs import OsFs

_enc = msgspec.json.Encoder()


def write_json(path: str | Path, value: Any, fs: OsFs | None = None) -> None:
    fs = fs or OsFs()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fs.write_file(tmp, [_enc.encode(value)])
    fs.durable_rename(tmp, path)


def read_json(path: str | Path, type: Any = Any, fs: OsFs | None = None) -> Any:
    """The file's value, or None when it does not exist."""
    fs = fs or OsFs()
    data = fs.read_file(Path(path))
    if data is None:
        return None
    return msgspec.json.decode(bytes(data), type=type)


def remove(path: str | Path, fs: OsFs | None = None) -> None:
    fs = fs or OsFs()
    path = Path(path)
    if fs.stat(path) is not None:
        fs.unlink(path)
        fs.dirsync(path.parent)
