"""llama-server's behaviours a drop-in needs (issue 28), on the tiny model over HTTP: a
built-in chat template by name for a model that ships none."""

from __future__ import annotations

import json

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


PREFILL = [{"role": "user", "content": "What is the best book"}, {"role": "assistant", "content": "Whill"}]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=H, timeout=60)


def test_a_trailing_assistant_message_is_continued_not_closed(bare):
    prompt = _post(bare, "/apply-template", {"messages": PREFILL}).json()["prompt"]
    assert prompt.endswith("<|im_start|>user\nWhat is the best book<|im_end|>\n<|im_start|>assistant\nWhill")
    chat = _post(bare, "/v1/chat/completions", {"messages": PREFILL, "max_tokens": 4, "temperature": 0}).json()
    # The reply goes on from the prefill: what a raw completion of that very prompt gives.
    raw = _post(bare, "/completion", {"prompt": prompt, "n_predict": 4, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == raw["content"]
    assert chat["usage"]["prompt_tokens"] == raw["tokens_evaluated"]
    explicit = _post(bare, "/v1/chat/completions", {"messages": PREFILL, "max_tokens": 4, "temperature": 0,
                                                    "continue_final_message": True}).json()
    assert explicit["choices"][0]["message"]["content"] == raw["content"]


@pytest.mark.parametrize("body,param", [
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": "yes"}, "continue_final_message")])
def test_continue_final_message_with_add_generation_prompt_is_refused_typed(bare, body, param):
    r = _post(bare, "/v1/chat/completions", {"messages": PREFILL, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    last_user = _post(bare, "/v1/chat/completions", {"messages": MSGS, "continue_final_message": True})
    assert last_user.status_code == 400 and last_user.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("fmt,content", [
    ({"type": "json_object", "schema": {"const": "42"}}, '"42"'),
    ({"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}, '"foooooo"')])
def test_a_schema_inside_json_object_is_applied(bare, fmt, content):
    r = _post(bare, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 10, "response_format": fmt}).json()
    assert r["choices"][0]["message"]["content"] == content


@pytest.mark.parametrize("fmt", [{"type": "json_object", "schema": 123}, {"type": "json_object", "schema": {"type": 1}},
                                 {"type": "sound"}])
def test_a_bad_response_format_is_a_400_naming_it(bare, fmt):
    r = _post(bare, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_chat_answers_carry_llama_servers_timings(bare):
    r = _post(bare, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3}).json()
    assert r["timings"]["predicted_n"] == 3 and r["timings"]["prompt_n"] >= 1 and "predicted_per_second" in r["timings"]
    with httpx.stream("POST", bare + "/v1/chat/completions", headers=H, timeout=60, json={
            "messages": MSGS, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
            "timings_per_token": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "timings" not in events[0] and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"] == [] and events[-1]["timings"]["predicted_n"] == 3


# -- the native /completion's shapes ---------------------------------------------------------


def test_an_empty_response_fields_means_every_field_and_the_prompt_is_echoed_as_evaluated(bare):
    tokens = _post(bare, "/tokenize", {"content": "I believe", "add_special": True}).json()["tokens"]
    evaluated = _post(bare, "/detokenize", {"tokens": tokens}).json()["content"]
    assert evaluated.startswith("<s>")  # BOS included, as llama-server echoes it
    everything = _post(bare, "/completion", {"prompt": "I believe", "n_predict": 2, "response_fields": []}).json()
    assert {"content", "generation_settings", "timings", "tokens_evaluated", "prompt"} <= set(everything)
    assert everything["prompt"] == evaluated
    some = _post(bare, "/completion", {"prompt": "I believe", "n_predict": 2,
                                       "response_fields": ["content", "generation_settings/n_predict", "prompt"]}).json()
    assert some == {"content": everything["content"], "generation_settings/n_predict": 2, "prompt": evaluated}
    assert _post(bare, "/completion", {"prompt": tokens, "n_predict": 1}).json()["prompt"] == evaluated


def test_a_prompt_object_is_its_prompt_string(bare):
    plain = _post(bare, "/completion", {"prompt": "I believe", "n_predict": 3, "temperature": 0}).json()
    obj = _post(bare, "/completion", {"prompt": {"prompt_string": "I believe"}, "n_predict": 3, "temperature": 0}).json()
    assert obj["content"] == plain["content"]
    both = _post(bare, "/completion", {"prompt": [{"prompt_string": "I believe"}, "I believe"], "n_predict": 3,
                                       "temperature": 0}).json()
    assert [b["content"] for b in both] == [plain["content"]] * 2
    for bad, status in (({"prompt_string": "x", "multimodal_data": ["AAAA"]}, 400), ({"prompt_string": 5}, 400)):
        assert _post(bare, "/completion", {"prompt": bad, "n_predict": 1}).status_code == status


def test_generation_settings_name_llama_servers_samplers_at_their_neutral_values(bare):
    s = _post(bare, "/completion", {"prompt": "x", "n_predict": 1}).json()["generation_settings"]
    assert s["adaptive_target"] == -1.0 and s["adaptive_decay"] == 0.9 and s["dry_multiplier"] == 0.0
    assert s["n_predict"] == 1 and "seed" in s and s["xtc_probability"] == 0.0


# -- per-slot context ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def per_slot(tmp_path_factory):
    """Two slots of a 512-token pool, each held to 256 (--ctx-per-slot)."""
    from actord.testing.models import write_tiny_llama

    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-ps.gguf", seed=1))
    proc, _, url = _start(model, tmp_path_factory.mktemp("d"), "--api-key", KEY, "--chat-template", "chatml",
                          "--ctx", "512", "--ctx-per-slot")
    try:
        yield url
    finally:
        _stop(proc)


@pytest.mark.slow
def test_per_slot_context_is_reported_and_held_as_llama_servers(per_slot):
    props = httpx.get(per_slot + "/props", headers=H, timeout=60).json()
    assert props["default_generation_settings"]["n_ctx"] == 256
    assert [s["n_ctx"] for s in httpx.get(per_slot + "/slots", headers=H, timeout=60).json()] == [256, 256]
    long = [3 + i % 200 for i in range(300)]  # fits the pool, not a slot
    native = _post(per_slot, "/completion", {"prompt": long, "n_predict": 1})
    err = native.json()["error"]
    assert native.status_code == 400 and err["type"] == "exceed_context_size_error"
    assert err["n_prompt_tokens"] == 300 and err["n_ctx"] == 256
    chat = _post(per_slot, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]})
    err = chat.json()["error"]
    assert chat.status_code == 400 and err["code"] == "context_length_exceeded" and err["n_ctx"] == 256
    text = _post(per_slot, "/completion", {"prompt": "hello " * 400, "n_predict": 1})
    assert text.status_code == 400 and text.json()["error"]["n_ctx"] == 256
    # A generation stops where the slot's context ends.
    r = _post(per_slot, "/completion", {"prompt": long[:250], "n_predict": 50, "ignore_eos": True}).json()
    assert r["tokens_predicted"] == 6 and r["stop_type"] == "limit"


def test_without_the_mode_a_slot_may_use_the_whole_pool(bare):
    props = httpx.get(bare + "/props", headers=H, timeout=60).json()
    assert props["default_generation_settings"]["n_ctx"] == 4096
    assert _post(bare, "/completion", {"prompt": [3 + i % 200 for i in range(3000)], "n_predict": 1}).status_code == 200


def test_llama_servers_unprefixed_aliases_answer_in_its_forms_and_v1_in_openais(per_slot):
    def first_delta(path: str) -> dict:
        with httpx.stream("POST", per_slot + path, headers=H, timeout=60, json={
                "messages": MSGS, "max_tokens": 2, "stream": True}) as s:
            return next(json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {"))
    assert first_delta("/v1/chat/completions")["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first_delta("/chat/completions")["choices"][0]["delta"] == {"role": "assistant", "content": None}
    long = {"messages": [{"role": "user", "content": "word " * 300}]}
    v1 = _post(per_slot, "/v1/chat/completions", long).json()["error"]
    alias = _post(per_slot, "/chat/completions", long).json()["error"]
    assert v1["type"] == "invalid_request_error" and v1["code"] == "context_length_exceeded"
    assert alias["type"] == "exceed_context_size_error" and alias["n_ctx"] == 256 and alias["n_prompt_tokens"] > 256


def test_ignore_eos_shows_the_end_token_banned_in_generation_settings(bare):
    s = _post(bare, "/completion", {"prompt": "x", "n_predict": 1, "ignore_eos": True}).json()["generation_settings"]
    assert s["logit_bias"] and all(e["bias"] is None for e in s["logit_bias"])
    assert _post(bare, "/completion", {"prompt": "x", "n_predict": 1}).json()["generation_settings"]["logit_bias"] == []


def test_two_assistant_messages_at_the_end_are_refused_as_llama_server_does(bare):
    msgs = [*MSGS, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    r = _post(bare, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_chat_stream_sends_no_empty_content_delta(bare):
    with httpx.stream("POST", bare + "/chat/completions", headers=H, timeout=60, json={
            "messages": MSGS, "max_tokens": 24, "stream": True, "stop": ["e"]}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert all(d.get("content") is None or d["content"] for d in deltas)
