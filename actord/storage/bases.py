"""Page files that share a base (issue 34, part 3): a page standing on a shared prefix in RAM
spills as its own part plus a reference to a content-addressed base file, so minds that open
alike hold their common prefix on disk once.

Key: the one identity of a KV state (vocabulary/kv_identity.py), hashed: the model fingerprint
a page file records (weights digest, shapes) and the state's layout (V transposition, cache
types), the gene set by content (each gene's file digest and scale, sorted; never a
load-order id), the scope, and the base's tokens. Equal keys mean equal state. A page whose
genes cannot all be named by content is written self-contained. The base file's meta holds
the identity's non-token part too, so a new mind of that identity may start from it
(`BaseIndex`: the base files by their tokens, kept in RAM, read from their headers after
start), and a base file whose tokens are not the referring page's first `n_base_file`
tokens is refused as corrupt.

Where: `bases/<key>.base` in the page folder, each a generation of the usual format
(tokens + state), published and removed crash-safely like every page file (storage/publish.py).

References are never stored apart (a count on disk could disagree with the files after a
crash): a page file's main meta names its base (`base_file`), and the table of who uses which
base is built from the files themselves, by a sweep of their headers after start (in the
background: a restart does not wait for it), then kept by this process's publications and
removals. Order makes it crash-safe: a base is durable before any page file that names it
is published, and removed only after its last referrer's removal or replacement is durable,
and only once the sweep has run; a crash in between leaves at worst an orphan base, which the
next start's sweep removes (a removal cut short is rolled forward by the publication
protocol's own record, like any other).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from actord.storage.pagefile import PageImage

BASE_DIR = "bases"
BASE_SUFFIX = ".base"
FILE_META, N_META = "base_file", "n_base_file"
# The model and the state's layout (serving/slot_pages.py model_fingerprint, state_layout).
_FINGERPRINT = ("model", "n_vocab", "n_ctx_train", "n_swa", "weights", "v_trans", "cache_type_k", "cache_type_v")
GENES, SCOPE = "genes", "scope"  # a base file's meta: [[digest, scale], ...] sorted, and its scope
_ENC = msgspec.msgpack.Encoder()


def base_name(key: str) -> str:
    return f"{BASE_DIR}/{key}{BASE_SUFFIX}"


def is_base(name: str) -> bool:
    return name.startswith(BASE_DIR + "/") and name.endswith(BASE_SUFFIX)


def key_of(name: str) -> str:
    return name[len(BASE_DIR) + 1: -len(BASE_SUFFIX)]


def fingerprint(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta.get(k) for k in _FINGERPRINT}


def genes_by_content(image: PageImage) -> list[list[Any]] | None:
    """The page's genes as [digest, scale], sorted; None when one has no digest (a gene the
    saving daemon could not name by content: no base file may stand for it)."""
    if any(not g.digest for g in image.genes):
        return None
    return sorted([g.digest, float(g.scale)] for g in image.genes)


def identity_key(fp: dict[str, Any], genes: list[list[Any]], scope: str, tokens: Any) -> str:
    """The content address of a base: the one identity's every part, and its tokens."""
    h = hashlib.sha256()
    h.update(_ENC.encode(fp))
    h.update(_ENC.encode(genes))
    h.update(_ENC.encode(scope))
    h.update(_ENC.encode(list(tokens)))
    return h.hexdigest()[:40]


def base_key(image: PageImage) -> str | None:
    """The content address of the base `image` stands on (None: it cannot have a base file)."""
    genes = genes_by_content(image)
    if genes is None:
        return None
    return identity_key(fingerprint(image.meta), genes, str(image.meta.get(SCOPE, "") or ""),
                        image.tokens[: image.n_base])


def split(image: PageImage) -> tuple[str, PageImage, PageImage] | None:
    """(key, the base's own generation, the page's generation referring to it); None when
    the page's genes cannot all be named by content (it is written whole)."""
    key = base_key(image)
    if key is None:
        return None
    meta = {**{k: image.meta[k] for k in _FINGERPRINT if k in image.meta},
            GENES: genes_by_content(image), SCOPE: str(image.meta.get(SCOPE, "") or "")}
    base = PageImage(tokens=list(image.tokens[: image.n_base]), state=image.base,  # type: ignore[arg-type]
                     meta=meta)
    page = msgspec.structs.replace(image, base=None, n_base=0,
                                   meta={**image.meta, FILE_META: key, N_META: image.n_base})
    return key, base, page


def referred(meta: dict[str, Any]) -> str | None:
    key = meta.get(FILE_META)
    return key if isinstance(key, str) and key else None


class BaseEntry(msgspec.Struct, frozen=True):
    """What a base file is, from its meta and tokens: enough to say whose start it may be."""

    tokens: list[int]
    fingerprint: dict[str, Any]
    genes: list[list[Any]]
    scope: str


def entry_of(meta: dict[str, Any], tokens: Any) -> BaseEntry | None:
    """A base file's entry (None: a base written before its meta held its identity)."""
    genes, scope = meta.get(GENES), meta.get(SCOPE)
    if not isinstance(genes, list) or not isinstance(scope, str):
        return None
    return BaseEntry(tokens=list(tokens), fingerprint=fingerprint(meta), genes=genes, scope=scope)


class BaseIndex:
    """The base files by what they hold, for a new mind's start: which base file's tokens
    begin a prompt, under the whole identity. In RAM: a few entries (one per prefix that
    minds of one identity share), each checked against its key when it is added."""

    def __init__(self) -> None:
        self.entries: dict[str, BaseEntry] = {}

    def add(self, key: str, entry: BaseEntry) -> bool:
        """Known from now on, if the entry is what its key says (False: it is not)."""
        if identity_key(entry.fingerprint, entry.genes, entry.scope, entry.tokens) != key:
            return False
        self.entries[key] = entry
        return True

    def drop(self, key: str) -> None:
        self.entries.pop(key, None)

    def longest(self, tokens: list[int], fp: dict[str, Any] | None, genes: list[list[Any]] | None,
                scope: str) -> tuple[str, int] | None:
        """(key, its tokens) of the longest base of this identity whose tokens `tokens` (all
        but its last token, which a start must decode itself) begins with; genes and fp None:
        any (a hint, where the asker does not know them)."""
        best: tuple[str, int] | None = None
        for key, e in self.entries.items():
            n = len(e.tokens)
            if e.scope != scope or n >= len(tokens) or (best is not None and n <= best[1]):
                continue
            if (genes is not None and e.genes != genes) or (fp is not None and e.fingerprint != fp):
                continue
            if tokens[:n] == e.tokens:
                best = (key, n)
        return best


class BaseRefs:
    """Which page files use which base file."""

    def __init__(self) -> None:
        self.base_of: dict[str, str] = {}  # page file -> its base's key
        self.users: dict[str, set[str]] = {}  # base key -> page files naming it
        self.known = False  # every page file's reference read (the sweep ran)
        self.live: set[str] = set()  # page files this process changed since the sweep began

    def set(self, page: str, key: str | None, *, live: bool = True) -> str | None:
        """`page`'s generation now names base `key` (None: none); the key of a base whose
        last user this was, to remove (only once the table is known)."""
        if live:
            self.live.add(page)
        old = self.base_of.pop(page, None)
        if key is not None:
            self.base_of[page] = key
            self.users.setdefault(key, set()).add(page)
        if old is None or old == key:
            return None
        users = self.users.get(old)
        if users is not None:
            users.discard(page)
            if not users:
                del self.users[old]
                return old if self.known else None
        return None
