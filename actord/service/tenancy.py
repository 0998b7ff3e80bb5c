"""Who a request is for: the tenant the front that received it vouches for.

Why a context variable: a tenant is a fact of the connection (the socket's peer uid, the
HTTP API key), not of the request body, and a client must never choose it. The front sets it
once for the task that serves the request (the socket: per connection; HTTP: per request,
after the key is checked); the façade stamps it onto every completion and chat it receives
(`stamp`), overwriting whatever the body said, before the request is recorded. Requests
from an embedded host, where no front set one, keep the tenant the host named (default:
the one default tenant). Reuse of cells never crosses tenants (vocabulary/kv_identity.py).
"""

from __future__ import annotations

import contextlib
import hashlib
from contextvars import ContextVar
from typing import Any, Iterator, TypeVar

import msgspec

from actord.vocabulary.errors import InvalidParams, PageNotFound
from actord.vocabulary.kv_identity import SCOPE_MARK, client_file, client_name, scope_of, scoped_file, scoped_mind

_TENANT: ContextVar[str | None] = ContextVar("actord_tenant", default=None)

R = TypeVar("R", bound=msgspec.Struct)


def enter(tenant: str) -> None:
    """The current task (and the tasks it starts) serves `tenant`. Not reset: the front calls
    it in a task of its own per connection or per request, which ends with it."""
    _TENANT.set(tenant)


def current() -> str | None:
    return _TENANT.get()


def stamp(request: R) -> R:
    """`request` with the tenant the front vouches for (none set: as it came)."""
    tenant = _TENANT.get()
    if tenant is None or getattr(request, "tenant", tenant) == tenant:
        return request
    return msgspec.structs.replace(request, tenant=tenant)


def of_uid(uid: int | None, own_uid: int) -> str:
    """A socket peer's tenant: the daemon's own uid is the default tenant ("")."""
    return "" if uid is None or uid == own_uid else f"uid:{uid}"


def of_key(key: bytes, n_keys: int) -> str:
    """An HTTP API key's tenant: with one key (or none) every client is the default tenant;
    with several, each key is its own, named by a digest (never the key itself, which would
    reach logs and traces)."""
    if n_keys <= 1:
        return ""
    return "key:" + hashlib.blake2b(key, digest_size=8, person=b"actord-tenant").hexdigest()


def scope() -> str | None:
    """The scope (vocabulary/kv_identity.py) of the tenant the front vouches for, without a
    salt: what the page and slot verbs of a socket or HTTP client see and touch. None where
    no front set a tenant (an embedded host, a replay): every page, as kept."""
    tenant = _TENANT.get()
    return None if tenant is None else scope_of(tenant, None)


def own_slot(info: R, scope: str | None) -> R:
    """A slot's report as a client of `scope` sees it: a mind of another scope unnamed."""
    mind = getattr(info, "mind", None)
    if scope is None or mind is None:
        return info
    return msgspec.structs.replace(info, mind=client_name(mind, scope))  # type: ignore[arg-type]


def own_name(name: str, param: str, *, file: bool = False) -> str:
    """A page (or page file, `file`) a front's client names, as the daemon keeps it in her
    scope (vocabulary/kv_identity.py): another tenant's page of that name is not hers to see or
    touch, so it answers as a page that does not exist. A name holding the daemon's scope
    mark is refused (no client names a mind so). As given where no front set a tenant."""
    where = scope()
    if where is None:
        return name
    if isinstance(name, str) and SCOPE_MARK in name:
        raise InvalidParams(f"{param} may not hold {SCOPE_MARK!r} (kept for the daemon's scoped names)", param=param)
    return scoped_file(name, where) if file else scoped_mind(name, where)


def client_answer(out: Any) -> Any:
    """A page verb's answer with the names in it as the front's client knows them."""
    where = scope()
    if where is None:
        return out
    if isinstance(out, dict):
        out = dict(out)
        if isinstance(out.get("page"), str):
            out["page"] = client_name(out["page"], where) or out["page"]
        if isinstance(out.get("file"), str):
            out["file"] = client_file(out["file"], where)
        return out
    page = getattr(out, "page", None)
    if isinstance(page, str):
        return msgspec.structs.replace(out, page=client_name(page, where) or page)
    return out


@contextlib.contextmanager
def as_client(page: str) -> Iterator[None]:
    """A PageNotFound about the scoped name `page` names the client's own name instead."""
    try:
        yield
    except PageNotFound as e:
        if scope() is None:
            raise
        raise PageNotFound(f"no page named {page!r}", page=page) from None
