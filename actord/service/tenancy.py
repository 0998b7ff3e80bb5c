"""Who a request is for: the tenant the front that received it vouches for.

Why a context variable: a tenant is a fact of the connection (the socket's peer uid, the
HTTP API key), not of the request body, and a client must never choose it. The front sets it
once for the task that serves the request (the socket: per connection; HTTP: per request,
after the key is checked); the façade stamps it onto every completion and chat it receives
(`stamp`), overwriting whatever the body said, before the request is recorded. Requests
from an embedded host, where no front set one, keep the tenant the host named (default:
the one default tenant). Reuse of cells never crosses tenants (policy/kv_identity.py).
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from typing import TypeVar

import msgspec

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
