"""The daemon as users run it: `actord serve` in its own process, clients over the socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actord.frontends.client import Client, RpcError
from actord.vocabulary.errors import InvalidParams, PromptTooLong, SlotNotFound
from actord.testing.daemon import wait_until_serving

PY = sys.executable


@pytest.fixture
def daemon(tiny_model, tmp_path):
    sock = tmp_path / "actord.sock"
    proc = subprocess.Popen(
        [PY, "-m", "actord.cli", "serve", "--model", tiny_model, "--slots", "2", "--ctx", "256",
         "--batch", "64", "--socket", str(sock), "--page-dir", str(tmp_path / "pages"), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        wait_until_serving(proc, sock, timeout_s=60, poll_s=0.1)
        yield sock, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _raw(sock: Path, lines: list[bytes]) -> list[dict]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(sock))
    f = s.makefile("rb")
    out = []
    for line in lines:
        s.sendall(line)
        out.append(json.loads(f.readline()))
    s.close()
    return out


def test_socket_is_owner_only(daemon):
    sock, _ = daemon
    mode = stat.S_IMODE(os.stat(sock).st_mode)
    assert stat.S_ISSOCK(os.stat(sock).st_mode) and mode == 0o600


def test_client_in_another_process_gets_a_completion(daemon):
    sock, _ = daemon
    code = (
        "from actord.frontends.client import Client; import json;"
        f"c=Client({str(sock)!r}); print(json.dumps(c.complete([1,5,9,13], n_predict=5, ignore_eos=True)))"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    r = json.loads(out.stdout)
    assert len(r["tokens"]) == 5 and r["n_prompt_tokens"] == 4 and r["n_prompt_processed"] == 4
    assert set(r) >= {"content", "tokens", "n_prompt_tokens", "n_prompt_processed", "n_cached", "timings"}


def test_bad_input_gets_typed_errors_and_peers_keep_being_served(daemon):
    sock, _ = daemon
    # A slow peer: a long completion runs on another connection the whole time.
    peer: dict = {}

    def slow():
        with Client(str(sock), timeout=60) as c:
            peer["r"] = c.complete([3, 4, 5], n_predict=120, ignore_eos=True, slot=1)

    t = threading.Thread(target=slow)
    t.start()
    replies = _raw(sock, [
        b"this is not json\n",
        b'{"jsonrpc":"2.0","id":1,"method":"no.such.method"}\n',
        b'{"jsonrpc":"2.0","id":2,"method":"completion","params":{"prompt":5}}\n',
        b'{"jsonrpc":"2.0","id":3,"method":"completion","params":{"prompt":[1,2],"slot":9}}\n',
        b'{"jsonrpc":"2.0","id":4,"method":"completion","params":{"prompt":' + json.dumps([7] * 400).encode() + b'}}\n',
        b'[1,2,3]\n',
        b'{"jsonrpc":"2.0","id":5,"method":"slot.erase","params":{"slot":"zero"}}\n',
        b'{"jsonrpc":"2.0","id":6,"method":"health"}\n',
    ])
    # `[1,2,3]` is a batch of three invalid requests: one array of three errors (JSON-RPC 2.0).
    batch = replies.pop(5)
    assert [b["error"]["code"] for b in batch] == [-32600] * 3 and all(b["id"] is None for b in batch)
    codes = [r.get("error", {}).get("code") for r in replies]
    types = [r.get("error", {}).get("data", {}).get("type") for r in replies]
    assert codes[:6] == [-32700, -32601, -32602, -32000, -32602, -32602]
    assert types[3] == "SlotNotFound" and types[4] == "PromptTooLong"
    assert replies[6]["result"]["status"] == "ok"
    t.join(60)
    assert len(peer["r"]["tokens"]) == 120

    with Client(str(sock)) as c:
        with pytest.raises(SlotNotFound):
            c.complete([1], slot=5)
        with pytest.raises(PromptTooLong):
            c.complete([1] * 300)
        with pytest.raises(InvalidParams):
            c.call("slot.erase", {"slot": 0, "extra": 1})
        with pytest.raises(RpcError):
            c.call("nope")


def test_streaming_notifications_then_the_result(daemon):
    sock, _ = daemon
    chunks: list[dict] = []
    with Client(str(sock)) as c:
        r = c.call("completion", {"prompt": "hi", "n_predict": 8, "stream": True, "ignore_eos": True},
                   on_chunk=chunks.append)
    assert chunks and "".join(ch["content"] for ch in chunks) == r["content"]


def test_props_metrics_and_slot_list(daemon):
    sock, _ = daemon
    with Client(str(sock)) as c:
        props = c.call("props")
        assert props["slot_page_version"] == 1 and props["lora_page_version"] == 1
        c.complete([1, 2, 3], n_predict=2, slot=0, ignore_eos=True)
        slots = c.call("slot.list")
        assert [s["id"] for s in slots] == [0, 1] and slots[0]["n_tokens"] == 4
        text = c.call("metrics")["text"]
        assert "predicted_tokens_total" in text and "page_store_bytes" in text
        assert c.call("slot.erase", {"slot": 0})["erased"] is True


def test_sigterm_shuts_down_cleanly_and_removes_the_socket(daemon):
    sock, proc = daemon
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not sock.exists()


@pytest.mark.slow
def test_cli_verbs_reach_the_daemon(daemon):
    sock, _ = daemon

    def cli(*args):
        out = subprocess.run([PY, "-m", "actord.cli", "--socket", str(sock), *args],
                             capture_output=True, text=True, timeout=60)
        return out.returncode, out.stdout, out.stderr

    rc, out, _ = cli("call", "completion", '{"prompt": [1, 2, 3], "n_predict": 3, "slot": 0, "ignore_eos": true}')
    assert rc == 0 and json.loads(out)["n_prompt_tokens"] == 3
    assert cli("page-out", "0", "m")[0] == 0
    assert [p["page"] for p in json.loads(cli("pages")[1])] == ["m"]
    assert cli("page-in", "1", "m")[0] == 0
    rc, _, err = cli("page-in", "0", "nope")
    assert rc == 1 and json.loads(err)["error"]["type"] == "PageNotFound"
    assert json.loads(cli("props")[1])["slot_page_version"] == 1
    assert cli("genes")[0] == 0
    # Verbs generated from the method table, for methods the old hand-written table lacked.
    rc, out, _ = cli("tokenize", "hello")
    tokens = json.loads(out)["tokens"]
    assert rc == 0 and tokens
    rc, out, _ = cli("detokenize", *map(str, tokens))
    assert rc == 0 and "hello" in json.loads(out)["content"]
    assert "predicted_tokens_total" in cli("metrics")[1]
