"""The HTTP front's pure parts: OpenAI field handling, mind names, error mapping, and the
TCP peer lookup the front's peer check stands on."""

from __future__ import annotations

import os
import socket

import msgspec
import pytest

from actord.vocabulary.errors import InvalidParams, PromptTooLong
from actord.frontends.http.openai import answers as A
from actord.frontends.http.openai import wire as O
from actord.frontends.http.turns import mind_for
from actord.frontends.rpc.peers import PeerPolicy, check_tcp_peers, tcp_peer
from actord.vocabulary.names import check_part


def _chat(**body) -> O.ChatCompletionRequest:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return msgspec.convert(body, O.ChatCompletionRequest)


def _text(**body) -> O.TextCompletionRequest:
    body.setdefault("prompt", "hi")
    return msgspec.convert(body, O.TextCompletionRequest)


@pytest.mark.parametrize("value", ["ada", "a b:c/d", "../../etc/passwd", "", "x" * 5000, "日本語", "\x00\n"])
def test_user_with_spaces_maps_to_a_stable_mind(value):
    name = mind_for("u", value)
    assert name == mind_for("u", value)  # stable
    assert check_part(name) is None  # one confined page-name component, whatever the input
    assert name.startswith("u-") and len(name) == 34
    assert mind_for("k", value) != name  # a cache key and an end-user id never share a mind


def test_distinct_users_get_distinct_minds():
    names = {mind_for("u", f"user {i}") for i in range(1000)}
    assert len(names) == 1000


REFUSED_CHAT = [
    ("modalities", ["text", "audio"]), ("audio", {"voice": "x"}), ("reasoning_effort", 3), ("verbosity", ["low"]),
    ("web_search_options", "on"), ("n_probs", 2), ("max_tokens", 0), ("max_completion_tokens", 0), ("max_tokens", -3),
]


@pytest.mark.parametrize("field,value", REFUSED_CHAT)
def test_a_refused_chat_field_is_named(field, value):
    with pytest.raises(InvalidParams) as e:
        O.refuse_unsupported(_chat(**{field: value}))
    assert e.value.data["param"] == field and field in e.value.message


@pytest.mark.parametrize("field,value", [("echo", True), ("suffix", "x"), ("best_of", 3),
                                         ("max_tokens", 0)])
def test_a_refused_completion_field_is_named(field, value):
    with pytest.raises(InvalidParams) as e:
        O.refuse_unsupported(_text(**{field: value}))
    assert e.value.data["param"] == field


@pytest.mark.parametrize("body", [
    {}, {"n": 1}, {"logprobs": False}, {"top_logprobs": 0}, {"presence_penalty": 0}, {"logit_bias": {}},
    {"response_format": {"type": "text"}}, {"tools": []}, {"repeat_penalty": 1.0}, {"modalities": ["text"]},
    {"store": True, "metadata": {"a": "b"}, "service_tier": "auto", "parallel_tool_calls": False,
     "prediction": {"type": "content", "content": "x"}, "some_future_field": 1},
])
def test_fields_that_ask_for_nothing_or_change_nothing_pass(body):
    assert O.choices(_chat(**body), 8) == 1
    O.refuse_unsupported(_chat(**body))
    f = O.sampling(_chat(**body), 512)
    assert f["grammar"] == "" and f["logit_bias"] == {} and not f["logprobs"]


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: refused, not ignored
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repeat_penalty": 0}, "repeat_penalty"), ({"repeat_last_n": -2}, "repeat_last_n"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"512": 5}}, "logit_bias"), ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": [[5, 1]]}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "minItems": 10**9}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
    ({"json_schema": {"$ref": "#/nowhere"}}, "json_schema"), ({"grammar": 5}, "grammar"),
])
def test_a_sampling_field_out_of_range_is_a_400_naming_it(body, param):
    with pytest.raises(InvalidParams) as e:
        O.sampling(_chat(**body), 512)
    assert e.value.data["param"] == param


def test_sampling_fields_map_onto_the_completion_request():
    from actord.vocabulary.types import CompletionRequest
    from actord.engine.grammar import JSON_OBJECT_GBNF

    f = O.sampling(_chat(logprobs=True, top_logprobs=3, logit_bias={"42": -100, "7": 2.5}, presence_penalty=0.5,
                         frequency_penalty=-0.5, repeat_penalty=1.1, repeat_last_n=32, min_p=0.05,
                         response_format={"type": "json_object"}), 512)
    assert f == {"grammar": JSON_OBJECT_GBNF, "logit_bias": {"42": -100.0, "7": 2.5}, "presence_penalty": 0.5,
                 "frequency_penalty": -0.5, "repeat_penalty": 1.1, "repeat_last_n": 32, "min_p": 0.05,
                 "logprobs": True, "top_logprobs": 3, "cache_salt": None}
    req = CompletionRequest(prompt=[1], **f).check()
    assert req.bias_pairs() == ((7, 2.5), (42, float("-inf")))  # -100 bans
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    g = O.sampling(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                             "strict": True}}), 512)["grammar"]
    assert "root ::=" in g and '"\\"ok\\""' in g
    assert O.sampling(_chat(json_schema=schema), 512)["grammar"] == g  # llama-server's field, same grammar
    # Legacy completions: logprobs is how many alternatives, 0 included.
    assert O.sampling(_text(logprobs=0), 512)["logprobs"] is True
    assert O.sampling(_text(logprobs=4), 512)["top_logprobs"] == 4
    assert O.sampling(_text(), 512)["logprobs"] is False


def test_logprobs_take_openai_shapes_in_answers_and_chunks():
    from actord.vocabulary.types import CompletionResult, Timings, TokenLogprob, TopLogprob

    lps = [TokenLogprob(token=5, text="he", bytes=[104, 101], logprob=-0.5,
                        top=[TopLogprob(token=5, text="he", bytes=[104, 101], logprob=-0.5),
                             TopLogprob(token=9, text="x", bytes=[120], logprob=-1.5)]),
           TokenLogprob(token=6, text="llo", bytes=[108, 108, 111], logprob=-0.25)]
    r = CompletionResult(content="hello", tokens=[5, 6], n_prompt_tokens=3, n_prompt_processed=3, n_cached=0,
                         slot=0, stop_reason="length", timings=Timings(0, 0, 0, 0), logprobs=lps)
    chat = A.chat_completion("id", "m", r, 0, "fp", logprobs=True)["choices"][0]["logprobs"]
    assert chat["content"][0] == {"token": "he", "logprob": -0.5, "bytes": [104, 101], "top_logprobs": [
        {"token": "he", "logprob": -0.5, "bytes": [104, 101]}, {"token": "x", "logprob": -1.5, "bytes": [120]}]}
    assert A.chat_completion("id", "m", r, 0, "fp")["choices"][0]["logprobs"] is None
    text = A.text_completion("id", "m", r, 0, "fp", logprobs=True)["choices"][0]["logprobs"]
    assert text == {"tokens": ["he", "llo"], "token_logprobs": [-0.5, -0.25],
                    "top_logprobs": [{"he": -0.5, "x": -1.5}, {}], "text_offset": [0, 2]}
    chunks = A.Chunks(False, "m", logprobs=True)
    first, second = chunks.delta("he", lps[:1]), chunks.delta("llo", lps[1:])
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]  # offsets run on across chunks
    assert first["choices"][0]["logprobs"]["tokens"] == ["he"]
    c = A.Chunks(True, "m", logprobs=True).delta("he", lps[:1])
    assert c["choices"][0]["logprobs"]["content"][0]["token"] == "he"
    assert "logprobs" not in A.Chunks(True, "m").delta("he")["choices"][0]


def test_a_list_of_prompts_is_several_and_a_flat_list_of_ints_is_one():
    assert O.text_prompts("a") == ["a"]
    assert O.text_prompts([5, 6]) == [[5, 6]]
    assert O.text_prompts(["a"]) == ["a"]
    assert O.text_prompts([[5, 6]]) == [[5, 6]]
    assert O.text_prompts(["a", [5], "b"]) == ["a", [5], "b"]
    for bad in ([{"x": 1}], ["a", 5], [[5, True]], [["a"]]):
        with pytest.raises(InvalidParams) as e:
            O.text_prompts(bad)
        assert e.value.data["param"] == "prompt"


def test_several_prompts_usage_sums_each_prompts_own():
    from actord.vocabulary.types import CompletionResult, Timings

    def r(n_prompt: int, n_out: int, cached: int = 0) -> CompletionResult:
        return CompletionResult(content="x", tokens=[1] * n_out, n_prompt_tokens=n_prompt, n_prompt_processed=n_prompt,
                                n_cached=cached, slot=0, stop_reason="length", timings=Timings(0.0, 0.0, 0.0, 0.0))

    u = A.usage([[r(5, 2, 1), r(5, 3)], [r(7, 4, 2), r(7, 1)]])  # each prompt's n=2 choices
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (12, 10, 22)
    assert u["prompt_tokens_details"]["cached_tokens"] == 3
    body = A.text_completion("id", "m", [[r(5, 2), r(5, 3)], [r(7, 4), r(7, 1)]], 0, "")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]


def test_text_parts_join_with_a_newline_and_other_parts_are_refused_by_index():
    msgs = [O.Message(role="user", content=[O.ContentPart(type="text", text="a"), O.ContentPart(type="text", text="b")])]
    assert O.chat_messages(msgs)[0].content == "a\nb"
    bad = [O.Message(role="user", content=[O.ContentPart(type="text", text="a"), O.ContentPart(type="image_url")])]
    with pytest.raises(InvalidParams) as e:
        O.chat_messages(bad)
    assert e.value.data["param"] == "messages[0].content[1].type"


def test_developer_is_system_unless_the_template_names_it():
    import anyio

    from actord.frontends.http.turns import roles_for

    class Front:
        def __init__(self, names: bool) -> None:
            self.names = names

        async def template_names_developer(self) -> bool:
            return self.names

    msgs = O.chat_messages([O.Message(role="developer", content="be brief"), O.Message(role="user", content="hi")])
    assert [m.role for m in msgs] == ["developer", "user"]  # as sent, until fitted to the template
    assert [m.role for m in anyio.run(roles_for, Front(False), msgs)] == ["system", "user"]
    assert anyio.run(roles_for, Front(True), msgs) is msgs


def test_a_tool_result_without_its_call_id_is_refused_naming_the_message():
    with pytest.raises(InvalidParams) as e:
        O.chat_messages([O.Message(role="user", content="x"), O.Message(role="tool", content="42")])
    assert e.value.data["param"] == "messages[1].tool_call_id"


def test_a_tool_history_maps_onto_chat_messages():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    out = O.chat_messages([O.Message(role="user", content="x"), O.Message(role="assistant", tool_calls=calls),
                           O.Message(role="tool", content="42", tool_call_id="call_1"),
                           O.Message(role="assistant", function_call={"name": "g", "arguments": "{}"}),
                           O.Message(role="function", name="g", content="ok")])
    assert out[1].content == "" and [(c.id, c.name, c.arguments) for c in out[1].tool_calls] == [("call_1", "f", '{"a": 1}')]
    assert (out[2].role, out[2].tool_call_id, out[2].content) == ("tool", "call_1", "42")
    assert out[3].tool_calls[0].name == "g" and (out[4].role, out[4].name) == ("tool", "g")


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, "functions"),
    ({"functions": [{"name": "f"}], "function_call": "always"}, "function_call"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": 1}, "parallel_tool_calls"),
])
def test_a_bad_tool_field_is_refused_naming_it(body, param):
    with pytest.raises(InvalidParams) as e:
        O.chat_tools(_chat(**body))
    assert e.value.data["param"] == param


def test_legacy_functions_become_one_tool_call_at_most():
    f = O.chat_tools(_chat(functions=[{"name": "f", "parameters": {"type": "object"}}], function_call={"name": "f"}))
    assert [t.name for t in f["tools"]] == ["f"] and f["parallel_tool_calls"] is False
    assert f["tool_choice"] == {"type": "function", "function": {"name": "f"}}


def test_context_overflow_maps_to_400_context_length_exceeded():
    from actord.frontends.http.responses import status_of

    e = PromptTooLong("prompt of 5000 tokens does not fit n_ctx 4096", n_prompt_tokens=5000, n_ctx=4096)
    assert status_of(e) == 400 and O.error_code(e) == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in O.error_message(e)
    assert O.error_body(400, O.error_message(e), O.error_code(e))["error"]["type"] == "invalid_request_error"


def _pair(family: int = socket.AF_INET, host: str = "127.0.0.1"):
    lst = socket.socket(family)
    lst.bind((host, 0))
    lst.listen(4)
    cli = socket.socket(family)
    cli.connect(lst.getsockname())
    conn, _ = lst.accept()
    return lst, cli, conn


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_a_loopback_tcp_peer_is_this_uid(family, host):
    try:
        lst, cli, conn = _pair(family, host)
    except OSError as e:
        pytest.skip(f"no {host}: {e}")
    with lst, cli, conn:
        peer = tcp_peer(conn.getsockname(), conn.getpeername())
        assert peer is not None and peer.uid == os.geteuid()
        assert PeerPolicy().allows(peer)
    assert check_tcp_peers(host) is None


def test_a_closed_client_socket_proves_nothing():
    lst, cli, conn = _pair()
    with lst, conn:
        cli.close()  # its end is now an orphan (or a TIME_WAIT stub the kernel reports as uid 0)
        assert tcp_peer(conn.getsockname(), conn.getpeername()) is None


def test_another_uids_tcp_socket_is_that_uid():
    if os.geteuid() != 0:
        pytest.skip("needs root to open a socket as another uid")
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, connect, wait for the parent's verdict
        try:
            os.setgid(65534)
            os.setuid(65534)
            c = socket.socket()
            c.connect(lst.getsockname())
            os.write(w, b"x")
            c.recv(1)
        finally:
            os._exit(0)
    try:
        os.read(r, 1)
        conn, _ = lst.accept()
        with conn:
            peer = tcp_peer(conn.getsockname(), conn.getpeername())
            assert peer is not None and peer.uid == 65534
            assert not PeerPolicy().allows(peer)
            assert PeerPolicy(allow_uid=frozenset({65534})).allows(peer)
    finally:
        os.waitpid(pid, 0)
        lst.close()
        os.close(r)
        os.close(w)


def test_a_front_without_key_refuses_to_start_where_peers_cannot_be_told(monkeypatch, tmp_path):
    from actord.vocabulary.config import Config
    from actord.frontends.http import app

    monkeypatch.setattr(app, "check_tcp_peers", lambda host: "this platform cannot tell (test)")
    front = app.HttpFront(None, Config(model=str(tmp_path / "m.gguf"), http="127.0.0.1:0"))
    with pytest.raises(InvalidParams, match="set --api-key"):
        front.bind()
    keyed = app.HttpFront(None, Config(model=str(tmp_path / "m.gguf"), http="127.0.0.1:0", api_key="k"))
    keyed.bind().close()  # with a key the key is the gate: no peer lookup needed


# -- llama-server's sampling fields on the native /completion (native_sampling) ----------------


def test_completion_probabilities_cut_a_partial_utf8_character_as_llama_server_does():
    from actord.vocabulary.types import TokenLogprob, TopLogprob
    from actord.frontends.http.native.sampling import probabilities

    a_acute = list("á".encode())
    lps = [TokenLogprob(token=7, text="\ufffd", bytes=a_acute[:1], logprob=-0.5,
                        top=[TopLogprob(token=7, text="\ufffd", bytes=a_acute[:1], logprob=-0.5),
                             TopLogprob(token=9, text="á", bytes=a_acute, logprob=float("-inf"))])]
    [p] = probabilities(lps)
    assert p == {"id": 7, "token": "", "bytes": a_acute[:1], "logprob": -0.5, "top_logprobs": [
        {"id": 7, "token": "", "bytes": a_acute[:1], "logprob": -0.5},
        {"id": 9, "token": "á", "bytes": a_acute, "logprob": -3.4028234663852886e38}]}  # p = 0: float's lowest


def test_logit_bias_takes_llama_servers_shapes_sums_repeats_and_refuses_the_rest():
    import anyio

    from actord.frontends.http.native.sampling import _logit_bias

    async def tokenize(text: str) -> list[int]:
        return [ord(c) for c in text]

    def bias(v):
        return anyio.run(_logit_bias, v, 512, tokenize)

    assert bias([[5, 1.0], ["ab", -2], [5, False]]) == [(5, float("-inf")), (97, -2.0), (98, -2.0)]
    assert bias({"5": 1, "aa": 0.5, "-0": 2}) == [(0, 2.0), (5, 1.0), (97, 1.0)]
    assert bias([]) == bias({}) == bias(None) == []
    for bad in ([[1]], [[512, 1]], {"-3": 1}, [[True, 1]], [[5, True]], [[5, None]], [[5, 1e400]], 5, "x",
                [["a" * 70000, 1]]):
        with pytest.raises(InvalidParams) as e:
            bias(bad)
        assert e.value.data["param"] == "logit_bias", bad


@pytest.mark.parametrize("n,ok", [(None, 1), (1, 1), (3, 3), (8, 8), (9, None), (0, None), (-1, None), (True, None),
                                  (2.0, None), ("2", None)])
def test_n_is_one_to_the_bound_else_a_400_naming_it(n, ok):
    for req in (_chat(n=n), _text(n=n)):
        O.refuse_unsupported(req)  # n is no refused field: its bound is the daemon's
        if ok is not None:
            assert O.choices(req, 8) == ok
        else:
            with pytest.raises(InvalidParams) as e:
                O.choices(req, 8)
            assert e.value.data["param"] == "n" and "n must be" in e.value.message


def _result(text: str, stop: str, n_out: int, cached: int = 0):
    from actord.vocabulary.types import CompletionResult, Timings

    return CompletionResult(content=text, tokens=list(range(n_out)), n_prompt_tokens=10, n_prompt_processed=1,
                            n_cached=cached, slot=0, stop_reason=stop,
                            timings=Timings(prompt_ms=0, predicted_ms=0, prompt_per_second=0, predicted_per_second=0))


def test_n_results_make_one_answer_by_index_with_the_prompt_counted_once():
    rs = [_result("a", "eos", 3, cached=9), _result("bb", "length", 5), _result("c", "stop", 1)]
    chat = A.chat_completion("id", "m", rs, 0, "fp")
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in chat["choices"]] == ["a", "bb", "c"]
    assert [c["finish_reason"] for c in chat["choices"]] == ["stop", "length", "stop"]
    assert chat["usage"] == {"prompt_tokens": 10, "completion_tokens": 9, "total_tokens": 19,
                             "prompt_tokens_details": {"cached_tokens": 9}}
    text = A.text_completion("id", "m", rs, 0, "fp")
    assert [(c["index"], c["text"]) for c in text["choices"]] == [(0, "a"), (1, "bb"), (2, "c")]
    assert text["usage"] == chat["usage"]
    assert A.chat_completion("id", "m", rs[0], 0, "fp")["usage"]["completion_tokens"] == 3


def test_n_streamed_chunks_carry_their_choice_index_and_keep_offsets_apart():
    from actord.vocabulary.types import TokenLogprob

    c = A.Chunks(True, "m", n=3)
    assert [f["choices"][0]["index"] for f in c.firsts()] == [0, 1, 2]
    assert c.delta("x", index=2)["choices"][0]["index"] == 2
    rs = [_result("a", "eos", 1), _result("b", "length", 1), _result("c", "eos", 1)]
    assert [(x["choices"][0]["index"], x["choices"][0]["finish_reason"]) for x in c.lasts(rs)] == \
        [(0, "stop"), (1, "length"), (2, "stop")]
    assert c.usage(rs)["usage"]["completion_tokens"] == 3 and c.usage(rs)["choices"] == []
    t = A.Chunks(False, "m", logprobs=True, n=2)
    lp = [TokenLogprob(token=5, text="ab", bytes=[97, 98], logprob=-1.0)]
    assert t.delta("ab", lp, index=1)["choices"][0]["logprobs"]["text_offset"] == [0]
    assert t.delta("ab", lp, index=1)["choices"][0]["logprobs"]["text_offset"] == [2]
    assert t.delta("ab", lp, index=0)["choices"][0]["logprobs"]["text_offset"] == [0]
