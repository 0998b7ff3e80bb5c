"""`actord serve --config actord.toml`: the configuration file, read and checked, and the
effective configuration written back (`actord config show`).

Why a file beside the flags: a daemon run as a service keeps its settings in one file an
operator can read, diff and ship (every daemon users run takes one). The file holds the
same fields as the flags, spelled as `Config`'s field names (`ctx_checkpoints_bytes = ...`),
so there is still one typed home for a setting; flags given on the command line override
the file. A key that is no field, or a value of the wrong type, is refused by name
(InvalidParams, so `actord serve` exits 2) before anything starts: a typo in a file must no
more be ignored than a typo in a flag. Paths in the file are taken as written (relative
ones from the daemon's working directory, as for flags).

TOML is read with the standard library's `tomllib`; writing it back needs only scalars and
lists of them (Config has nothing else), so a few lines here do it, and no dependency.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from typing import Any

import msgspec

from actord.vocabulary.config import Config
from actord.vocabulary.errors import InvalidParams

_FIELDS = {f.name: f for f in msgspec.structs.fields(Config)}


def read_config_file(path: str) -> dict[str, Any]:
    """The file's settings, each checked against its field's type (not yet against the
    others: `Config.validate` does that once the flags are in)."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise InvalidParams(f"cannot read the config file {path}: {e.strerror}", config=path) from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidParams(f"the config file {path} is not valid TOML: {e}", config=path) from None
    out: dict[str, Any] = {}
    for key, value in doc.items():
        field = _FIELDS.get(key)
        if field is None:
            close = difflib.get_close_matches(key.replace("-", "_"), list(_FIELDS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else "; see actord serve --help"
            raise InvalidParams(f"{path}: unknown key {key!r}{hint}", config=path, key=key)
        try:  # strict: true is not 1, "4" is not 4; an int is a float
            out[key] = msgspec.convert(value, field.type, strict=True)
        except msgspec.ValidationError:
            raise InvalidParams(f"{path}: {key} must be {_type_name(field.type)}, not {type(value).__name__} "
                                f"{value!r}", config=path, key=key) from None
    return out


def _type_name(t: Any) -> str:
    if t == str | None:
        return "a string"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            list[str]: "a list of strings", list[int]: "a list of integers"}.get(t, str(t))


def _toml_value(v: Any) -> str:
    # JSON's spelling of a string, number, bool or list of them is TOML's too (for the
    # finite floats and the strings Config holds).
    return json.dumps(v, ensure_ascii=False)


def render(config: Config, fmt: str = "toml") -> str:
    """The configuration as a file `--config` reads back (TOML), or as JSON. Unset optional
    fields (None) have no TOML spelling: they are written as comments."""
    values = msgspec.structs.asdict(config)
    if fmt == "json":
        return json.dumps(values, indent=2, ensure_ascii=False)
    lines = ["# actord's effective configuration (actord config show)"]
    for name, v in values.items():
        lines.append(f"# {name} = (unset)" if v is None else f"{name} = {_toml_value(v)}")
    return "\n".join(lines)
