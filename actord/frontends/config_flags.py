"""Command-line flags generated from `Config`'s fields, and the Config they parse back to.

`actord serve` and `actord cluster up` (a cluster's node flags) take the same flags, so
they live here, below both CLIs: configuration has one typed home and a new setting is a
flag the moment it exists. Nothing here imports a CLI, so `actord.cluster.cli` reaches these
without reaching back into `actord.cli` (which reaches the cluster lazily).
`--config FILE` names a TOML file of the same fields (config_file.py); a flag given
overrides the file's value.
"""

from __future__ import annotations

import argparse
import difflib

import msgspec

from actord.frontends.config_file import read_config_file
from actord.vocabulary.config import BACKEND_SAMPLING_MODES, FLASH_ATTN_MODES, SWA_FULL_MODES, Config
from actord.vocabulary.models import default_model

# llama-server's names for the same settings, accepted as aliases so a habit does not start
# a daemon that is not what was asked. Only exact equivalents: `--lora` loads an adapter
# active at scale 1 (as `--gene` does); llama-server flags with no actord meaning
# (`--port`, `--mlock`, ...) are refused like any unknown flag.
LLAMA_SERVER_ALIASES: dict[str, list[str]] = {
    "model": ["-m"],
    "ctx": ["--ctx-size", "-c"],
    "slots": ["--parallel", "-np"],
    "batch": ["--batch-size", "-b"],
    "threads": ["-t"],
    "gene": ["--lora"],
    "model_alias": ["--alias"],
    "cache_type_k": ["-ctk"],
    "cache_type_v": ["-ctv"],
}

# Modes whose bare flag means "on" (`--flash-attn`, as llama-server's -fa).
_MODES = {"swa_full": SWA_FULL_MODES, "flash_attn": FLASH_ATTN_MODES, "backend_sampling": BACKEND_SAMPLING_MODES}


def flag_help(f: msgspec.structs.FieldInfo) -> str:
    """A Config field's flag help: why the field exists (its comment in config.py), its
    default and unit (config_help.py, which the generated configuration reference reads too)."""
    from actord.frontends.config_help import field_comments, show_default, unit

    why = field_comments()[0].get(f.name, "")
    default = "required" if f.required else show_default(f.name, f.default if f.default is not msgspec.NODEFAULT
                                                         else f.default_factory())
    return f"{why} [default: {default}; {unit(f.name, f.type)}]".lstrip().replace("%", "%%")


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per Config field (`--ctx-checkpoints-bytes` for `ctx_checkpoints_bytes`),
    default None: a flag not given leaves the field's own default; its help is `flag_help`."""
    for f in msgspec.structs.fields(Config):
        flag = ["--" + f.name.replace("_", "-"), *LLAMA_SERVER_ALIASES.get(f.name, [])]
        typ = f.type
        kw = {"dest": f.name, "default": None, "help": flag_help(f)}
        if f.name in _MODES:
            p.add_argument(*flag, nargs="?", const="on", choices=_MODES[f.name], **kw)
        elif typ is bool:
            p.add_argument(*flag, action=argparse.BooleanOptionalAction, **kw)
        elif typ == list[str]:
            p.add_argument(*flag, action="append", **kw)
        elif typ == list[int]:  # --allow-uid 1000 --allow-uid 1001
            p.add_argument(*flag, action="append", type=int, **kw)
        elif typ in (int, float, str):
            p.add_argument(*flag, type=typ, **kw)
        else:  # optional str
            p.add_argument(*flag, type=str, **kw)


def add_config_file_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="a TOML file of these settings (field names: "
                   "ctx_checkpoints_bytes = ...); flags given override it")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """`actord serve`'s flags: Config's, its file, and how the daemon logs."""
    add_config_flags(p)
    add_config_file_flag(p)
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line (structlog)")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error [default: info]")


def unknown_flag_message(parser: argparse.ArgumentParser, rest: list[str]) -> str:
    """`--slotz` -> "unknown flag --slotz (did you mean --slots?)"."""
    word = next((w for w in rest if w.startswith("-")), rest[0])
    name = word.split("=", 1)[0]
    if not name.startswith("-"):
        return f"unexpected argument {word!r}"
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"unknown flag {name}" + (f" (did you mean {close[0]}?)" if close else "; see actord serve --help")


def config_from_args(ns: argparse.Namespace) -> Config:
    """The Config the flags give, over `--config`'s file where one is named (InvalidParams:
    a key or value the file should not have, or settings that do not go together)."""
    path = getattr(ns, "config", None)
    values = read_config_file(path) if path else {}
    values.update({f.name: getattr(ns, f.name) for f in msgspec.structs.fields(Config)
                   if getattr(ns, f.name, None) is not None})
    if "model" not in values:
        values["model"] = str(default_model())
    return msgspec.convert(values, Config).validate()


def serve_config(argv: list[str]) -> Config:
    """`actord serve ARGV`'s Config, or SystemExit(2) with the message on stderr (unknown
    flags refused, with the closest known one suggested)."""
    # No abbreviations: `--slot 4` must not quietly mean `--slots 4`, nor a typo anything.
    serve = argparse.ArgumentParser(prog="actord serve", allow_abbrev=False)
    add_serve_flags(serve)
    ns, rest = serve.parse_known_args(argv)
    if rest:
        serve.exit(2, f"actord serve: {unknown_flag_message(serve, rest)}\n")
    return config_from_args(ns)
