"""llama-server's native HTTP API and the seed's page and gene verbs, in the shape of
llama-server's own API tests (tools/server/tests/unit: test_completion, test_tokenize,
test_slot_save, test_lora, test_basic, test_security) plus the seeds' test_slot_page and
test_lora_page: each route's happy path, and its failure codes.

One daemon (`actord serve --http ... --api-key KEY`), as users run it: the tiny generated
llama with a chat template, a default gene (`--gene`), a gene folder to load more from, and a
page-RAM ceiling small enough that a long prompt's page goes over it. No network, no GPU.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from actord.frontends.client import Client
from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama, write_tiny_lora
from tests.waits import wait_until
from actord.testing.daemon import wait_until_serving

PY = sys.executable
KEY = "native-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PAGE_RAM = 20000  # the tiny llama's state is 256 bytes a token: a page of ~78 tokens fits


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("native")
    model = write_tiny_llama(d / "tiny-chat.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE)
    genes = d / "genes"
    write_tiny_lora(genes / "default.gguf", str(model), seed=5)
    write_tiny_lora(genes / "extra.gguf", str(model), seed=6)
    sock = d / "actord.sock"
    proc = subprocess.Popen(
        [PY, "-m", "actord.cli", "serve", "--model", str(model), "--slots", "2", "--ctx", "4096", "--batch", "64",
         "--threads", "1", "--socket", str(sock), "--page-dir", str(d / "pages"), "--log-level", "warning",
         "--http", "127.0.0.1:0", "--api-key", KEY, "--page-ram-bytes", str(PAGE_RAM),
         "--gene", str(genes / "default.gguf"), "--gene-dir", str(genes)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until_serving(proc, sock, timeout_s=60, poll_s=0.1)
        with Client(str(sock), timeout=10) as c:
            url = "http://" + c.call("props")["http"]
        yield Server(url, sock, d / "pages", proc)
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    log = err.decode(errors="replace")
    for bad in ("Traceback", "internal_error", "actor.crashed"):  # every refusal was a typed answer
        assert bad not in log, log[-3000:]


class Server:
    def __init__(self, url: str, sock: Path, pages: Path, proc: subprocess.Popen) -> None:
        self.url, self.sock, self.pages, self.proc = url, sock, pages, proc

    def request(self, method: str, path: str, data=None, headers=None, **kw) -> httpx.Response:
        h = dict(AUTH) if headers is None else headers
        return httpx.request(method, self.url + path, json=data, headers=h, timeout=60, **kw)

    def post(self, path: str, data=None, **kw) -> httpx.Response:
        return self.request("POST", path, data, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.request("GET", path, **kw)

    def ok(self, method: str, path: str, data=None) -> dict:
        r = self.request(method, path, data)
        assert r.status_code == 200, (path, r.text)
        return r.json()

    def stream(self, data: dict) -> list[dict]:
        events = []
        with httpx.Client(timeout=60) as c, c.stream("POST", self.url + "/completion", json=data, headers=AUTH) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                else:
                    assert line == "", line  # no [DONE], no comments
        return events

    def slot(self, i: int) -> dict:
        return next(s for s in self.ok("GET", "/slots") if s["id"] == i)

    def rpc(self, method: str, params=None):
        with Client(str(self.sock), timeout=60) as c:
            return c.call(method, params)

    def metric(self, name: str) -> float:
        text = self.get("/metrics").text
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


def assert_error(r: httpx.Response, status: int, actord_type: str | None = None, kind: str | None = None) -> dict:
    """llama-server's error object: {"error": {"code": status, "message", "type"}}."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"], err
    if actord_type is not None:
        assert err["actord"]["type"] == actord_type, err
    if kind is not None:
        assert err["type"] == kind, err
    return err


def tokens_of(server: Server, text: str, add_special: bool = True) -> list[int]:
    return server.ok("POST", "/tokenize", {"content": text, "add_special": add_special})["tokens"]


# -- /completion ------------------------------------------------------------------------------


def test_completion_reports_timings_and_reuses_the_slots_cache(server):
    prompt = tokens_of(server, "What is the capital of France?")
    server.ok("POST", "/slots/1?action=erase")
    r = server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 1, "cache_prompt": True, "n_predict": 6,
                                          "temperature": 0, "return_tokens": True})
    assert r["id_slot"] == 1 and r["stop"] is True and r["stop_type"] == "limit" and r["content"]
    assert r["timings"]["prompt_n"] == len(prompt) and r["timings"]["cache_n"] == 0  # all processed
    assert r["tokens_evaluated"] == len(prompt) and r["tokens_predicted"] == len(r["tokens"]) == 6
    assert r["timings"]["predicted_n"] == 6 and r["timings"]["prompt_ms"] >= 0
    assert r["tokens_cached"] == server.slot(1)["n_tokens"]  # what the slot holds now
    again = server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 1, "n_predict": 6, "temperature": 0})
    assert again["timings"]["prompt_n"] == 1 and again["content"] == r["content"]  # only the last token
    longer = prompt + r["tokens"] + [prompt[-1]]
    third = server.ok("POST", "/completion", {"prompt": longer, "id_slot": 1, "n_predict": 2, "temperature": 0})
    assert third["timings"]["prompt_n"] == 2  # the reply's last token (never decoded) and the new one
    assert third["timings"]["cache_n"] == len(longer) - 2


def test_completions_path_is_the_same_native_api(server):
    body = {"prompt": "hello world", "n_predict": 4, "temperature": 0}
    a, b = server.ok("POST", "/completion", body), server.ok("POST", "/completions", body)
    assert a["content"] == b["content"] and "timings" in b and "choices" not in b


def test_streamed_chunks_join_to_the_whole_answer_and_end_with_the_result(server):
    body = {"prompt": "the model and the cache", "n_predict": 10, "temperature": 0}
    whole = server.ok("POST", "/completion", body)
    events = server.stream({**body, "stream": True})
    partial, last = events[:-1], events[-1]
    assert partial and all(e["stop"] is False and "content" in e for e in partial)
    assert "".join(e["content"] for e in partial) == whole["content"]
    assert [e["tokens_predicted"] for e in partial if e["tokens"]] == list(range(1, 11))
    assert last["stop"] is True and last["content"] == "" and last["stop_type"] == "limit"
    assert last["tokens_predicted"] == 10 and last["timings"]["predicted_n"] == 10
    assert last["id_slot"] == partial[0]["id_slot"]


def test_prompt_shapes_tokens_mixed_and_several(server):
    text = server.ok("POST", "/completion", {"prompt": "hello world", "n_predict": 3, "temperature": 0})
    ids = tokens_of(server, "hello world")
    as_ids = server.ok("POST", "/completion", {"prompt": ids, "n_predict": 3, "temperature": 0})
    assert as_ids["content"] == text["content"] and as_ids["tokens_evaluated"] == len(ids)
    # ids mixed with strings: a leading string gets the BOS, as a text prompt does
    mixed = server.ok("POST", "/completion", {"prompt": ["hello", *tokens_of(server, " world", False)],
                                              "n_predict": 3, "temperature": 0})
    assert mixed["tokens_evaluated"] == len(tokens_of(server, "hello")) + len(tokens_of(server, " world", False))
    several = server.ok("POST", "/completion", {"prompt": ["hello world", ids], "n_predict": 3, "temperature": 0})
    assert isinstance(several, list) and [s["index"] for s in several] == [0, 1]
    assert several[0]["content"] == several[1]["content"] == text["content"]
    one_in_a_list = server.ok("POST", "/completion", {"prompt": ["hello world"], "n_predict": 3, "temperature": 0})
    assert isinstance(one_in_a_list, dict) and one_in_a_list["content"] == text["content"]
    r = server.post("/completion", {"prompt": ["a", "b"], "stream": True})
    assert_error(r, 400, "InvalidParams")["actord"]["param"] == "prompt"
    assert_error(server.post("/completion", {"prompt": {"prompt_string": "x", "multimodal_data": ["AA=="]}}), 400)
    assert_error(server.post("/completion", {"n_predict": 2}), 400, "InvalidParams")
    assert_error(server.post("/completion", {"prompt": [999999], "n_predict": 2}), 400, "InvalidParams")


def test_stop_words_n_predict_zero_and_response_fields(server):
    free = server.ok("POST", "/completion", {"prompt": "hello world", "n_predict": 8, "temperature": 0})
    word = free["content"][2:4]  # greedy: the same text comes again, and stops at this word
    stopped = server.ok("POST", "/completion", {"prompt": "hello world", "n_predict": 8, "temperature": 0,
                                                "stop": ["zzzz", word]})
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == free["content"][: free["content"].index(word)]
    zero = server.ok("POST", "/completion", {"prompt": "hello world", "n_predict": 0})
    assert zero["content"] == "" and zero["tokens_predicted"] == 0  # the prompt is cached, nothing generated
    picked = server.ok("POST", "/completion", {"prompt": "hello world", "n_predict": 2, "temperature": 0,
                                               "response_fields": ["content", "generation_settings/n_predict",
                                                                   "nope/none"]})
    assert picked == {"content": free["content"][: len(picked["content"])], "generation_settings/n_predict": 2}


def test_seed_reproduces_a_sampled_completion(server):
    body = {"prompt": "once upon a time", "n_predict": 8, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 42}
    a, b = server.ok("POST", "/completion", body), server.ok("POST", "/completion", body)
    assert a["content"] == b["content"] and a["generation_settings"]["seed"] == 42
    assert server.ok("POST", "/completion", {**body, "seed": -1})["generation_settings"]["seed"] != -1
    assert_error(server.post("/completion", {**body, "seed": -2}), 400, "InvalidParams")


@pytest.mark.parametrize("field,value", [
    ("dry_multiplier", 0.8), ("xtc_probability", 0.5), ("mirostat", 2), ("typical_p", 0.9), ("dynatemp_range", 0.5),
    ("top_n_sigma", 1.0), ("min_keep", 3), ("samplers", ["top_k"]),
])
def test_a_sampler_actord_lacks_is_a_400_naming_it(server, field, value):
    err = assert_error(server.post("/completion", {"prompt": "hi", "n_predict": 2, field: value}), 400)
    assert err["actord"]["param"] == field and field in err["message"]


def _cold(server: Server) -> None:
    for s in server.ok("GET", "/slots"):
        server.ok("POST", f"/slots/{s['id']}?action=erase")


@pytest.mark.slow
def test_n_cmpl_answers_n_completions_from_one_prefill_by_index(server):
    body = {"prompt": "once upon a time there was a", "n_predict": 6, "temperature": 1.0, "seed": 42}
    _cold(server)
    before = server.metric("prompt_tokens_processed_total")
    rs = server.ok("POST", "/completion", {**body, "n_cmpl": 3})  # 3 choices on 2 slots: one queues
    processed = server.metric("prompt_tokens_processed_total") - before
    assert isinstance(rs, list) and [r["index"] for r in rs] == [0, 1, 2]
    n_prompt = rs[0]["tokens_evaluated"]
    # One prefill (the prompt but its last token), then one token per choice; the queued
    # choice cuts its slot back to the prompt, so it too decodes one.
    assert processed == n_prompt - 1 + 3 and rs[0]["timings"]["prompt_n"] == n_prompt
    singles = []
    for j in range(3):
        _cold(server)
        singles.append(server.ok("POST", "/completion", {**body, "seed": 42 + j})["content"])
    assert [r["content"] for r in rs] == singles and len(set(singles)) == 3
    _cold(server)
    assert [r["content"] for r in server.ok("POST", "/completion", {**body, "n": 3})] == singles  # n: the alias
    _cold(server)
    events = server.stream({**body, "n_cmpl": 3, "stream": True})
    texts = ["", "", ""]
    for e in events:
        if not e["stop"]:
            texts[e["index"]] += e["content"]
    finals = [e for e in events if e["stop"]]
    assert sorted(e["index"] for e in finals) == [0, 1, 2] and texts == singles
    two = server.ok("POST", "/completion", {**body, "prompt": ["a b c d", "e f g h"], "n_cmpl": 2})
    assert [r["index"] for r in two] == [0, 1, 2, 3]
    assert two[0]["prompt"] == two[1]["prompt"] == "<s>a b c d" and two[2]["prompt"] == "<s>e f g h"  # as evaluated


def test_cache_prompt_false_decodes_the_whole_prompt_and_leaves_nothing_to_reuse(server):
    prompt = tokens_of(server, "Name three rivers of Europe.")
    first = {"prompt": prompt, "id_slot": 1, "n_predict": 4, "temperature": 0, "return_tokens": True}
    server.ok("POST", "/completion", first)  # the slot now holds the prompt
    fresh = server.ok("POST", "/completion", {**first, "cache_prompt": False})
    assert fresh["timings"]["cache_n"] == 0 and fresh["timings"]["prompt_n"] == len(prompt)
    # what the fresh decode left in the slot is under a scope of its own: not reused either
    after = server.ok("POST", "/completion", first)
    assert after["timings"]["cache_n"] == 0 and after["timings"]["prompt_n"] == len(prompt)
    # each prompt of one request is its own: the second does not share the first's cells
    both = server.ok("POST", "/completion", {"prompt": [prompt, prompt], "n_predict": 2, "temperature": 0,
                                             "cache_prompt": False})
    assert [r["timings"]["cache_n"] for r in both] == [0, 0]


def test_cache_prompt_false_with_a_mind_is_a_400_naming_it(server):
    r = server.post("/completion", {"prompt": "hi", "n_predict": 1, "cache_prompt": False},
                    headers={**AUTH, "x-actord-mind": "rhea"})
    assert assert_error(r, 400, "InvalidParams")["actord"]["param"] == "cache_prompt"


@pytest.mark.parametrize("field,value", [("n_cmpl", 9), ("n_cmpl", 0), ("n", 9), ("n_cmpl", "2")])
def test_n_cmpl_outside_one_to_max_n_is_a_400_naming_it(server, field, value):
    err = assert_error(server.post("/completion", {"prompt": "hi", "n_predict": 2, field: value}), 400,
                       "InvalidParams")
    assert err["actord"]["param"] == field


def test_neutral_values_of_missing_samplers_are_accepted(server):
    r = server.ok("POST", "/completion", {"prompt": "hi", "n_predict": 2, "min_p": 0, "repeat_penalty": 1.0,
                                          "presence_penalty": 0, "grammar": "", "n_probs": 0, "logit_bias": [],
                                          "cache_prompt": False, "n_keep": -1, "model": "anything"})
    assert r["tokens_predicted"] == 2


GREEDY = {"prompt": "hello world", "n_predict": 6, "temperature": 0, "return_tokens": True}


def test_sampling_defaults_are_llama_servers_min_p_and_penalty_window_included(server):
    settings = server.ok("POST", "/completion", {"prompt": "hi", "n_predict": 1})["generation_settings"]
    assert {k: settings[k] for k in ("temperature", "top_k", "top_p", "min_p", "repeat_last_n", "repeat_penalty",
                                     "presence_penalty", "frequency_penalty", "n_probs", "grammar", "logit_bias")} == {
        "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_last_n": 64, "repeat_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "n_probs": 0, "grammar": "", "logit_bias": []}
    assert server.ok("GET", "/props")["default_generation_settings"]["params"]["min_p"] == 0.05


def test_min_p_defaults_to_005_and_min_p_1_keeps_only_the_likeliest_token(server):
    body = {"prompt": "hello world", "n_predict": 24, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 11}
    absent = server.ok("POST", "/completion", body)["content"]
    assert server.ok("POST", "/completion", {**body, "min_p": 0.05})["content"] == absent  # the default, applied
    assert server.ok("POST", "/completion", {**body, "min_p": 0})["content"] != absent
    greedy = server.ok("POST", "/completion", {**body, "temperature": 0})["content"]
    assert server.ok("POST", "/completion", {**body, "min_p": 1})["content"] == greedy
    clamped = server.ok("POST", "/completion", {**body, "min_p": 7})  # llama-server clamps to [0, 1]
    assert clamped["generation_settings"]["min_p"] == 1.0 and clamped["content"] == greedy
    assert_error(server.post("/completion", {**body, "min_p": "high"}), 400)["actord"]["param"] == "min_p"


@pytest.mark.parametrize("field", ["repeat_penalty", "presence_penalty", "frequency_penalty"])
def test_a_penalty_changes_the_greedy_output(server, field):
    body = {"prompt": "the model and the cache", "n_predict": 96, "temperature": 0}
    base = server.ok("POST", "/completion", body)["content"]
    r = server.ok("POST", "/completion", {**body, field: 1.5})
    assert r["content"] != base and r["generation_settings"][field] == 1.5
    assert_error(server.post("/completion", {**body, field: "x"}), 400)["actord"]["param"] == field


def test_repeat_last_n_zero_turns_the_penalties_off(server):
    body = {"prompt": "the model and the cache", "n_predict": 96, "temperature": 0, "repeat_penalty": 1.5}
    base = server.ok("POST", "/completion", {**body, "repeat_penalty": 1.0})["content"]
    assert server.ok("POST", "/completion", {**body, "repeat_last_n": 0})["content"] == base
    whole = server.ok("POST", "/completion", {**body, "repeat_last_n": -1})  # the whole context
    assert whole["content"] != base and whole["generation_settings"]["repeat_last_n"] == -1
    for bad in (-2, 1.5, "64"):
        assert_error(server.post("/completion", {**body, "repeat_last_n": bad}), 400)["actord"]["param"] == \
            "repeat_last_n"
    assert_error(server.post("/completion", {**body, "repeat_penalty": 0}), 400)["actord"]["param"] == \
        "repeat_penalty"


def test_grammar_constrains_the_completion(server):
    grammar = 'root ::= "yes" | "no"'
    r = server.ok("POST", "/completion", {"prompt": "hi", "n_predict": 20, "temperature": 0, "grammar": grammar})
    assert r["content"] in ("yes", "no") and r["stop_type"] == "eos" and r["generation_settings"]["grammar"] == grammar
    events = server.stream({"prompt": "hi", "n_predict": 20, "temperature": 1.0, "seed": 3, "grammar": grammar,
                            "stream": True})
    assert "".join(e["content"] for e in events[:-1]) in ("yes", "no")
    assert_error(server.post("/completion", {"prompt": "hi", "grammar": "root ::= ("}), 400)["actord"]["param"] == \
        "grammar"
    assert_error(server.post("/completion", {"prompt": "hi", "grammar": 5}), 400)["actord"]["param"] == "grammar"


def test_json_schema_constrains_the_completion_and_an_empty_one_is_any_object(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = server.ok("POST", "/completion", {"prompt": "hi", "n_predict": 60, "temperature": 0, "json_schema": schema})
    assert r["stop_type"] == "eos" and isinstance(json.loads(r["content"])["ok"], bool)
    assert "root" in r["generation_settings"]["grammar"]  # llama-server shows the schema's grammar
    anything = server.ok("POST", "/completion", {"prompt": "hi", "n_predict": 200, "temperature": 0,
                                                 "json_schema": {}})
    if anything["stop_type"] == "eos":
        assert isinstance(json.loads(anything["content"]), dict)
    else:  # a free object may run past n_predict; what there is is a JSON object's start
        assert anything["content"].lstrip().startswith("{")
    for bad in ({"type": "frob"}, [1], "x"):
        err = assert_error(server.post("/completion", {"prompt": "hi", "json_schema": bad}), 400)
        assert err["actord"]["param"] == "json_schema"
    both = server.post("/completion", {"prompt": "hi", "json_schema": schema, "grammar": 'root ::= "a"'})
    assert assert_error(both, 400)["actord"]["param"] == "json_schema"


def test_logit_bias_in_llama_servers_shapes_bans_and_biases_tokens(server):
    first = server.ok("POST", "/completion", GREEDY)["tokens"][0]
    for ban in ([[first, False]], {str(first): False}, [[first, -100]]):
        r = server.ok("POST", "/completion", {**GREEDY, "logit_bias": ban})
        assert r["tokens"][0] != first, ban
    assert server.ok("POST", "/completion", {**GREEDY, "logit_bias": [[first, False]]})["generation_settings"][
        "logit_bias"] == [{"bias": None, "token": first}]  # a ban shows as llama-server's -inf does: null
    text = server.ok("POST", "/tokenize", {"content": " world", "add_special": False, "parse_special": False})["tokens"]
    r = server.ok("POST", "/completion", {**GREEDY, "n_predict": 1, "logit_bias": [[" world", -0.5], [7, 1], [7, 2]]})
    want = {t: -0.5 for t in text}
    want[7] = want.get(7, 0.0) + 3.0  # a token named twice gets the sum, as libllama adds each entry
    assert r["generation_settings"]["logit_bias"] == [{"bias": b, "token": t} for t, b in sorted(want.items())]
    as_object = server.ok("POST", "/completion", {**GREEDY, "n_predict": 1, "logit_bias": {" world": -0.5}})
    assert as_object["generation_settings"]["logit_bias"] == [{"bias": -0.5, "token": t} for t in sorted(set(text))]


@pytest.mark.parametrize("bias", [[[1]], [[512, 1.0]], [[-1, 1.0]], {"99999": 1}, [[5, True]], [[5, "x"]], 5, "x"])
def test_a_bad_logit_bias_is_a_400_naming_it_and_nothing_runs(server, bias):
    before = server.metric('requests_total{outcome="ok"}')
    err = assert_error(server.post("/completion", {"prompt": "hi", "n_predict": 1, "logit_bias": bias}), 400)
    assert err["actord"]["param"] == "logit_bias"
    assert server.metric('requests_total{outcome="ok"}') == before


def test_n_probs_gives_completion_probabilities_in_llama_servers_shape(server):
    r = server.ok("POST", "/completion", {**GREEDY, "n_probs": 3})
    probs = r["completion_probabilities"]
    assert [p["id"] for p in probs] == r["tokens"] and r["generation_settings"]["n_probs"] == 3
    assert b"".join(bytes(p["bytes"]) for p in probs).decode() == r["content"]
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} and p["logprob"] <= 0
        assert len(p["top_logprobs"]) == 3 and set(p["top_logprobs"][0]) == {"id", "token", "bytes", "logprob"}
        assert p["top_logprobs"][0]["id"] == p["id"] and p["top_logprobs"][0]["logprob"] == p["logprob"]  # greedy
        assert sum(math.exp(a["logprob"]) for a in p["top_logprobs"]) <= 1 + 1e-6
    assert "completion_probabilities" not in server.ok("POST", "/completion", GREEDY)
    assert "completion_probabilities" not in server.ok("POST", "/completion", {**GREEDY, "n_predict": 0, "n_probs": 3})
    alias = server.ok("POST", "/completion", {**GREEDY, "logprobs": 2})  # llama-server's alias
    assert [len(p["top_logprobs"]) for p in alias["completion_probabilities"]] == [2] * 6
    for name, bad in (("n_probs", 21), ("n_probs", -1), ("n_probs", 1.5), ("logprobs", "yes")):
        assert_error(server.post("/completion", {**GREEDY, name: bad}), 400)["actord"]["param"] == name


def test_streamed_chunks_carry_their_tokens_probabilities_and_the_last_none(server):
    whole = server.ok("POST", "/completion", {**GREEDY, "n_probs": 2})
    events = server.stream({**GREEDY, "n_probs": 2, "stream": True})
    streamed = [p for e in events[:-1] for p in e.get("completion_probabilities", [])]
    assert [p["id"] for p in streamed] == [p["id"] for p in whole["completion_probabilities"]]
    assert [p["logprob"] for p in streamed] == pytest.approx([p["logprob"] for p in whole["completion_probabilities"]],
                                                             abs=1e-4)
    assert "completion_probabilities" not in events[-1]


# -- /tokenize, /detokenize, /apply-template -----------------------------------------------


def test_tokenize_detokenize_round_trip(server):
    content = "What is the capital of France ?"
    plain = server.ok("POST", "/tokenize", {"content": content})["tokens"]
    assert len(plain) > 5
    assert server.ok("POST", "/detokenize", {"tokens": plain})["content"].strip() == content
    bos = server.ok("GET", "/props")["bos"]
    with_bos = server.ok("POST", "/tokenize", {"content": content, "add_special": True})["tokens"]
    assert with_bos[0] == bos and with_bos[1:] == plain
    assert server.ok("POST", "/tokenize", {})["tokens"] == [] and server.ok("POST", "/detokenize", {})["content"] == ""


def test_tokenize_with_pieces_gives_bytes_for_partial_utf8(server):
    tokens = server.ok("POST", "/tokenize", {"content": "hi \u00e1", "with_pieces": True})["tokens"]
    assert all(t["id"] >= 0 and len(t["piece"]) > 0 for t in tokens)
    raw = b"".join(bytes(t["piece"]) if isinstance(t["piece"], list) else t["piece"].encode() for t in tokens)
    assert raw == "hi \u00e1".encode()
    assert any(isinstance(t["piece"], list) for t in tokens)  # the tiny vocab splits á into its bytes


def test_detokenize_refuses_ids_outside_the_vocabulary(server):
    assert_error(server.post("/detokenize", {"tokens": [1, 512]}), 400, "InvalidParams")
    assert_error(server.post("/detokenize", {"tokens": [-1]}), 400, "InvalidParams")
    assert_error(server.post("/detokenize", {"tokens": "1 2"}), 400, "InvalidParams")


def test_apply_template_renders_what_a_chat_would_decode(server):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    prompt = server.ok("POST", "/apply-template", {"messages": msgs})["prompt"]
    assert prompt == "<s><|system|>\nbe brief</s>\n<|user|>\nhello</s>\n<|assistant|>\n"
    chat = server.ok("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(tokens_of(server, prompt, add_special=False))
    dev = server.ok("POST", "/apply-template", {"messages": [{"role": "developer", "content": "be brief"},
                                                             {"role": "user", "content": "hello"}]})
    assert dev["prompt"] == prompt  # developer -> system, as on the chat route
    assert_error(server.post("/apply-template", {}), 400, "InvalidParams")
    assert_error(server.post("/apply-template", {"messages": []}), 400, "InvalidParams")
    assert_error(server.post("/apply-template", {"messages": [{"role": "user", "content": 5}]}), 400)


# -- /props, /slots and their actions -----------------------------------------------------------


def test_props_have_llama_servers_shape_and_the_page_versions(server):
    props = server.ok("GET", "/props")
    assert props["slot_page_version"] == 1 and props["lora_page_version"] == 1
    assert props["total_slots"] == 2 and props["model_path"].endswith(".gguf")
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 4096 and settings["params"]["seed"] == 0 and settings["params"]["temperature"] == 0.8
    assert props["chat_template"] == TINY_CHAT_TEMPLATE and props["bos_token"] == "<s>"
    assert props["n_slots"] == 2 and props["n_ctx"] == 4096  # actord's own props, beside llama-server's
    assert props["cors_proxy_enabled"] is False


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_the_cors_proxy_route_answers_as_llama_servers_does_with_its_proxy_off(server, method):
    r = server.request(method, "/cors-proxy?url=http://example.com")
    assert r.status_code == 403 and r.json()["error"]["code"] == 403, r.text


def test_slots_list_llama_server_fields_with_actords(server):
    slots = server.ok("GET", "/slots")
    assert [s["id"] for s in slots] == [0, 1]
    for s in slots:
        assert s["n_ctx"] == 4096 and s["is_processing"] is False and s["state"] == "idle"
        assert {"n_tokens", "mind", "genes", "n_checkpoints", "deferred"} <= set(s)
    assert len(server.ok("GET", "/slots?fail_on_no_slot=1")) == 2  # an idle slot: no 503


def test_slot_save_restore_erase(server):
    prompt = tokens_of(server, "What is the capital of France?")
    server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 1, "n_predict": 4, "temperature": 0})
    held = server.slot(1)["n_tokens"]
    saved = server.ok("POST", "/slots/1?action=save", {"filename": "slot1.page"})
    assert saved["id_slot"] == 1 and saved["filename"] == "slot1.page" and saved["n_saved"] == held
    assert saved["n_written"] > 0 and "save_ms" in saved["timings"] and (server.pages / "slot1.page").exists()
    erased = server.ok("POST", "/slots/0?action=erase")
    assert erased["id_slot"] == 0 and server.slot(0)["n_tokens"] == 0
    restored = server.ok("POST", "/slots/0?action=restore", {"filename": "slot1.page"})
    assert restored["n_restored"] == held and restored["n_read"] > 0 and "restore_ms" in restored["timings"]
    again = server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 0, "n_predict": 4, "temperature": 0})
    assert again["timings"]["prompt_n"] == 1  # the restored cache served the prompt
    erased = server.ok("POST", "/slots/1?action=erase")
    assert erased["n_erased"] == held and server.slot(1)["n_tokens"] == 0


def test_slot_action_failures(server):
    assert_error(server.post("/slots/x?action=save", {"filename": "a.page"}), 400, "InvalidParams")
    assert_error(server.post("/slots/0?action=bogus"), 400, "InvalidParams")
    assert_error(server.post("/slots/0"), 400, "InvalidParams")  # no action
    assert_error(server.post("/slots/7?action=erase"), 404, "SlotNotFound")
    assert_error(server.post("/slots/0?action=save", {}), 400, "InvalidParams")  # no filename
    assert_error(server.post("/slots/0?action=save", {"filename": "../escape.page"}), 400, "PathRefused")
    assert_error(server.post("/slots/0?action=restore", {"filename": "never-saved.page"}), 404, "FileNotFound")
    assert_error(server.post("/slots/0?action=erase", content=b"{nope",
                             headers={**AUTH, "content-type": "application/json"}), 400)


def test_seed_page_verbs_with_their_status_codes(server):
    server.ok("POST", "/slots/0?action=erase")
    server.ok("POST", "/slots/1?action=erase")
    prompt = tokens_of(server, "a mind that pages out")
    first = server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 0, "n_predict": 3, "temperature": 0})
    held = server.slot(0)["n_tokens"]
    out = server.ok("POST", "/slots/0?action=page_out&page=ada")
    assert out["id_slot"] == 0 and out["page"] == "ada" and out["n_tokens"] == held and out["n_bytes"] > 0
    assert "page_out_ms" in out["timings"] and server.slot(0)["n_tokens"] == 0
    assert_error(server.post("/slots/0?action=page_out&page=bo"), 400, "SlotEmpty")  # 400 empty slot
    assert_error(server.post("/slots/1?action=page_in&page=nobody"), 404, "PageNotFound")  # 404 unknown page
    assert_error(server.post("/slots/0?action=page_out&page=..%2Fx"), 400, "PathRefused")
    assert_error(server.post("/slots/0?action=page_out"), 400, "InvalidParams")  # no page
    back = server.ok("POST", "/slots/1?action=page_in&page=ada")
    assert back["id_slot"] == 1 and back["n_tokens"] == held and server.slot(1)["n_tokens"] == held
    again = server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 1, "n_predict": 3, "temperature": 0})
    assert again["timings"]["prompt_n"] == 1 and again["content"] == first["content"]
    # page_in into a slot that holds a sequence is refused and leaves the page in the store
    server.ok("POST", "/slots/1?action=page_out&page=ada")
    server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 0, "n_predict": 1})
    assert_error(server.post("/slots/0?action=page_in&page=ada"), 409, "SlotBusy")
    assert [p["page"] for p in server.rpc("page.list")] == ["ada"]
    dropped = server.ok("POST", "/slots/0?action=page_drop&page=ada")
    assert dropped["page"] == "ada" and dropped["dropped"] is True and server.rpc("page.list") == []
    assert_error(server.post("/slots/0?action=page_drop&page=ada"), 404, "PageNotFound")


def test_page_over_the_ceiling_is_503_and_leaves_the_slot_intact(server):
    server.ok("POST", "/slots/0?action=erase")
    long = tokens_of(server, "many words " * 40)  # > PAGE_RAM / 256 tokens
    assert len(long) * 256 > PAGE_RAM
    server.ok("POST", "/completion", {"prompt": long, "id_slot": 0, "n_predict": 1})
    held = server.slot(0)["n_tokens"]
    failed, refused = server.metric("page_failed_total"), server.metric("page_refused_total")
    assert_error(server.post("/slots/0?action=page_out&page=big"), 503, "PageRamExceeded", "unavailable_error")
    assert server.slot(0)["n_tokens"] == held and server.rpc("page.list") == []
    # Page RAM is a cache: a full one refuses (callers spill), which is not a failed move.
    assert (server.metric("page_refused_total"), server.metric("page_failed_total")) == (refused + 1, failed)


def test_spill_writes_a_page_file_and_drop_frees_the_page(server):
    server.ok("POST", "/slots/0?action=erase")
    prompt = tokens_of(server, "spilled to disk")
    server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 0, "n_predict": 2, "temperature": 0})
    server.ok("POST", "/slots/0?action=page_out&page=sp")
    kept = server.ok("POST", "/slots/0?action=spill&page=sp", {"filename": "sp.page"})
    assert kept["filename"] == "sp.page" and kept["n_bytes"] > 0 and kept["dropped"] is False
    assert (server.pages / "sp.page").exists() and [p["page"] for p in server.rpc("page.list")] == ["sp"]
    gone = server.ok("POST", "/slots/0?action=spill&page=sp", {"file": "sp2.page", "drop": True})
    assert gone["dropped"] is True and server.rpc("page.list") == []
    assert_error(server.post("/slots/0?action=spill&page=sp", {"filename": "sp3.page"}), 404, "PageNotFound")
    assert_error(server.post("/slots/0?action=spill&page=sp"), 400, "InvalidParams")  # no file
    server.ok("POST", "/slots/0?action=restore", {"filename": "sp2.page"})
    again = server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 0, "n_predict": 2, "temperature": 0})
    assert again["timings"]["prompt_n"] == 1


def test_a_page_moved_out_over_http_comes_in_over_json_rpc(server):
    server.ok("POST", "/slots/0?action=erase")
    server.ok("POST", "/slots/1?action=erase")
    prompt = tokens_of(server, "from one front to the other")
    first = server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 0, "n_predict": 3, "temperature": 0})
    server.ok("POST", "/slots/0?action=page_out&page=cross")
    assert server.rpc("page.in", {"slot": 1, "page": "cross"})["n_tokens"] == first["tokens_cached"]
    again = server.ok("POST", "/completion", {"prompt": prompt, "id_slot": 1, "n_predict": 3, "temperature": 0})
    assert again["timings"]["prompt_n"] == 1 and again["content"] == first["content"]
    # and back: out over JSON-RPC, in over HTTP
    server.rpc("page.out", {"slot": 1, "page": "cross"})
    assert server.ok("POST", "/slots/0?action=page_in&page=cross")["n_tokens"] == first["tokens_cached"]
    server.ok("POST", "/slots/0?action=erase")


# -- /lora-adapters and the gene verbs -------------------------------------------------------


def test_lora_adapters_list_and_the_seed_gene_verbs(server):
    genes = server.ok("GET", "/lora-adapters")
    assert len(genes) == 1 and genes[0]["scale"] == 1.0 and genes[0]["resident"] is True and genes[0]["n_bytes"] > 0
    default = genes[0]["id"]
    loaded = server.ok("POST", "/lora-adapters/load", {"path": "extra.gguf"})
    gid = loaded["id"]
    listed = {g["id"]: g for g in server.ok("GET", "/lora-adapters")}
    assert listed[gid]["scale"] == 0.0 and listed[gid]["resident"] is True
    out = server.ok("POST", "/lora-adapters/page_out", {"id": gid})
    assert out["resident"] is False and out["n_moved"] == out["n_bytes"] > 0
    assert server.ok("POST", "/lora-adapters/page_out", {"id": gid})["n_moved"] == 0  # idempotent
    assert server.metric("llamacpp:lora_host_bytes") >= out["n_bytes"]
    # a request applying a paged-out gene pages it in on its own path (a counted miss)
    misses = server.metric("llamacpp:lora_page_in_on_demand_total")
    server.ok("POST", "/completion", {"prompt": "hi", "n_predict": 2, "lora": [{"id": gid, "scale": 0.5}]})
    assert server.metric("llamacpp:lora_page_in_on_demand_total") == misses + 1
    server.ok("POST", "/lora-adapters/page_out", {"id": gid})
    back = server.ok("POST", "/lora-adapters/page_in", {"id": gid})
    assert back["resident"] is True and back["n_moved"] == back["n_bytes"]
    assert server.ok("POST", "/lora-adapters/page_in", {"id": gid})["n_moved"] == 0
    assert_error(server.post("/lora-adapters/page_out", {"id": default}), 409, "GeneIsDefault")
    assert_error(server.post("/lora-adapters/page_out", {"id": 999}), 404, "GeneNotFound")
    assert_error(server.post("/lora-adapters/page_in", {}), 400, "InvalidParams")
    assert_error(server.post("/lora-adapters/load", {"path": "../outside.gguf"}), 400, "PathRefused")
    assert_error(server.post("/lora-adapters/load", {"path": "missing.gguf"}), 404, "FileNotFound")
    assert_error(server.post("/lora-adapters/fold", {"id": gid}), 404)
    unloaded = server.ok("POST", "/lora-adapters/unload", {"id": gid})
    assert unloaded["success"] is True and gid not in {g["id"] for g in server.ok("GET", "/lora-adapters")}
    assert_error(server.post("/lora-adapters/unload", {"id": gid}), 404, "GeneNotFound")


def test_lora_per_request_list_turns_unlisted_adapters_off(server):
    default = server.ok("GET", "/lora-adapters")[0]["id"]
    body = {"prompt": "hello world", "n_predict": 6, "temperature": 0, "id_slot": 0}
    base = server.ok("POST", "/completion", body)
    named = server.ok("POST", "/completion", {**body, "lora": [{"id": default, "scale": 1.0}]})
    off = server.ok("POST", "/completion", {**body, "lora": []})
    assert named["content"] == base["content"] and off["content"] != base["content"]
    assert server.slot(0)["genes"] == [{"id": default, "scale": 0.0}]
    assert_error(server.post("/completion", {**body, "lora": [{"id": 999, "scale": 1.0}]}), 404, "GeneNotFound")


def test_global_lora_scales_answer_only_what_is_set(server):
    default = server.ok("GET", "/lora-adapters")[0]["id"]
    assert server.ok("POST", "/lora-adapters", [{"id": default, "scale": 1.0}]) == {"success": True}
    assert_error(server.post("/lora-adapters", [{"id": default, "scale": 0.0}]), 501, kind="not_supported_error")
    assert_error(server.post("/lora-adapters", {"id": default}), 400)  # not an array
    assert_error(server.post("/lora-adapters", [{"id": 999, "scale": 1.0}]), 400)


# -- health, metrics, keys, bad input -----------------------------------------------------------


def test_health_is_public_and_answers_as_llama_server(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and "error" not in r.json()
    assert httpx.get(server.url + "/v1/health").json()["status"] == "ok"


@pytest.mark.slow
def test_metrics_carry_llama_servers_series_and_the_seeds_names(server):
    assert_error(httpx.get(server.url + "/metrics"), 401, kind="authentication_error")
    text = server.get("/metrics").text
    for name in ("page_store_bytes", "page_store_pages", "ctx_checkpoint_bytes", "page_out_total", "page_in_total",
                 "page_failed_total", "ctx_checkpoints_evicted_budget_total", "ctx_checkpoints_skipped_budget_total",
                 "lora_page_out_total", "lora_page_in_total", "lora_page_in_on_demand_total",
                 "lora_page_failed_total", "lora_device_bytes", "lora_host_bytes"):
        assert re.search(rf"^{name} ", text, re.M), name  # actord's own series
        assert re.search(rf"^llamacpp:{name} ", text, re.M), name  # and llama-server's spelling
        assert server.metric(name) == server.metric("llamacpp:" + name), name
    for name in ("prompt_tokens_total", "tokens_predicted_total", "n_decode_total", "requests_processing"):
        assert re.search(rf"^# TYPE llamacpp:{name} ", text, re.M), name
    before = server.metric("llamacpp:tokens_predicted_total")
    server.ok("POST", "/completion", {"prompt": "count me", "n_predict": 3, "ignore_eos": True})
    assert server.metric("llamacpp:tokens_predicted_total") == before + 3
    assert server.metric("llamacpp:tokens_predicted_total") == server.metric("predicted_tokens_total")
    # llama-server's timing series, counted by the scheduler as each completion ends
    steps, seconds = server.metric("predicted_steps_total"), server.metric("predicted_seconds_total")
    r = server.ok("POST", "/completion", {"prompt": "count me again", "n_predict": 4, "ignore_eos": True})
    assert server.metric("predicted_steps_total") == steps + 3  # the tokens after the first
    assert server.metric("predicted_seconds_total") > seconds and server.metric("prompt_seconds_total") > 0
    assert server.metric("llamacpp:n_tokens_max") >= r["tokens_evaluated"] + 4
    assert server.metric("llamacpp:n_busy_slots_per_decode") >= 1


@pytest.mark.parametrize("method,path,data", [
    ("POST", "/completion", {"prompt": "x"}), ("POST", "/completions", {"prompt": "x"}),
    ("POST", "/tokenize", {"content": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
    ("POST", "/apply-template", {"messages": [{"role": "user", "content": "x"}]}), ("GET", "/props", None),
    ("GET", "/slots", None), ("POST", "/slots/0?action=erase", None),
    ("POST", "/slots/0?action=page_out&page=k", None), ("POST", "/slots/0?action=page_drop&page=k", None),
    ("GET", "/lora-adapters", None), ("POST", "/lora-adapters", []),
    ("POST", "/lora-adapters/load", {"path": "extra.gguf"}), ("POST", "/lora-adapters/page_out", {"id": 1}),
    ("GET", "/metrics", None),
])
def test_every_native_route_but_health_needs_the_key(server, method, path, data):
    genes = server.ok("GET", "/lora-adapters")
    for headers in ({}, {"authorization": "Bearer wrong"}):
        assert_error(server.request(method, path, data, headers=headers), 401, kind="authentication_error")
    assert server.ok("GET", "/lora-adapters") == genes  # nothing changed


def test_bad_input_gets_llama_server_errors_and_the_daemon_keeps_serving(server):
    h = {**AUTH, "content-type": "application/json"}
    for path in ("/completion", "/tokenize", "/detokenize", "/apply-template", "/lora-adapters/load"):
        err = assert_error(server.post(path, content=b"{not json", headers=h), 400, kind="invalid_request_error")
        assert "malformed JSON" in err["message"]
    assert_error(server.post("/completion", content=b"[1, 2]", headers=h), 400, "InvalidParams")
    assert_error(server.post("/completion", {"prompt": "x", "n_predict": "many"}), 400, "InvalidParams")
    assert_error(server.post("/completion", {"prompt": "x", "n_predict": -2}), 400, "InvalidParams")
    assert_error(server.post("/completion", {"prompt": "x", "id_slot": 9}), 404, "SlotNotFound")
    big = server.post("/completion", content=b'{"prompt": "' + b"a" * (17 << 20) + b'"}', headers=h)
    assert_error(big, 413)
    err = assert_error(server.post("/completion", {"prompt": list(range(3, 4103)), "n_predict": 1}), 400,
                       kind="exceed_context_size_error")
    assert err["n_ctx"] == 4096 and err["n_prompt_tokens"] == 4100
    # found by the slot while the streamed response runs, before its first chunk: still a status
    full = [3 + i % 500 for i in range(4096)]
    err = assert_error(server.post("/completion", {"prompt": full, "n_predict": 1, "stream": True}), 400,
                       "PromptTooLong", "exceed_context_size_error")
    assert err["n_ctx"] == 4096 and err["n_prompt_tokens"] == 4096
    r = server.post("/completion", {"prompt": "x", "n_predict": 1}, headers={**AUTH, "x-actord-mind": "../etc"})
    assert_error(r, 400, "InvalidParams")
    assert server.proc.poll() is None
    assert server.ok("POST", "/completion", {"prompt": "still here", "n_predict": 2})["tokens_predicted"] == 2


def test_a_mind_header_places_the_completion_and_pages_it(server):
    first = server.ok("POST", "/completion", {"prompt": "a named mind", "n_predict": 2, "temperature": 0})
    assert first["generation_settings"]["mind"] is None
    r = server.post("/completion", {"prompt": "a named mind", "n_predict": 2, "temperature": 0},
                    headers={**AUTH, "x-actord-mind": "zed"})
    assert r.status_code == 200 and r.json()["generation_settings"]["mind"] == "zed"
    assert "zed" in {s["mind"] for s in server.ok("GET", "/slots")}
    assert_error(server.post("/completion", {"prompt": "x", "id_slot": 0, "n_predict": 1},
                             headers={**AUTH, "x-actord-mind": "zed"}), 400, "InvalidParams")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_cancels_its_generation_and_is_counted_once(server, stream):
    cancelled, gone = 'requests_total{outcome="cancelled"}', 'http_client_gone_total{phase="generation"}'
    before, gone_before = server.metric(cancelled), server.metric(gone)
    body = {"prompt": f"go on and on {stream}", "n_predict": 3800, "ignore_eos": True, "stream": stream}
    if stream:  # a few chunks arrive, then the client hangs up
        with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/completion", json=body,
                                                       headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(4))
    else:  # the request is in, its generation runs, and the client hangs up before the answer
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(payload)).encode()
                      + b"\r\n\r\n" + payload)
            wait_until(lambda: server.metric("requests_in_flight") >= 1, "the request is in flight")
    wait_until(lambda: server.metric(cancelled) > before, "the abandoned request counts as cancelled")
    wait_until(lambda: server.metric("requests_in_flight") == 0, "no request left in flight")
    assert server.metric(gone) == gone_before + 1


def test_the_text_verbs_record_their_inputs_so_a_trace_replays(tmp_path):
    """/tokenize, /detokenize, /apply-template and /props run engine jobs outside any
    completion: each records its input (the JSON-RPC verbs they call), so a daemon traced
    while serving them still replays."""
    import anyio
    import msgspec

    from actord.vocabulary.config import Config
    from actord.replay.replay import replay
    from actord.frontends.rpc.methods import METHODS
    from actord.service.system import ActorSystem

    model = str(write_tiny_llama(tmp_path / "replay-native.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE))
    events: list = []
    calls = [("tokenize", {"content": "hi \u00e1", "add_special": True, "with_pieces": True}),
             ("detokenize", {"tokens": [1, 300, 301]}), ("chat.template", {}),
             ("apply_template", {"messages": [{"role": "user", "content": "hello"}]})]

    async def run():
        async with ActorSystem(Config(model=model, slots=2, ctx=512, page_dir=str(tmp_path / "p")),
                               trace=events) as s:
            for name, params in calls:
                m = METHODS[name]
                await m.call(s, msgspec.convert(params, m.params), None)
            await s.complete(prompt=[1, 5, 9], n_predict=2, ignore_eos=True)

    anyio.run(run)
    assert [e.method for e in events if type(e).__name__ == "Input"] == [*(n for n, _ in calls), "completion"]
    r = anyio.run(replay, events, model)
    assert r.ok, r
