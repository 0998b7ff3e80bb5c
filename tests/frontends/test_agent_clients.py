"""Agent CLIs against the HTTP front: Claude Code's and Codex CLI's recorded first requests
replayed, and each CLI run once for real where it is installed.

The recordings (tests/frontends/recorded/) are the bodies Claude Code 2.1.197 (`claude -p`,
ANTHROPIC_BASE_URL at a capture server) and Codex CLI 0.171.0 (`codex exec`, a custom
provider with wire_api=responses) sent, ids and the device digest zeroed, no key in them;
and each one's second request, after the capture server answered the first with a tool
call (scripts/capture_clients.py, which says how to record them again).
Each was a 400 before issue 35 (a system message inside `messages`, a property without a
type, a maxLength of 524,288; `include`, a `namespace` and a `web_search` tool); now each is a
200 whose lesser parts are named in `X-Actord-Degraded`. The daemon runs a tiny model with
the Hermes tool template and a context large enough for the recordings' ~62k and ~35k
tokens (the tiny vocab is about one token per byte); the replays run again on the same
model with Gemma 3's template, which refuses their system messages and same-role runs
unless they are folded. Its two layers attend through a
32-token sliding window (write_tiny_swa, --swa-full off), so a prompt's prefill is linear
in its length: the Claude Code replay prefills in ~13 s here where full attention took
~115 s. Its output projection is zero, so under the CLIs' temperature of 1 every token is
equally likely and a reply ends by itself (EOS) after ~512 tokens, as a CLI's turn must;
its `<tool_call>` marker is plain text (no control token), so no sampled reply is ever a
whole tool call that a CLI would run.

The CLIs are looked up in $ACTORD_AGENT_CLIS, then /tmp/clis/node_modules/.bin (where
`npm install --prefix /tmp/clis @anthropic-ai/claude-code @openai/codex` puts them), then
PATH; without node or the CLI the test skips, naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from actord.testing.models import GEMMA3_CHAT_TEMPLATE, HERMES_TOOL_TEMPLATE, write_tiny_swa
from tests.frontends.test_openai_http import KEY, _start, _stop

pytestmark = pytest.mark.slow  # real agent CLIs and their recorded requests against daemons

RECORDED = Path(__file__).parent / "recorded"
CLAUDE = RECORDED / "claude_code_2.1.197_first.json"
CODEX = RECORDED / "codex_0.171.0_first.json"
# Each CLI's second request, after the capture server's first answer called a tool: Claude
# Code's carries the tool_use and its tool_result; Codex's a reasoning item (the capture
# server's, not ours: dropped), the exec_command call and its output.
CLAUDE_2 = RECORDED / "claude_code_2.1.197_second.json"
CODEX_2 = RECORDED / "codex_0.171.0_second.json"
CTX = 262144


def recorded(path: Path) -> dict:
    return json.loads(path.read_text())


def _daemon(tmp_path_factory, template: str):
    model = write_tiny_swa(tmp_path_factory.mktemp("m") / "tiny-tools.gguf", seed=1, n_layer=2, window=32,
                           n_ctx_train=CTX, chat_template=template, output_gain=0.0)
    # Two slots. Each CLI's run names a mind of its own (Claude Code's metadata.user_id and
    # Codex's prompt_cache_key carry its session id), so it prefills whole, as a new
    # session would. Codex names no max_output_tokens, and a reply must end by EOS
    # (P(none in 16384 tokens) ~ e^-32).
    proc, _, url = _start(str(model), tmp_path_factory.mktemp("d"), "--api-key", KEY, "--ctx", str(CTX * 2),
                          "--batch", "2048", "--swa-full", "off", "--http-max-body-bytes", str(4 << 20),
                          "--http-default-max-tokens", "16384")
    try:
        yield url
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    yield from _daemon(tmp_path_factory, HERMES_TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def gemma_front(tmp_path_factory):
    """The same model with Gemma 3's template, which refuses a second system message and
    two messages of one role in a row (and knows no tools: actord's generic tool format)."""
    yield from _daemon(tmp_path_factory, GEMMA3_CHAT_TEMPLATE)


FRONTS = pytest.mark.parametrize("which", ["front", "gemma_front"])


def _events(text: str) -> list[dict]:
    out = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln.startswith("data: ")]
        if lines and lines[0] != "data: [DONE]":
            out.append(json.loads(lines[0][6:]))
    return out


@pytest.mark.timeout(900)
@FRONTS
def test_claude_codes_recorded_first_request_gets_a_whole_stream_and_names_what_it_relaxed(which, request):
    front = request.getfixturevalue(which)
    rec = recorded(CLAUDE)
    body = {**rec["body"], "max_tokens": 8}
    assert any(m["role"] == "system" for m in body["messages"])  # what used to be the first 400
    r = httpx.post(front + rec["path"], json=body, timeout=900,
                   headers={"x-api-key": KEY, "anthropic-version": rec["headers"]["anthropic-version"],
                            "anthropic-beta": rec["headers"]["anthropic-beta"]})
    assert r.status_code == 200, r.text[:500]
    kinds = [e["type"] for e in _events(r.text)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds and kinds.count("content_block_start") == kinds.count("content_block_stop")
    degraded = r.headers["x-actord-degraded"]
    assert "Workflow).script: maxLength 524288 dropped" in degraded
    assert "Workflow).args: no type, any JSON value" in degraded
    assert ("1 system message(s) merged into the first" in degraded) == (which == "gemma_front")


@pytest.mark.timeout(900)
@FRONTS
def test_codexs_recorded_first_request_is_answered_and_names_the_tools_it_dropped(which, request):
    front = request.getfixturevalue(which)
    rec = recorded(CODEX)
    body = {**rec["body"], "max_output_tokens": 8}
    assert body["include"] == ["reasoning.encrypted_content"]
    r = httpx.post(front + rec["path"], json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=900)
    assert r.status_code == 200, r.text[:500]
    events = _events(r.text)
    assert events[0]["type"] == "response.created"
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    assert last["response"]["output"] and last["response"]["usage"]["input_tokens"] > 10000
    degraded = r.headers["x-actord-degraded"]
    assert "namespace 'multi_agent_v1' flattened into its 5 tools" in degraded
    assert "hosted tool 'web_search' dropped" in degraded
    # Its two developer items (system, to Gemma's template) and two user items, merged for Gemma only.
    assert ("1 message(s) merged into the one before, of the same role" in degraded) == (which == "gemma_front")


@pytest.mark.timeout(900)
@FRONTS
def test_each_clis_recorded_second_request_with_its_tool_round_trip_is_answered(which, request):
    front = request.getfixturevalue(which)
    claude = recorded(CLAUDE_2)
    assert [m["role"] for m in claude["body"]["messages"]] == ["user", "system", "assistant", "user"]
    r = httpx.post(front + claude["path"], json={**claude["body"], "max_tokens": 8, "stream": False}, timeout=900,
                   headers={"x-api-key": KEY, "anthropic-version": claude["headers"]["anthropic-version"]})
    assert r.status_code == 200, r.text[:500]
    assert r.json()["type"] == "message" and r.json()["content"]
    assert r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"] > 10000
    codex = recorded(CODEX_2)
    assert [i.get("type") for i in codex["body"]["input"][-3:]] == ["reasoning", "function_call", "function_call_output"]
    r = httpx.post(front + codex["path"], json={**codex["body"], "max_output_tokens": 8, "stream": False},
                   headers={"authorization": f"Bearer {KEY}"}, timeout=900)
    assert r.status_code == 200, r.text[:500]
    assert r.json()["output"] and r.json()["status"] in ("completed", "incomplete")
    assert "input[4]: reasoning item dropped: its encrypted_content is not this server's" in \
        r.headers["x-actord-degraded"]


def _cli(name: str) -> str:
    if shutil.which("node") is None:
        pytest.skip("node is not installed (the agent CLIs are npm packages)")
    for d in (os.environ.get("ACTORD_AGENT_CLIS"), "/tmp/clis/node_modules/.bin"):
        if d and (Path(d) / name).exists():
            return str(Path(d) / name)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (npm install --prefix /tmp/clis @anthropic-ai/claude-code "
                    "@openai/codex, or set ACTORD_AGENT_CLIS to its folder)")
    return found


def _requests(url: str) -> float:
    """Every generation the daemon ran, whatever its outcome."""
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("requests_total{"))


@pytest.mark.timeout(900)
def test_claude_code_runs_one_task_against_the_daemon(front, tmp_path):
    claude = _cli("claude")
    (tmp_path / "home").mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "ANTHROPIC_BASE_URL": front, "ANTHROPIC_API_KEY": KEY,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    before = _requests(front)
    p = subprocess.run([claude, "-p", "Say hi", "--max-turns", "1"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    assert p.stdout.strip()  # the reply, printed
    assert _requests(front) > before


@pytest.mark.timeout(900)
def test_codex_cli_runs_one_task_against_the_daemon(front, tmp_path):
    codex = _cli("codex")
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(home / ".codex"), "ACTORD_TEST_KEY": KEY}
    provider = f'{{name="actord",base_url="{front}/v1",wire_api="responses",env_key="ACTORD_TEST_KEY"}}'
    before = _requests(front)
    p = subprocess.run([codex, "exec", "--skip-git-repo-check", "--sandbox", "read-only", "-m", "tiny",
                        "-c", "model_provider=actord", "-c", f"model_providers.actord={provider}", "Say hi"],
                       cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    assert _requests(front) > before
