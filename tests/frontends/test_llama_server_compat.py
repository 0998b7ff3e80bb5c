"""llama-server's behaviours a drop-in needs (issue 28), on the tiny model over HTTP: a
built-in chat template by name for a model that ships none."""

from __future__ import annotations

import httpx
import pytest

from tests.frontends.test_openai_http import KEY, _start, _stop

H = {"authorization": f"Bearer {KEY}"}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """The tiny model without a chat template, served with --chat-template chatml."""
    from actord.testing.models import write_tiny_llama

    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-bare.gguf", seed=1))
    proc, _, url = _start(model, tmp_path_factory.mktemp("d"), "--api-key", KEY, "--chat-template", "chatml")
    try:
        yield url
    finally:
        _stop(proc)


def test_a_named_template_serves_a_model_that_ships_none(bare):
    prompt = httpx.post(bare + "/apply-template", json={"messages": MSGS}, headers=H, timeout=60).json()["prompt"]
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    r = httpx.post(bare + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3}, headers=H, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    props = httpx.get(bare + "/props", headers=H, timeout=60).json()
    assert props["chat_template"].startswith("{%- set OPEN = '<|im_start|>'")
