"""`actord cluster up|status|down`, and a plain daemon client and an HTTP client reaching the
cluster's router."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.cluster.clusters import NO_RAY

pytest.importorskip("ray", reason=NO_RAY)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


def actord(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actord.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_up_status_a_client_and_down(tmp_path, tiny_model):
    root = str(tmp_path / "c")
    up = actord("cluster", "up", "--root", root, "--nodes", "2", "--model", tiny_model, "--slots", "1",
                "--ctx", "512", "--batch", "64", "--threads", "1", "--http", "127.0.0.1:0", "--api-key", "k")
    assert up.returncode == 0, up.stderr + (tmp_path / "c" / "keeper.log").read_text()
    try:
        state = json.loads(up.stdout)
        assert state["nodes"] == ["n1", "n2"]
        again = actord("cluster", "up", "--root", root, "--model", tiny_model)
        assert again.returncode == 2 and "already up" in again.stderr
        # The daemon's own client verbs, pointed at the router's socket.
        out = actord("--socket", state["socket"], "call", "completion",
                     json.dumps({"prompt": [1, 2, 3], "n_predict": 3, "mind": "cli-mind", "ignore_eos": True}))
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["tokens"]) == 3
        for n in (1, 2):  # the same text twice: the second turn finds the first's prefix on its node
            streamed = actord("--socket", state["socket"], "complete", "hello there", "-n", "4", "--mind", "cli-text",
                              "--stream")
            assert streamed.returncode == 0, streamed.stderr
        assert json.loads(streamed.stdout.split("\n", 1)[1])["n_cached"] > 0  # the text, then the answer
        # The OpenAI front the router serves (--http, --api-key), as `serve`'s.
        r = httpx.post(f"http://{state['http']}/v1/completions", headers={"authorization": "Bearer k"}, timeout=120,
                       json={"prompt": "hello there", "max_tokens": 3, "user": "cli-http"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert httpx.get(f"http://{state['http']}/v1/models", timeout=60).status_code == 401  # the key
        st = actord("cluster", "status", "--root", root)
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert set(status["nodes"]) == {"n1", "n2"} and "cli-mind" in status["minds"]
    finally:
        down = actord("cluster", "down", "--root", root)
    assert down.returncode == 0, down.stderr
    assert actord("cluster", "status", "--root", root).returncode == 2  # nothing there any more
