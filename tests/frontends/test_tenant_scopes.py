"""Reuse of cells never crosses a tenant over HTTP: several API keys, each its own scope,
and vLLM's `cache_salt` narrowing a scope further (vocabulary/kv_identity.py,
service/tenancy.py). The daemon runs as users run it, with `--api-key K1,K2` and an
`--api-key-file`; `n_cached` (usage.prompt_tokens_details.cached_tokens) tells only what a
request's own scope held."""

from __future__ import annotations

import httpx
import pytest

from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama
from tests.frontends.test_openai_http import _start, _stop

KEYS = ("key-one", "key-two", "key-three")
SYSTEM = "You are a careful assistant. " * 12


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE))
    tmp = tmp_path_factory.mktemp("d")
    keyfile = tmp / "keys.txt"
    keyfile.write_text(f"# more keys\n\n{KEYS[2]}\n")
    proc, sock, url = _start(model, tmp, "--api-key", f"{KEYS[0]},{KEYS[1]}", "--api-key-file", str(keyfile),
                             "--slots", "8")  # every request keeps its slot
    try:
        yield url
    finally:
        _stop(proc)


def chat(url: str, key: str, text: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_api_key_is_its_own_scope_and_learns_nothing_of_anothers_prompt(front):
    first = chat(front, KEYS[0], "the secret is 42")
    assert cached(first) == 0
    other = chat(front, KEYS[1], "the secret is 42")
    assert cached(other) == 0  # the same prompt under another key: nothing reused
    assert other.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    again = chat(front, KEYS[0], "the secret is 43")
    assert cached(again) > 20  # its own key shares its system prompt as before
    filed = chat(front, KEYS[2], "the secret is 42")
    assert cached(filed) == 0  # a key from --api-key-file is a scope of its own too


def test_a_cache_salt_narrows_a_keys_scope(front):
    a = chat(front, KEYS[1], "salted words", cache_salt="s-1")
    b = chat(front, KEYS[1], "salted words", cache_salt="s-2")
    c = chat(front, KEYS[1], "salted words!", cache_salt="s-1")
    assert (cached(a), cached(b)) == (0, 0)
    assert cached(c) > 20


@pytest.mark.parametrize("salt", ["", "a b", "x" * 300, 7])
def test_a_bad_cache_salt_is_a_400_naming_it(front, salt):
    r = chat(front, KEYS[0], "hello", cache_salt=salt)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" or "cache_salt" in err["message"]


def test_an_unknown_key_is_refused(front):
    assert chat(front, "key-four", "hello").status_code == 401


def test_the_anthropic_route_takes_a_cache_salt(front):
    def msg(salt: str) -> httpx.Response:
        return httpx.post(front + "/v1/messages", headers={"x-api-key": KEYS[0]}, timeout=60, json={
            "system": SYSTEM, "messages": [{"role": "user", "content": "anthropic words"}], "max_tokens": 4,
            "temperature": 0, "cache_salt": salt})

    a, b = msg("anth-1"), msg("anth-2")
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["usage"]["cache_read_input_tokens"] == b.json()["usage"]["cache_read_input_tokens"] == 0
    assert msg("a b").status_code == 400


def test_a_socket_client_cannot_name_its_own_tenant(tmp_path):
    """The socket stamps the peer's tenant (its uid: here the daemon's own, the default) over
    whatever the body says, so a forged `tenant` neither escapes nor enters another scope."""
    from actord.testing.models import write_tiny_llama as tiny
    from tests.frontends.daemons import Daemon

    d = Daemon(str(tiny(tmp_path / "tiny.gguf", seed=1)), tmp_path)
    try:
        prompt = [1] + [3 + (i * 37) % 500 for i in range(120)]
        d.call("completion", {"prompt": prompt, "n_predict": 2, "ignore_eos": True, "slot": 0})
        forged = d.call("completion", {"prompt": prompt + [9, 9], "n_predict": 2, "ignore_eos": True, "slot": 0,
                                       "tenant": "uid:4242"})
        assert forged["n_cached"] == len(prompt)  # its own (default) scope's cells, as if it sent none
        salted = d.call("completion", {"prompt": prompt + [9, 9, 9], "n_predict": 2, "ignore_eos": True, "slot": 0,
                                       "cache_salt": "mine"})
        assert salted["n_cached"] == 0
    finally:
        d.proc.kill()
        d.proc.wait(10)


def test_tenants_come_from_the_peer_and_the_key_never_the_body():
    from actord.service import tenancy

    assert tenancy.of_uid(1000, 1000) == "" and tenancy.of_uid(1001, 1000) == "uid:1001"
    assert tenancy.of_key(b"k", 1) == "" and tenancy.of_key(b"k", 2) != tenancy.of_key(b"j", 2)
    key = b"secret-key-123"
    tenant = tenancy.of_key(key, 2)
    assert tenant.startswith("key:") and key.decode() not in tenant  # a digest, never the key itself
    assert all(c in "0123456789abcdef" for c in tenant[4:])
