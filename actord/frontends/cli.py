"""`actord`: the daemon (`serve`) and a client for every verb (`call`, `complete`, ...).

`serve`'s flags are generated from `Config`'s fields (config_flags.py), so configuration
has one typed home and a new setting is a flag the moment it exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from actord.frontends.config_flags import add_serve_flags, config_from_args, unknown_flag_message

_VERBS = {
    # verb: (method, positional param names)
    "slots": ("slot.list", []),
    "erase": ("slot.erase", ["slot"]),
    "props": ("props", []),
    "health": ("health", []),
    "page-out": ("page.out", ["slot", "page"]),
    "page-in": ("page.in", ["slot", "page"]),
    "page-drop": ("page.drop", ["page"]),
    "pages": ("page.list", []),
    "spill": ("page.spill", ["page", "file"]),
    "save": ("slot.save", ["slot", "file"]),
    "restore": ("slot.restore", ["slot", "file"]),
    "gene-load": ("gene.load", ["path"]),
    "gene-unload": ("gene.unload", ["id"]),
    "gene-page-out": ("gene.page_out", ["id"]),
    "gene-page-in": ("gene.page_in", ["id"]),
    "genes": ("gene.list", []),
}


def _genes(specs: list[str]) -> list[dict[str, Any]]:
    return [{"id": int(g.split(":")[0]), "scale": float(g.split(":")[1]) if ":" in g else 1.0} for g in specs]


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


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The CLI's parser and its `serve` subparser."""
    ap = argparse.ArgumentParser(prog="actord", description=__doc__)
    ap.add_argument("--socket", default=os.environ.get("ACTORD_SOCKET", "./actord.sock"), help="daemon socket (client verbs)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    # No abbreviations: `--slot 4` must not quietly mean `--slots 4`, nor a typo anything.
    serve = sub.add_parser("serve", help="run the daemon", allow_abbrev=False)
    add_serve_flags(serve)
    call = sub.add_parser("call", help="call any JSON-RPC method")
    call.add_argument("method")
    call.add_argument("params", nargs="?", default="{}")
    comp = sub.add_parser("complete", help="run a completion")
    comp.add_argument("prompt")
    comp.add_argument("-n", "--n-predict", type=int, default=32)
    comp.add_argument("--slot", type=int)
    comp.add_argument("--mind", help="a named session (the daemon, or a cluster's router, places it)")
    comp.add_argument("--temperature", type=float, default=0.0)
    comp.add_argument("--seed", type=int)
    comp.add_argument("--stream", action="store_true")
    comp.add_argument("--gene", action="append", default=[], help="ID[:SCALE]")
    chat = sub.add_parser("chat", help="one chat turn: messages rendered with the model's chat template")
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
    for verb, (method, names) in _VERBS.items():
        v = sub.add_parser(verb, help=f"call {method}")
        for n in names:
            v.add_argument(n, type=int if n in ("slot", "id") else str)
        if verb == "spill":
            v.add_argument("--drop", action="store_true")
    for name in ("replay", "simulate"):
        sub.add_parser(name, help=f"see `actord {name} --help`", add_help=False)
    sub.add_parser("cluster", help="up|status|down: minds across nodes on Ray (actord[ray]; "
                   "see `actord cluster --help`)", add_help=False)
    return ap, serve


def main(argv: list[str] | None = None) -> int:
    ap, serve = build_parser()
    ns, rest = ap.parse_known_args(argv)

    if ns.cmd == "serve":
        if rest:  # parse_known_args (for replay/simulate) lets them through: refuse them here
            print(f"actord serve: {unknown_flag_message(serve, rest)}", file=sys.stderr)
            return 2
        from actord.frontends.daemon import run_daemon

        from actord.service.errors import ActordError

        try:
            config = config_from_args(ns)
        except ActordError as e:
            print(f"actord serve: {e.message}", file=sys.stderr)
            return 2
        return run_daemon(config, log_json=ns.log_json, log_level=ns.log_level)
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
    from actord.service.errors import ActordError

    try:
        chat_params = _chat_params(ns) if ns.cmd == "chat" else None
    except (OSError, ValueError) as e:
        print(f"actord chat: {e}", file=sys.stderr)
        return 2
    try:
        with Client(ns.socket) as c:
            if ns.cmd == "call":
                out = c.call(ns.method, json.loads(ns.params))
            elif ns.cmd == "complete":
                params: dict[str, Any] = {"prompt": ns.prompt, "n_predict": ns.n_predict,
                                          "temperature": ns.temperature, "stream": ns.stream}
                if ns.slot is not None:
                    params["slot"] = ns.slot
                if ns.mind is not None:
                    params["mind"] = ns.mind
                if ns.seed is not None:
                    params["seed"] = ns.seed
                if ns.gene:
                    params["genes"] = _genes(ns.gene)
                on_chunk = (lambda ch: (sys.stdout.write(ch["content"]), sys.stdout.flush())) if ns.stream else None
                out = c.call("completion", params, on_chunk=on_chunk)
                if ns.stream:
                    print()
            elif ns.cmd == "chat":
                on_chunk = (lambda ch: (sys.stdout.write(ch["content"]), sys.stdout.flush())) if ns.stream else None
                out = c.call("chat", chat_params, on_chunk=on_chunk)
                if ns.stream:
                    print()
                    out = {"message": out["message"], "usage": {
                        k: out["completion"][k] for k in ("n_prompt_tokens", "n_cached", "n_prompt_processed")}}
            else:
                method, names = _VERBS[ns.cmd]
                params = {n: getattr(ns, n) for n in names}
                if ns.cmd == "spill":
                    params["drop"] = ns.drop
                out = c.call(method, params)
    except ActordError as e:
        print(json.dumps({"error": e.to_dict()}), file=sys.stderr)
        return 1
    except (FileNotFoundError, ConnectionRefusedError) as e:
        print(f"cannot reach the daemon at {ns.socket}: {e}", file=sys.stderr)
        return 2
    if ns.cmd == "call" and ns.method == "metrics":
        print(out["text"])
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
