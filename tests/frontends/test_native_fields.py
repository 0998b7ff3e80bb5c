"""llama-server's per-request fields on actord's completion routes, in the shape of
llama-server's own tests (tools/server/tests/unit: test_chat_completion's
test_return_progress, test_metrics' test_metrics_timings_on_prompt_progress, ...):
`return_progress` (a chunk per decoded piece of the prompt), `timings_per_token` (timings
on every chunk), on /completion and on the chat routes.

One daemon on the tiny generated llama, one slot, a batch of 8 tokens so that a prompt is
decoded in several pieces. No network, no GPU.
"""

from __future__ import annotations

import json

import httpx
import pytest

from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama
from tests.frontends.daemons import serving_http

PROMPT = "the model and the cache and the slots and the pages " * 3


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    d = tmp_path_factory.mktemp("fields")
    model = write_tiny_llama(d / "tiny-chat.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE)
    with serving_http(model, d, slots=1, ctx=1024, batch=8, timeout=10) as (address, _):
        yield address


def stream(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.Client(timeout=60) as c, c.stream("POST", url + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def progress_of(events: list[dict]) -> list[dict]:
    return [e["prompt_progress"] for e in events if "prompt_progress" in e]


def test_return_progress_reports_the_prompt_piece_by_piece_before_the_first_token(url):
    httpx.post(url + "/slots/0?action=erase")
    events = stream(url, "/completion", {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "return_progress": True})
    prog = progress_of(events)
    total = events[-1]["tokens_evaluated"]
    assert total > 16 and len(prog) == 1 + -(-total // 8)  # the 0% report, then one per piece of 8
    assert prog[0]["cache"] == prog[0]["processed"] == 0 and all(p["total"] == total for p in prog)
    assert [p["processed"] for p in prog[1:]] == [min(8 * i, total) for i in range(1, len(prog))]
    assert all(p["time_ms"] >= 0 for p in prog)
    first_token = next(i for i, e in enumerate(events) if e.get("tokens"))
    assert all("prompt_progress" not in e for e in events[first_token:])  # all of it before the tokens
    assert all(e["content"] == "" and e["tokens"] == [] for e in events if "prompt_progress" in e)
    # The same prompt again: served from the slot's cache but its last token, one piece.
    again = progress_of(stream(url, "/completion", {"prompt": PROMPT, "n_predict": 3, "temperature": 0,
                                                    "return_progress": True}))
    assert [(p["cache"], p["processed"]) for p in again] == [(total - 1, total - 1), (total - 1, total)]


def test_timings_per_token_gives_every_chunk_its_timings_so_far(url):
    httpx.post(url + "/slots/0?action=erase")
    events = stream(url, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0,
                                         "timings_per_token": True, "return_progress": True})
    partial = events[:-1]
    assert all("timings" in e for e in partial)
    first = partial[0]["timings"]  # before any prompt token was decoded
    assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0 and first["predicted_n"] == 0
    prompt_ms = [e["timings"]["prompt_ms"] for e in partial]
    assert prompt_ms == sorted(prompt_ms) and prompt_ms[-1] > 0
    assert all(v >= 0 for e in partial for v in e["timings"].values())
    assert [e["timings"]["predicted_n"] for e in partial if e["tokens"]] == [1, 2, 3, 4][:len(
        [e for e in partial if e["tokens"]])]
    assert partial[-1]["timings"]["prompt_n"] == events[-1]["timings"]["prompt_n"]


def test_without_the_fields_chunks_carry_neither(url):
    events = stream(url, "/completion", {"prompt": PROMPT, "n_predict": 3, "temperature": 0})
    assert not any("prompt_progress" in e or "timings" in e for e in events[:-1])


def test_chat_streams_progress_as_role_deltas_and_timings_per_chunk(url):
    httpx.post(url + "/slots/0?action=erase")
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0,
            "return_progress": True, "timings_per_token": True}
    for path in ("/v1/chat/completions", "/chat/completions"):
        events = stream(url, path, body)
        prog = [e for e in events if "prompt_progress" in e]
        assert len(prog) >= 2 and prog[-1]["prompt_progress"]["processed"] == prog[-1]["prompt_progress"]["total"]
        assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": None} for e in prog)
        assert all("timings" in e for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))


def test_post_sampling_probs_are_the_chains_candidates_and_change_no_token(url):
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 1.0, "top_k": 3, "seed": 7, "n_probs": 5}
    raw = httpx.post(url + "/completion", json=body, timeout=60).json()
    post = httpx.post(url + "/completion", json={**body, "post_sampling_probs": True}, timeout=60).json()
    assert post["content"] == raw["content"]  # read after the chain, sampled the same way
    assert post["generation_settings"]["post_sampling_probs"] is True
    assert all("top_logprobs" in t and "prob" not in t for t in raw["completion_probabilities"])
    assert len(post["completion_probabilities"]) == 6
    for tok in post["completion_probabilities"]:
        top = tok["top_probs"]
        assert "logprob" not in tok and 0 < tok["prob"] <= 1 and 1 <= len(top) <= 3  # top_k left 3
        assert [p["prob"] for p in top] == sorted((p["prob"] for p in top), reverse=True)
        assert sum(p["prob"] for p in top) == pytest.approx(1.0, abs=1e-4)  # every candidate left
        assert all(p["prob"] > 0 and set(p) == {"id", "token", "bytes", "prob"} for p in top)
        assert any(p["id"] == tok["id"] and p["prob"] == pytest.approx(tok["prob"]) for p in top)
    greedy = httpx.post(url + "/completion", json={**body, "temperature": 0, "post_sampling_probs": True},
                        timeout=60).json()
    assert all(t["prob"] == 1.0 and len(t["top_probs"]) == 1 for t in greedy["completion_probabilities"])
    events = stream(url, "/completion", {**body, "post_sampling_probs": True})
    streamed = [p for e in events[:-1] for p in e.get("completion_probabilities", [])]
    assert [p["id"] for p in streamed] == [p["id"] for p in post["completion_probabilities"]]
    assert all("top_probs" in p for p in streamed)


def test_input_tokens_counts_what_the_chat_would_decode(url):
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60).json()
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        r = httpx.post(url + path, json={"messages": messages}, timeout=60)
        assert r.status_code == 200 and r.json() == {"input_tokens": chat["usage"]["prompt_tokens"],
                                                     "object": "response.input_tokens"}
    bad = httpx.post(url + "/v1/chat/completions/input_tokens", json={"messages": []}, timeout=60)
    assert bad.status_code == 400
