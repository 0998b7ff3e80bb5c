"""The CLI's client verbs come from the RPC method table: every method is a verb, a new
method is one the moment it exists, and every command line of the hand-written table they
replaced still makes the same call. No daemon: the verbs are parsed, not sent."""

from __future__ import annotations

import argparse
import io
import json

import msgspec
import pytest

from actord import cli
from actord.frontends.rpc.methods import METHODS, Method


def request(*argv: str) -> tuple[str, dict]:
    ap, _ = cli.build_parser()
    return cli.request_of(ap.parse_args(list(argv)))


def test_every_rpc_method_has_a_cli_verb_named_for_it():
    ap, _ = cli.build_parser()
    verbs = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(cli.verbs().values()) == set(METHODS)
    for method in METHODS:
        assert verbs[cli.verb_name(method)].get_default("rpc") == method, method
        assert METHODS[method].help, method  # the verb's help is the method's
    for verb, method in cli.verbs().items():  # the hand-written verbs and the aliases too
        assert verbs[verb].get_default("rpc") == method, verb


@pytest.mark.parametrize("argv, method, params", [
    (["slots"], "slot.list", {}),
    (["erase", "1"], "slot.erase", {"slot": 1}),
    (["props"], "props", {}),
    (["health"], "health", {}),
    (["page-out", "0", "ada"], "page.out", {"slot": 0, "page": "ada"}),
    (["page-in", "1", "ada"], "page.in", {"slot": 1, "page": "ada"}),
    (["page-drop", "ada"], "page.drop", {"page": "ada"}),
    (["pages"], "page.list", {}),
    (["spill", "ada", "ada.page", "--drop"], "page.spill", {"page": "ada", "file": "ada.page", "drop": True}),
    (["spill", "ada", "ada.page"], "page.spill", {"page": "ada", "file": "ada.page"}),  # the daemon's default
    (["save", "0", "s.bin"], "slot.save", {"slot": 0, "file": "s.bin"}),
    (["restore", "0", "s.bin"], "slot.restore", {"slot": 0, "file": "s.bin"}),
    (["gene-load", "a.gguf"], "gene.load", {"path": "a.gguf"}),
    (["gene-unload", "1"], "gene.unload", {"id": 1}),
    (["gene-page-out", "1"], "gene.page_out", {"id": 1}),
    (["gene-page-in", "1"], "gene.page_in", {"id": 1}),
    (["genes"], "gene.list", {}),
    (["complete", "Hello", "-n", "32", "--stream", "--mind", "ada", "--gene", "2:0.5"], "completion",
     {"prompt": "Hello", "n_predict": 32, "temperature": 0.0, "stream": True, "mind": "ada",
      "genes": [{"id": 2, "scale": 0.5}]}),
    (["completion", "Hi"], "completion", {"prompt": "Hi", "n_predict": 32, "temperature": 0.0, "stream": False}),
    (["call", "completion", '{"prompt": "Hi", "mind": "ada"}'], "completion", {"prompt": "Hi", "mind": "ada"}),
    # Verbs that exist because their methods do.
    (["metrics"], "metrics", {}),
    (["tokenize", "hi there", "--with-pieces"], "tokenize", {"content": "hi there", "with_pieces": True}),
    (["detokenize", "1", "2", "3"], "detokenize", {"tokens": [1, 2, 3]}),
    (["apply-template", '[{"role": "user", "content": "hi"}]', "--no-add-generation-prompt"], "apply_template",
     {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}),
    (["chat-template"], "chat.template", {}),
    (["page-spill", "ada", "f", "--no-drop"], "page.spill", {"page": "ada", "file": "f", "drop": False}),
])
def test_each_command_line_makes_the_call_it_made_before(argv, method, params):
    got = request(*argv)
    assert got == (method, params)
    msgspec.convert(got[1], METHODS[method].params)  # what the daemon decodes


def test_chat_reads_its_messages_from_stdin(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps([{"role": "user", "content": "hi"}])))
    assert request("chat", "-n", "4", "--mind", "ada") == (
        "chat", {"messages": [{"role": "user", "content": "hi"}], "n_predict": 4, "temperature": 0.0,
                 "stream": False, "mind": "ada"})


def test_a_bad_argument_is_a_usage_error_before_anything_is_sent(capsys):
    with pytest.raises(SystemExit) as e:
        request("erase", "x")
    assert e.value.code == 2 and "invalid int value" in capsys.readouterr().err
    assert cli.main(["--socket", "/nonexistent/actord.sock", "call", "health", "{not json"]) == 2


def test_a_new_method_is_a_verb_the_moment_it_exists(monkeypatch):
    class Params(msgspec.Struct, forbid_unknown_fields=True):
        mind: str
        depth: int = 2
        tags: list[str] = []

    monkeypatch.setitem(METHODS, "mind.probe", Method(Params, None, help="look at a mind"))  # type: ignore[arg-type]
    assert request("mind-probe", "ada") == ("mind.probe", {"mind": "ada"})
    assert request("mind-probe", "ada", "--depth", "5", "--tags", "a", "--tags", "b") == (
        "mind.probe", {"mind": "ada", "depth": 5, "tags": ["a", "b"]})
