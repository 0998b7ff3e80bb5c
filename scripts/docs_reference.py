"""Writes the docs' generated reference pages: the configuration (from `Config`), the
JSON-RPC methods (from the method table, actord/frontends/rpc/methods.py) and the HTTP
routes (from the front's route table).

Why generated: a setting or a method is defined once, in code, with its help; a page
written by hand would fall behind the first time one is added. `make docs` runs this before
`mkdocs build --strict`, and tests/test_docs_reference.py fails when a field or a method has
no entry (the generator is tested, not a built site, so the suite needs no mkdocs).

The configuration's "why" is the comment the field carries in actord/vocabulary/config.py:
its trailing comment, else the comment block above it (a block above several fields, as
the accelerator's, explains each of them), read with `tokenize` so the code stays the one
place it is written.

    .venv/bin/python scripts/docs_reference.py [OUT_DIR]   (default docs/reference)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from actord.frontends.config_flags import LLAMA_SERVER_ALIASES  # noqa: E402
from actord.frontends.config_help import field_comments, show_default, unit  # noqa: E402
from actord.frontends.rpc.methods import METHODS  # noqa: E402
from actord.vocabulary import config as config_module  # noqa: E402
from actord.vocabulary.config import Config  # noqa: E402

def flags(name: str) -> list[str]:
    return ["--" + name.replace("_", "-"), *LLAMA_SERVER_ALIASES.get(name, [])]


def type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def config_reference() -> str:
    why, section = field_comments()
    out = ["# Configuration reference", "",
           "Generated from `Config` (actord/vocabulary/config.py) by `scripts/docs_reference.py`: every field, "
           "its `actord serve` flag, default, unit and why. The same names are the keys of the `--config` "
           "TOML file ([Operations](../operations.md#a-configuration-file)); a flag given overrides the file.",
           "Sizes are bytes, counts are tokens, times are seconds unless the name says `_ms`.", ""]
    current = None
    shared: tuple[str, str] = ("", "")  # (why, the first field it was written out for)
    for f in msgspec.structs.fields(Config):
        text = why.get(f.name, "")
        if text and text == shared[0]:
            text = f"see `{shared[1]}` above (one comment explains them together)"
        else:
            shared = (text, f.name)
        s = section.get(f.name) or "General"
        if s != current:
            out += ["", f"## {s}", "", "| field | flag | default | unit | why |", "|---|---|---|---|---|"]
            current = s
        default = "required" if f.required else show_default(f.name, f.default if f.default is not msgspec.NODEFAULT
                                                             else f.default_factory())
        out.append(f"| `{f.name}` | {' '.join(f'`{x}`' for x in flags(f.name))} | {_cell(default)} | "
                   f"{unit(f.name, f.type)} | {_cell(text) or '(undocumented)'} |")
    return "\n".join(out) + "\n"


def _params(typ: type) -> list[tuple[str, str, str]]:
    out = []
    for f in msgspec.structs.fields(typ):
        if f.required:
            d = "required"
        else:
            v = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            d = "none" if v is None else repr(v)
        out.append((f.encode_name, type_name(f.type), d))
    return out


def rpc_reference() -> str:
    from actord.cli import verbs

    by_method: dict[str, list[str]] = {}
    for verb, method in verbs().items():
        by_method.setdefault(method, []).append(verb)
    out = ["# JSON-RPC reference", "",
           "Generated from the method table (actord/frontends/rpc/methods.py) by `scripts/docs_reference.py`. "
           "The daemon serves JSON-RPC 2.0 on its Unix socket, one request per line; every method is also a "
           "CLI verb (`actord --socket S VERB ...`) and `actord call METHOD '{json}'` calls any of them.", "",
           "*Streams*: with `\"stream\": true` the method sends `completion.chunk` notifications before its "
           "answer. *Control*: the call waits its turn under `max_control_in_flight` / `max_control_total`.", "",
           "| method | CLI verb | what it does | streams | control |", "|---|---|---|---|---|"]
    for name, m in METHODS.items():
        verbs_ = ", ".join(f"`{v}`" for v in sorted(by_method.get(name, [])))
        out.append(f"| [`{name}`](#{_anchor(name)}) | {verbs_} | {_cell(m.help)} | "
                   f"{'yes' if m.streams else ''} | {'yes' if m.control else ''} |")
    for name, m in METHODS.items():
        out += ["", f"## {name}", "", m.help + ".", ""]
        ps = _params(m.params)
        if not ps:
            out.append("No parameters (`{}`).")
        elif len(ps) > 12:
            out.append(f"Parameters: the `{m.params.__name__}` object ({len(ps)} fields; see the "
                       "[HTTP reference](../http.md) for their meaning):")
            out += ["", ", ".join(f"`{n}`" for n, _, _ in ps) + "."]
        else:
            out += ["| parameter | type | default |", "|---|---|---|"]
            out += [f"| `{n}` | `{_cell(t)}` | {_cell(d)} |" for n, t, d in ps]
    return "\n".join(out) + "\n"


def _anchor(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def http_routes() -> str:
    from actord.frontends.http.anthropic.routes import AnthropicRoutes
    from actord.frontends.http.app import HttpFront
    from actord.frontends.http.dashboard import Dashboard
    from actord.frontends.http.native.routes import Native
    from actord.frontends.http.openai.embeddings import Embeddings
    from actord.frontends.http.openai.responses_api import Responses
    from actord.frontends.http.openai.routes import OpenAIRoutes

    front = HttpFront(None, Config(model="model.gguf"))
    groups = [("OpenAI", OpenAIRoutes), ("OpenAI Responses", Responses), ("OpenAI embeddings", Embeddings),
              ("Anthropic Messages", AnthropicRoutes),
              ("llama-server native, the seed's verbs", Native), ("dashboard", Dashboard)]
    out = ["# HTTP routes", "",
           "Generated from the HTTP front's route table (actord/frontends/http/) by `scripts/docs_reference.py`: "
           "every route `actord serve --http` answers. What each API does is in the [HTTP reference](../http.md).", "",
           "| path | methods | API |", "|---|---|---|"]
    listed = set()
    for api, cls in groups:
        for r in cls(front).routes():
            path = getattr(r, "path", "")
            methods = ", ".join(sorted(m for m in (getattr(r, "methods", None) or ()) if m != "HEAD"))
            listed.add((path, methods))
            out.append(f"| `{path}` | {methods} | {api} |")
    for r in front.routes():  # a route the groups above do not make is still listed
        path = getattr(r, "path", "")
        methods = ", ".join(sorted(m for m in (getattr(r, "methods", None) or ()) if m != "HEAD"))
        if (path, methods) not in listed:
            out.append(f"| `{path}` | {methods} | other |")
    return "\n".join(out) + "\n"


PAGES = {"configuration.md": config_reference, "rpc.md": rpc_reference, "http-routes.md": http_routes}


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else ROOT / "docs" / "reference"
    out.mkdir(parents=True, exist_ok=True)
    for name, make in PAGES.items():
        (out / name).write_text(make())
    print(f"wrote {', '.join(PAGES)} to {out}")
    return 0


if __name__ == "__main__":
    assert config_module  # the module whose comments are read
    sys.exit(main(sys.argv))
