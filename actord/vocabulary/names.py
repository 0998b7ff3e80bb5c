"""What a name may be: a page-file name's component, a mind's name.

Why in the vocabulary: a request's mind is checked where the request is (types.py), before
any file is named after it; the page folder (storage/paths.py) confines whole names with
the same rule for each component.
"""

from __future__ import annotations

import re

MAX_PART = 128
_PART = re.compile(r"[A-Za-z0-9_@+][A-Za-z0-9_@+.\-]*")
CHARSET = "ASCII letters, digits and _ @ + . - (not first: . or -)"


def check_part(part: str) -> str | None:
    """Why `part` is not one name component, or None when it is."""
    if not isinstance(part, str) or not part:
        return "empty name"
    if len(part) > MAX_PART:
        return f"a component is over {MAX_PART} characters"
    if not _PART.fullmatch(part):
        return f"characters outside the set: {CHARSET}"
    return None


# A mind's state spills to the page file `<mind>.page` (serving/placer.py): so a mind name
# is what a page file's last component may be, less that suffix, refused up front rather
# than once its first spill fails.
MIND_FILE_SUFFIX = ".page"
# A page file is a generation of files: the name itself and sidecars `name + ".ckpt"` etc.
# (pagefile.SUFFIXES); each must be a valid component, so a file name leaves room for them.
LONGEST_SIDECAR = len(".ckpt")
MAX_FILE_PART = MAX_PART - LONGEST_SIDECAR
MAX_MIND = MAX_FILE_PART - len(MIND_FILE_SUFFIX)


def check_mind(name: str) -> str | None:
    """Why `name` is not a mind name, or None when it is."""
    why = check_part(name)
    if why is None and len(name) > MAX_MIND:
        why = (f"a mind name is at most {MAX_MIND} characters (its page file adds {MIND_FILE_SUFFIX!r} "
               "and its sidecars up to {LONGEST_SIDECAR} more)")
    return why


# The minds the daemon makes for requests that name none (its prompt cache,
# policy/prompt_cache.py) begin so: no client's name holds "@@" (kv_identity.py
# SCOPE_MARK), so no client can take one, and no client's listing shows one.
CACHE_MIND = "@@cache."


def is_cache_mind(name: str) -> bool:
    """A name (of a mind, a page or a mind's page file) of the prompt cache's."""
    return name.startswith(CACHE_MIND)


# The minds the Responses front names for conversations that name none ("r-" and the hex of
# a 16-byte digest of how the conversation starts: frontends/http/openai/responses_api.py
# `conversation_mind`), kept under a tenant's scope with its mark and tag after it.
RESPONSES_MIND = "r-"
_RESPONSES_MIND = re.compile(r"r-[0-9a-f]{32}(@@[0-9a-f]{16})?")


def is_responses_mind(name: str) -> bool:
    """A name (of a mind, or a mind's page file) of an anonymous Responses conversation's."""
    stem = name[: -len(MIND_FILE_SUFFIX)] if name.endswith(MIND_FILE_SUFFIX) else name
    return _RESPONSES_MIND.fullmatch(stem) is not None
