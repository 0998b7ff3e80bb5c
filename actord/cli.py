"""`actord`: the daemon (`serve`) and a client verb for every JSON-RPC method.

`serve`'s flags are generated from `Config`'s fields (config_flags.py), and the client verbs
from the method table (rpc/methods.py), so each has one typed home and a new setting is a
flag, a new method a verb, the moment it exists. A method's verb is its name with dashes
(`page.out` -> `actord page-out`), its params Struct's required fields are the verb's
arguments in order and its other fields `--flags`, sent only when given (the daemon's
defaults hold), and its help is the method's. Two verbs are written by hand (`_SUGAR`):
`complete` (a text prompt; `--stream` prints as it comes) and `chat` (messages from a file or
stdin). Some verbs keep older, shorter names as aliases (`_ALIASES`: `actord spill`).
`call METHOD JSON` calls any method with raw params.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
from msgspec import inspect as mi

from actord.frontends.config_flags import (
    add_config_file_flag, add_config_flags, add_serve_flags, config_from_args, unknown_flag_message,
)
from actord.frontends.rpc.methods import METHODS
from actord.vocabulary.config import Config
from actord.vocabulary.errors import ActordError

# Names the verbs had before they were generated, kept so every command line still works.
_ALIASES: dict[str, list[str]] = {
    "slot.list": ["slots"],
    "slot.erase": ["erase"],
    "page.list": ["pages"],
    "page.spill": ["spill"],
    "slot.save": ["save"],
    "slot.restore": ["restore"],
    "gene.list": ["genes"],
}


def verb_name(method: str) -> str:
    """A method's generated verb: `gene.page_out` -> `gene-page-out`."""
    return method.replace(".", "-").replace("_", "-")


# -- verbs generated from a method's params Struct ----------------------------------------

_SCALARS: dict[type, Callable[[str], Any]] = {mi.IntType: int, mi.FloatType: float, mi.StrType: str}


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")
    return text.lower() in ("true", "1")


def _arg_kind(t: Any) -> tuple[str, Callable[[str], Any], str]:
    """How a param of type `t` is written: ("one" | "list" | "bool", its parser, its label).
    Optional[X] is X; a type with no plain spelling (a list of Structs, a union) is JSON."""
    info = mi.type_info(t)
    if isinstance(info, mi.UnionType):
        rest = [x for x in info.types if not isinstance(x, mi.NoneType)]
        info = rest[0] if len(rest) == 1 else info
    if isinstance(info, mi.BoolType):
        return "bool", _bool, "bool"
    if isinstance(info, mi.LiteralType) and all(isinstance(v, str) for v in info.values):
        return "one", str, "|".join(info.values)
    if type(info) in _SCALARS:
        conv = _SCALARS[type(info)]
        return "one", conv, conv.__name__
    if isinstance(info, mi.ListType) and type(info.item_type) in _SCALARS:
        conv = _SCALARS[type(info.item_type)]
        return "list", conv, conv.__name__
    return "one", json.loads, "JSON"


def _add_params(v: argparse.ArgumentParser, params: type) -> list[str]:
    """The params Struct's fields as `v`'s arguments; their names. Each is stored under
    `param_NAME`, apart from the CLI's own (`--socket`)."""
    names = []
    for f in msgspec.structs.fields(params):
        kind, conv, label = _arg_kind(f.type)
        dest = "param_" + f.name
        names.append(f.name)
        if f.required:
            nargs = "*" if kind == "list" else None
            v.add_argument(dest, metavar=f.name, type=conv, nargs=nargs, help=label)
            continue
        default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
        flag, shown = "--" + f.name.replace("_", "-"), msgspec.json.encode(default).decode().replace("%", "%%")
        if kind == "bool":
            v.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                           help=f"default {shown}")
        else:
            v.add_argument(flag, dest=dest, metavar=f.name.upper(), type=conv,
                           action="append" if kind == "list" else "store", default=None,
                           help=f"{label}, default {shown}")
    return names


def _generated_params(ns: argparse.Namespace) -> dict[str, Any]:
    return {n: getattr(ns, "param_" + n) for n in ns.param_names if getattr(ns, "param_" + n) is not None}


# -- verbs written by hand ----------------------------------------------------------------


def _genes(specs: list[str]) -> list[dict[str, Any]]:
    return [{"id": int(g.split(":")[0]), "scale": float(g.split(":")[1]) if ":" in g else 1.0} for g in specs]


def _complete_args(comp: argparse.ArgumentParser) -> None:
    comp.add_argument("prompt")
    comp.add_argument("-n", "--n-predict", type=int, default=32)
    comp.add_argument("--slot", type=int)
    comp.add_argument("--mind", help="a named session (the daemon, or a cluster's router, places it)")
    comp.add_argument("--temperature", type=float, default=0.0)
    comp.add_argument("--seed", type=int)
    comp.add_argument("--stream", action="store_true")
    comp.add_argument("--gene", action="append", default=[], help="ID[:SCALE]")


def _complete_params(ns: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"prompt": ns.prompt, "n_predict": ns.n_predict, "temperature": ns.temperature,
                              "stream": ns.stream}
    for name in ("slot", "mind", "seed"):
        if getattr(ns, name) is not None:
            params[name] = getattr(ns, name)
    if ns.gene:
        params["genes"] = _genes(ns.gene)
    return params


def _chat_args(chat: argparse.ArgumentParser) -> None:
    chat.add_argument("messages", nargs="?", default="-",
                      help="JSON file with [{role, content}, ...] or {\"messages\": [...]}; - = stdin")
    chat.add_argument("-n", "--n-predict", type=int, default=256)
    chat.add_argument("--mind")
    chat.add_argument("--slot", type=int)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int)
    chat.add_argument("--stream", action="store_true", help="print the reply as it is generated")
    chat.add_argument("--template", help="a Jinja2 chat template file to use instead of the model's")
    chat.add_argument("--gene", action="append", default=[], help="ID[:SCALE]")


def _chat_params(ns: argparse.Namespace) -> dict[str, Any]:
    """The `chat` call's params: messages from a file or stdin, flags for the rest."""
    raw = sys.stdin.read() if ns.messages == "-" else open(ns.messages, encoding="utf-8").read()
    doc = json.loads(raw)
    messages = doc.get("messages") if isinstance(doc, dict) else doc
    if not isinstance(messages, list):
        raise ValueError("expected a JSON list of {role, content} messages or {\"messages\": [...]}")
    params: dict[str, Any] = {"messages": messages, "n_predict": ns.n_predict, "temperature": ns.temperature,
                              "stream": ns.stream}
    for name in ("mind", "slot", "seed"):
        if getattr(ns, name) is not None:
            params[name] = getattr(ns, name)
    if ns.template:
        params["template"] = open(ns.template, encoding="utf-8").read()
    if ns.gene:
        params["genes"] = _genes(ns.gene)
    return params


def _chat_streamed(out: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat's answer, its text already printed: the message and the usage."""
    return {"message": out["message"], "usage": {
        k: out["completion"][k] for k in ("n_prompt_tokens", "n_cached", "n_prompt_processed")}}


@dataclass(frozen=True)
class _Sugar:
    """A verb written by hand over its method: its arguments, the params they make (an
    OSError or ValueError there is a usage error), and its streamed answer's shape."""

    verb: str
    add_args: Callable[[argparse.ArgumentParser], None]
    params: Callable[[argparse.Namespace], dict[str, Any]]
    streamed: Callable[[dict[str, Any]], dict[str, Any]] = lambda out: out


_SUGAR: dict[str, _Sugar] = {
    "completion": _Sugar("complete", _complete_args, _complete_params),
    "chat": _Sugar("chat", _chat_args, _chat_params, _chat_streamed),
}


def verbs() -> dict[str, str]:
    """Every client verb, aliases included -> the method it calls."""
    out = {}
    for method in METHODS:
        names = [_SUGAR[method].verb] if method in _SUGAR else []
        for v in [*names, verb_name(method), *_ALIASES.get(method, [])]:
            out[v] = method
    return out


# What `actord --help` tells a user (the module docstring above is for whoever edits this file).
DESCRIPTION = """\
actord serves many long-lived LLM sessions ("minds") on a few slots of one model: a mind
switch moves her state to a RAM page and back (a memory copy, not a re-prefill), pages spill
to crash-safe files, and LoRA adapters ("genes") page between device and host. `actord serve`
runs the daemon (a JSON-RPC Unix socket; with --http, OpenAI, Anthropic and llama-server
routes too); every other verb is a client of a running daemon.

examples:
  actord serve --slots 2 --http 127.0.0.1:8080          # the daemon (Gemma 3 270M by default)
  actord complete "Ada says:" -n 16 --mind ada          # a completion in mind "ada"
  actord page-out 0 ada && actord spill ada ada.page    # her slot to a RAM page, then to a file

`actord serve --help` lists every setting with its default and unit; `actord VERB --help`
a verb's arguments."""


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The CLI's parser and its `serve` subparser."""
    ap = argparse.ArgumentParser(prog="actord", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=os.environ.get("ACTORD_SOCKET", "./actord.sock"), help="daemon socket (client verbs)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="VERB")
    # No abbreviations: `--slot 4` must not quietly mean `--slots 4`, nor a typo anything.
    serve = sub.add_parser("serve", help="run the daemon", allow_abbrev=False, usage="actord serve [FLAGS]",
                           description="Run the daemon. Each flag sets the Config field of its name "
                           "(also a key of the --config TOML file); a flag not given keeps its default.")
    add_serve_flags(serve)
    config = sub.add_parser("config", help="show: the effective configuration (--config FILE and flags applied)")
    show = config.add_subparsers(dest="config_cmd", required=True, metavar="show").add_parser(
        "show", help="print the configuration `actord serve` would run with these flags", allow_abbrev=False)
    add_config_flags(show)
    add_config_file_flag(show)
    show.add_argument("--format", choices=("toml", "json"), default="toml")
    call = sub.add_parser("call", help="call any JSON-RPC method")
    call.add_argument("method")
    call.add_argument("params", nargs="?", default="{}")
    for method, m in METHODS.items():
        help = m.help.replace("%", "%%")
        sugar = _SUGAR.get(method)
        if sugar is not None:
            aliases = [n for n in (verb_name(method),) if n != sugar.verb]
            v = sub.add_parser(sugar.verb, aliases=aliases, help=help, description=help)
            sugar.add_args(v)
            v.set_defaults(rpc=method)
            continue
        v = sub.add_parser(verb_name(method), aliases=_ALIASES.get(method, []), help=help,
                           description=f"{help} (JSON-RPC {method})")
        v.set_defaults(rpc=method, param_names=_add_params(v, m.params))
    for name in ("replay", "simulate"):
        sub.add_parser(name, help=f"see `actord {name} --help`", add_help=False)
    sub.add_parser("cluster", help="up|status|down: minds across nodes on Ray (actord[ray]; "
                   "see `actord cluster --help`)", add_help=False)
    return ap, serve


def request_of(ns: argparse.Namespace) -> tuple[str, Any]:
    """A parsed client verb's JSON-RPC method and params (OSError or ValueError: a file or
    JSON argument that cannot be read)."""
    if ns.cmd == "call":
        return ns.method, json.loads(ns.params)
    sugar = _SUGAR.get(ns.rpc)
    return ns.rpc, sugar.params(ns) if sugar is not None else _generated_params(ns)


def _config_of(what: str, ns: argparse.Namespace, rest: list[str], unknown: Any) -> Config | None:
    """The Config `serve` builds from the file and flags, or None with the refusal printed
    (naming the key or flag; the caller exits 2)."""
    if rest:  # parse_known_args (for replay/simulate) lets them through: refuse them here
        print(f"actord {what}: {unknown(rest)}", file=sys.stderr)
        return None
    try:
        return config_from_args(ns)
    except ActordError as e:
        print(f"actord {what}: {e.message}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    ap, serve = build_parser()
    ns, rest = ap.parse_known_args(argv)

    if ns.cmd == "serve":
        config = _config_of("serve", ns, rest, lambda r: unknown_flag_message(serve, r))
        if config is None:
            return 2
        from actord.frontends.daemon import run_daemon

        return run_daemon(config, log_json=ns.log_json, log_level=ns.log_level)
    if ns.cmd == "config":  # `actord config show`: what serve would run with, refused the same way
        from actord.frontends.config_file import render

        config = _config_of("config show", ns, rest, lambda r: f"unrecognized arguments: {' '.join(r)}")
        if config is None:
            return 2
        print(render(config, ns.format))
        return 0
    if ns.cmd in ("replay", "simulate"):
        from actord.replay import cli as replay_cli

        return replay_cli.main(ns.cmd, rest)
    if ns.cmd == "cluster":
        try:
            from actord.cluster import cli as cluster_cli
        except ImportError as e:
            print(f"actord cluster: {e} (pip install 'actord[ray]')", file=sys.stderr)
            return 2
        return cluster_cli.main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")

    from actord.frontends.client import Client

    try:
        method, params = request_of(ns)
    except (OSError, ValueError) as e:
        print(f"actord {ns.cmd}: {e}", file=sys.stderr)
        return 2
    on_chunk = None
    if ns.cmd != "call" and METHODS[method].streams and params.get("stream"):
        on_chunk = lambda ch: (sys.stdout.write(ch["content"]), sys.stdout.flush())  # noqa: E731
    try:
        with Client(ns.socket) as c:
            out = c.call(method, params, on_chunk=on_chunk)
    except ActordError as e:
        print(json.dumps({"error": e.to_dict()}), file=sys.stderr)
        return 1
    except (FileNotFoundError, ConnectionRefusedError) as e:
        print(f"cannot reach the daemon at {ns.socket}: {e}", file=sys.stderr)
        return 2
    if on_chunk is not None:
        print()  # the text streamed, then the answer
        sugar = _SUGAR.get(method)
        out = sugar.streamed(out) if sugar is not None else out
    if method == "metrics":
        print(out["text"])
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
