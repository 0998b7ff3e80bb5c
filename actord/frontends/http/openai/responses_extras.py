"""What the Responses API's agent clients send beyond function tools and messages: tool
namespaces, hosted tools, `include`, reasoning items, and the opaque reasoning item we answer.

Why a module of its own: Codex CLI (0.171, recorded in tests/frontends/recorded/) sends a
`namespace` of function tools, a hosted `web_search` tool, `include:
["reasoning.encrypted_content"]` and, from its second turn on, the `reasoning` items it got
back; each was a 400. The route (responses_api.py) reads them through these functions, which
note every lesser answer in the request's `Degraded` (actord/frontends/http/degraded.py).

- `flat_tools`: a namespace's function tools join the list under their own names (a name
  that is already taken is dropped); hosted tools (`web_search`, `file_search`,
  `code_interpreter`, `image_generation`, `computer_use_preview`, `local_shell`, `mcp`, ...)
  are dropped: a local server runs none of them; so are `custom` (freeform) tools, whose
  input is not JSON arguments.
- `include`: `reasoning.encrypted_content` is honoured (the reasoning comes back as an
  opaque item, `reasoning_item`); other values are dropped and noted.
- The opaque reasoning is the thought's own text, base64-encoded behind a version prefix:
  it is not secret (the model is the client's own), and it only has to come back unchanged.
  A reasoning item returned with our `encrypted_content` gives its thought back to the
  assistant turn it preceded (templates that keep past thoughts render it); one we did not
  write (OpenAI's, encrypted with its key) is dropped and noted.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from actord.frontends.http.degraded import unrunnable
from actord.vocabulary.errors import InvalidParams

PREFIX = "actord-r1:"
ENCRYPTED = "reasoning.encrypted_content"


def flat_tools(v: Any, degraded: Any) -> Any:
    """`tools` with namespaces flattened and hosted tools dropped (noted); anything that is
    not a list is returned as it is, for the tool reader to refuse."""
    if not isinstance(v, list):
        return v
    out: list[Any] = []
    names: set[str] = set()

    def keep(t: Any, where: str) -> None:
        name = t.get("name") if isinstance(t, dict) else None
        if isinstance(name, str) and name in names:
            degraded.add(f"{where}: function {name[:64]!r} dropped: the name is already taken")
            return
        if isinstance(name, str):
            names.add(name)
        out.append(t)

    for i, t in enumerate(v):
        kind = t.get("type", "function") if isinstance(t, dict) else None
        if kind == "namespace" and isinstance(t.get("tools"), list):
            inner = t["tools"]
            degraded.add(f"tools[{i}]: namespace {str(t.get('name'))[:40]!r} flattened into its {len(inner)} tools")
            for j, u in enumerate(inner):
                if isinstance(u, dict) and u.get("type", "function") == "function":
                    keep(u, f"tools[{i}].tools[{j}]")
                else:
                    k = u.get("type") if isinstance(u, dict) else type(u).__name__
                    degraded.add(f"tools[{i}].tools[{j}]: {str(k)[:40]!r} tool dropped: only functions run here")
        elif not unrunnable(t, f"tools[{i}]", degraded):  # hosted and custom tools: dropped, noted
            keep(t, f"tools[{i}]")
    return out


def wants_reasoning(include: Any, degraded: Any) -> bool:
    """Whether `include` asks for the opaque reasoning item; other values dropped (noted)."""
    if include in (None, []):
        return False
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise InvalidParams("include is a list of strings", param="include")
    for x in include:
        if x != ENCRYPTED:
            degraded.add(f"include: {x[:60]!r} dropped: this server produces no such output data")
    return ENCRYPTED in include


def seal(thought: str) -> str:
    """A thought as the opaque `encrypted_content` (see the module docstring)."""
    return PREFIX + base64.b64encode(thought.encode("utf-8", "surrogatepass")).decode("ascii")


def unseal(token: Any) -> str | None:
    """The thought an `encrypted_content` of ours holds; None for anyone else's."""
    if not isinstance(token, str) or not token.startswith(PREFIX):
        return None
    try:
        return base64.b64decode(token[len(PREFIX):], validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


def reasoning_item(item_id: str, thought: str, sealed: bool) -> dict[str, Any]:
    """The output item of a turn's thought: opaque (`encrypted_content`) when asked for."""
    item: dict[str, Any] = {"type": "reasoning", "id": item_id, "summary": []}
    if sealed:
        item["encrypted_content"] = seal(thought)
    return item


def input_reasoning(it: dict[str, Any], p: str, degraded: Any) -> str | None:
    """An input `reasoning` item's thought (ours), or None (dropped and noted)."""
    thought = unseal(it.get("encrypted_content"))
    if thought is None:
        degraded.add(f"{p}: reasoning item dropped: its encrypted_content is not this server's")
    return thought
