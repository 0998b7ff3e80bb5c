"""The non-token part of a KV state's key: which genes computed it and whose it is.

Why one key: cells computed under other genes are another state, and cells another tenant
computed are another tenant's secret (reading `n_cached` after a guess would tell whether the
guess was right: the prompt-cache side channel of PromptPeek, NDSS 2025). So every reuse of
cells (a slot's own resume, a share of a peer's cells or checkpoint, a page, a base, a
file) compares the whole key, never the tokens alone. vLLM mixes the LoRA id and a
per-request `cache_salt` into the root of its block-hash chain; TensorRT-LLM seeds its radix
root with (lora_task_id, cache_salt_id). Ours is `Lineage`: the gene set (id, scale) within a
process, where a gene id never names another content, and by content (each gene's file
digest) wherever it leaves the process (page files); and the scope, a digest of the tenant (an API key's
index, a socket peer's uid; set by the front, never by the client) and the client's own
`cache_salt`. The model's weights are one per daemon and checked on every file it reads
(serving/slot_pages.py `check_fingerprint`).

Pure: no I/O. `policy/prefix_index.py` seeds its hash chain with a lineage.
"""

from __future__ import annotations

import hashlib
import re

Genes = tuple[tuple[int, float], ...]
Lineage = tuple[Genes, str]  # (the gene set, the scope): equal lineages + equal tokens = equal state

MAX_SALT = 256
_SALT = re.compile(r"[A-Za-z0-9._:+/=@-]+\Z")
MAX_TENANT = 128


def check_salt(salt: str) -> str | None:
    """Why `salt` is not a cache_salt (vLLM's field: any string there; here at most MAX_SALT
    characters of [A-Za-z0-9._:+/=@-], so a salt never carries control bytes into logs or
    a trace), or None when it is one."""
    if not salt:
        return "cache_salt is empty (leave it out instead)"
    if len(salt) > MAX_SALT:
        return f"cache_salt is over {MAX_SALT} characters"
    if not _SALT.match(salt):
        return "cache_salt may hold only A-Z a-z 0-9 and . _ : + / = @ -"
    return None


def scope_of(tenant: str, salt: str | None) -> str:
    """The scope reuse stays within: "" for the daemon's one default tenant without a salt
    (the key every request had before scopes), else a digest of both, so neither can be
    made to collide with the other's by choosing it."""
    if not tenant and not salt:
        return ""
    h = hashlib.blake2b(digest_size=12, person=b"actord-scope")
    h.update(tenant.encode("utf-8", "surrogatepass"))
    h.update(b"\0")
    h.update((salt or "").encode())
    return h.hexdigest()


# A request's one-off salt (native /completion's `cache_prompt: false`): a scope no other
# request shares, so nothing it leaves is worth keeping (the prompt cache keeps nothing of it).
ONE_OFF_SALT = "nocache."


def one_off(salt: str | None) -> bool:
    return salt is not None and salt.startswith(ONE_OFF_SALT)


SCOPE_MARK = "@@"  # a client's own mind names never hold it (CompletionRequest.check)


def scoped_mind(mind: str, scope: str) -> str:
    """A mind name as the daemon keeps it: a tenant's "ada" is not another tenant's "ada"
    (a name taken by the other would place her state in its slot, and write over it). The
    default scope keeps names as given; no client name holds SCOPE_MARK, so none can take
    a scoped name."""
    return mind if not scope else f"{mind}{SCOPE_MARK}{scope[:16]}"


def client_name(name: str, scope: str) -> str | None:
    """The name a client of `scope` knows the daemon's name `name` by (`scoped_mind`
    undone), or None where `name` belongs to another scope: what a listing shows a tenant."""
    if not scope:
        return None if SCOPE_MARK in name else name
    stem, mark, tag = name.rpartition(SCOPE_MARK)
    return stem if mark and stem and tag == scope[:16] and SCOPE_MARK not in stem else None


_FILE_SUFFIX = ".page"  # storage/paths.py MIND_FILE_SUFFIX: a mind's page file is "<mind>.page"


def scoped_file(file: str, scope: str) -> str:
    """A page file a client of `scope` names, as the daemon keeps it: each folder of its path
    and its last component scoped as a mind's name is (before a ".page" suffix), so a
    tenant's "ada.page" is her mind ada's own file and never another tenant's, and no folder
    she makes ("ada.page/x.page") takes a name another tenant's files go by."""
    if not scope:
        return file
    *folders, last = file.split("/")
    stem, suffix = ((last[: -len(_FILE_SUFFIX)], _FILE_SUFFIX) if last.endswith(_FILE_SUFFIX)
                    and len(last) > len(_FILE_SUFFIX) else (last, ""))
    return "/".join([*(scoped_mind(f, scope) if f else f for f in folders), scoped_mind(stem, scope) + suffix])


def client_file(file: str, scope: str) -> str:
    """`scoped_file` undone, for an answer that names the file (`file` as given otherwise)."""
    if not scope:
        return file
    *folders, last = file.split("/")
    stem, suffix = ((last[: -len(_FILE_SUFFIX)], _FILE_SUFFIX) if last.endswith(_FILE_SUFFIX)
                    and len(last) > len(_FILE_SUFFIX) else (last, ""))
    names = [client_name(f, scope) if f else f for f in folders] + [client_name(stem, scope)]
    if any(n is None for n in names):
        return file
    return "/".join([*names[:-1], f"{names[-1]}{suffix}"])  # type: ignore[list-item]
