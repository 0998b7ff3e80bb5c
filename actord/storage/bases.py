"""Page files that share a base (issue 34, part 3): a page standing on a shared prefix in RAM
spills as its own part plus a reference to a content-addressed base file, so minds that open
alike hold their common prefix on disk once.

Key: until the one KV identity of the identity issue lands, a base file is keyed by the
page's existing base identity, hashed: the model fingerprint a page file records (weights
digest, shapes, V layout), the gene list (id and scale, as pages key bases in RAM) and the
base's tokens. Equal keys mean equal state; a base file whose tokens are not the referring
page's first `n_base_file` tokens is refused as corrupt.

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
_FINGERPRINT = ("model", "n_vocab", "n_ctx_train", "n_swa", "weights", "v_trans")
_ENC = msgspec.msgpack.Encoder()


def base_name(key: str) -> str:
    return f"{BASE_DIR}/{key}{BASE_SUFFIX}"


def is_base(name: str) -> bool:
    return name.startswith(BASE_DIR + "/") and name.endswith(BASE_SUFFIX)


def base_key(image: PageImage) -> str:
    """The content address of the base `image` stands on."""
    h = hashlib.sha256()
    h.update(_ENC.encode({k: image.meta.get(k) for k in _FINGERPRINT}))
    h.update(_ENC.encode([[g.id, g.scale] for g in image.genes]))
    h.update(_ENC.encode(list(image.tokens[: image.n_base])))
    return h.hexdigest()[:40]


def split(image: PageImage) -> tuple[str, PageImage, PageImage]:
    """(key, the base's own generation, the page's generation referring to it)."""
    key = base_key(image)
    base = PageImage(tokens=list(image.tokens[: image.n_base]), state=image.base,  # type: ignore[arg-type]
                     meta={k: image.meta[k] for k in _FINGERPRINT if k in image.meta})
    page = msgspec.structs.replace(image, base=None, n_base=0,
                                   meta={**image.meta, FILE_META: key, N_META: image.n_base})
    return key, base, page


def referred(meta: dict[str, Any]) -> str | None:
    key = meta.get(FILE_META)
    return key if isinstance(key, str) and key else None


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
