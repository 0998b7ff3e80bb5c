"""actord's stand-in for llama.cpp's server-test utils: the same names the unchanged unit
tests use, but every server is `actord serve --http` on the registry's Gemma 3 270M (the
tests' tiny models are not here). Written for actord; presets for models actord does not
claim (embeddings, rerank, infill, multimodal, router) skip their test."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, List, Literal, Optional, Set, Tuple  # noqa: F401

import pytest
import requests

ACTORD = os.environ["ACTORD"]  # the checkout under test (scripts/peer/run.sh sets it)
TMP_DIR = os.environ["PEER_TMP"]
PY = os.path.join(ACTORD, ".venv/bin/python")
DEFAULT_REQUEST_TIMEOUT = 600


def _gemma() -> str:
    sys.path.insert(0, ACTORD)
    from actord.testing.models import gemma3_270m_path
    return str(gemma3_270m_path())


class ServerResponse:
    headers: dict
    status_code: int
    body: Any


class ServerError(Exception):
    def __init__(self, code: int, body: Any) -> None:
        super().__init__(f"{code}: {body}")
        self.code, self.body = code, body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


server_instances: Set["ServerProcess"] = set()


class ServerProcess:
    def __init__(self) -> None:
        self.server_host = "127.0.0.1"
        self.server_port = _free_port()
        self.unclaimed: str | None = None
        for k in ("model_alias", "n_ctx", "n_slots", "n_batch", "n_predict", "api_key", "chat_template",
                  "chat_template_file", "reasoning", "reasoning_format", "cors_origins", "slot_save_path",
                  "lora_files", "model_tags", "debug", "jinja", "enable_ctx_shift", "temperature",
                  "server_embeddings", "server_reranking", "model_draft", "mmproj_url", "models_dir"):
            setattr(self, k, None)
        self.seed = 42
        self.process: subprocess.Popen | None = None

    def start(self, timeout_seconds: int = 90) -> None:
        g = lambda k, d=None: getattr(self, k, d)  # noqa: E731
        if (self.unclaimed or self.server_embeddings or self.server_reranking or self.model_draft or self.models_dir
                or g("ui_mcp_proxy") or g("server_tools") or g("mcp_servers_config") or g("mcp_servers_json")):
            pytest.skip(f"not claimed: {self.unclaimed or 'embeddings/rerank/draft/router/mcp/tools'}")
        if g("log_path"):  # the test reads llama-server's own log lines (its __TEST_TAG_...__ markers)
            pytest.skip("not claimed: llama-server's log lines")
        if g("model_hf_repo") or g("model_url"):
            pytest.skip("no network: downloads are not claimed")
        os.makedirs(TMP_DIR, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="peer-", dir=TMP_DIR)
        hosts = [h.strip() for h in self.server_host.split(",")]
        http = ",".join(f"[{h}]:{self.server_port}" if ":" in h else f"{h}:{self.server_port}" for h in hosts)
        args = [PY, "-m", "actord.cli", "serve", "--model", _gemma(), "--http", http,
                "--socket", f"{self._dir}/a.sock",
                "--page-dir", self.slot_save_path or f"{self._dir}/pages", "--log-level", "warning",
                "--seed", str(self.seed)]
        # llama-server's --kv-unified: every slot may use the whole pool (actord's shared cache
        # without --ctx-per-slot); otherwise each slot is held to n_ctx / n_slots, as llama-server's.
        args.append("--no-ctx-per-slot" if g("kv_unified") else "--ctx-per-slot")
        for flag, v in (("--ctx", self.n_ctx), ("--slots", self.n_slots), ("--batch", self.n_batch),
                        ("--http-default-max-tokens", self.n_predict if self.n_predict and self.n_predict > 0 else None),
                        ("--api-key", self.api_key), ("--chat-template", self.chat_template),
                        ("--reasoning", self.reasoning), ("--reasoning-format", self.reasoning_format),
                        ("--model-alias", self.model_alias), ("--model-tags", g("model_tags")),
                        ("--sleep-idle-s", g("sleep_idle_seconds"))):
            if v is not None:
                args += [flag, str(v)]
        # llama-server's defaults: /metrics and /slots off unless asked for, the web UI on
        args += ["--http-metrics" if g("server_metrics") else "--no-http-metrics",
                 "--http-slots" if g("server_slots") else "--no-http-slots"]
        if g("no_ui"):
            args.append("--no-http-ui")
        if g("debug"):
            args.append("--http-verbose")
        if g("enable_ctx_shift"):
            args.append("--context-shift")
        if self.chat_template_file:
            args += ["--chat-template-file", os.path.abspath(self.chat_template_file)]
        elif self.chat_template is None:
            args += ["--chat-template", "chatml"]  # llama-server's fallback for a model without one
        for o in (self.cors_origins or "").split(","):
            if o.strip():
                args += ["--cors-origin", o.strip()]
        for f in self.lora_files or []:
            args += ["--gene", f]
        env = {**os.environ, "PYTHONPATH": ACTORD}
        if g("gcp_compat"):
            env["AIP_MODE"], env["AIP_HTTP_PORT"] = "PREDICTION", str(self.server_port)
        self._log = open(f"{self._dir}/log", "w")
        self.process = subprocess.Popen(args, cwd=ACTORD, stdout=self._log, stderr=self._log,
                                        env=env)
        server_instances.add(self)
        end = time.time() + timeout_seconds
        while time.time() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"actord exited {self.process.returncode}: {open(self._dir + '/log').read()[-2000:]}")
            try:
                if requests.get(self.make_url("/health"), timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise TimeoutError("actord did not start")

    def stop(self) -> None:
        server_instances.discard(self)
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def make_url(self, path: str, host: str | None = None) -> str:
        h = host or self.server_host.split(",")[0]
        return f"http://[{h}]:{self.server_port}{path}" if ":" in h and not h.startswith("[") \
            else f"http://{h}:{self.server_port}{path}"

    def make_request(self, method: str, path: str, data: Any = None, headers: dict | None = None,
                     timeout: float | None = DEFAULT_REQUEST_TIMEOUT, host: str | None = None) -> ServerResponse:
        r = requests.request(method, self.make_url(path, host), headers=headers,
                             json=data if method == "POST" else None, timeout=timeout)
        out = ServerResponse()
        out.headers, out.status_code = dict(r.headers), r.status_code
        if method == "OPTIONS":
            out.body = None
        else:
            try:
                out.body = r.json()
            except ValueError:
                out.body = r.text
        return out

    def make_stream_request(self, method: str, path: str, data: dict | None = None, headers: dict | None = None,
                            host: str | None = None) -> Iterator[dict]:
        r = requests.post(self.make_url(path, host), headers=headers, json=data, stream=True)
        if r.status_code != 200:
            raise ServerError(r.status_code, r.json())
        for raw in r.iter_lines():
            line = raw.decode()
            if "[DONE]" in line:
                break
            if line.startswith("data: "):
                yield json.loads(line[6:])

    def make_any_request(self, method: str, path: str, data: dict | None = None, headers: dict | None = None,
                         timeout: float | None = DEFAULT_REQUEST_TIMEOUT) -> dict:
        data = data or {}
        if not data.get("stream"):
            r = self.make_request(method, path, data, headers, timeout=timeout)
            assert r.status_code == 200, f"Server returned error: {r.status_code}"
            return r.body
        content: list[str] = []
        thought: list[str] = []
        calls: list[dict] = []
        finish = None
        for chunk in self.make_stream_request(method, path, data, headers):
            if not chunk["choices"]:
                assert "usage" in chunk and "timings" in chunk
                continue
            choice = chunk["choices"][0]
            d = choice["delta"]
            if d.get("content") is not None:
                assert d["content"], "empty content delta"
                content.append(d["content"])
            if d.get("reasoning_content") is not None:
                thought.append(d["reasoning_content"])
            finish = choice.get("finish_reason") or finish
            for tc in d.get("tool_calls", []):
                while tc["index"] >= len(calls):
                    calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                c = calls[tc["index"]]
                c["id"] = tc.get("id") or c["id"]
                c["function"]["name"] += tc["function"].get("name") or ""
                c["function"]["arguments"] += tc["function"].get("arguments") or ""
        return {"choices": [{"index": 0, "finish_reason": finish, "message": {
            "role": "assistant", "content": "".join(content) if content else None,
            "reasoning_content": "".join(thought) if thought else None, "tool_calls": calls or None}}]}


class ServerPreset:
    @staticmethod
    def load_all() -> None:
        pass

    @staticmethod
    def _base(alias: str, n_ctx: int, n_batch: int, n_slots: int, n_predict: int | None = None,
              unclaimed: str | None = None) -> ServerProcess:
        s = ServerProcess()
        s.model_alias, s.n_ctx, s.n_batch, s.n_slots, s.n_predict, s.unclaimed = (
            alias, n_ctx, n_batch, n_slots, n_predict, unclaimed)
        return s

    tinyllama2 = staticmethod(lambda: ServerPreset._base("tinyllama-2", 512, 32, 2, 64))
    stories15m_moe = staticmethod(lambda: ServerPreset._base("stories15m-moe", 2048, 1024, 1, 64))
    tinyllama_infill = staticmethod(lambda: ServerPreset._base("tinyllama-infill", 2048, 1024, 1, 64, "infill"))
    bert_bge_small = staticmethod(lambda: ServerPreset._base("bert-bge-small", 512, 128, 2, None, "embeddings model"))
    bert_bge_small_with_fa = staticmethod(lambda: ServerPreset._base("bert-bge-small", 1024, 300, 2, None,
                                                                     "embeddings model"))
    jina_reranker_tiny = staticmethod(lambda: ServerPreset._base("jina-reranker", 512, 512, 1, None, "rerank"))
    tinygemma3 = staticmethod(lambda: ServerPreset._base("tinygemma3", 1024, 512, 1, None, "multimodal"))
    router = staticmethod(lambda: ServerPreset._base("router", 512, 32, 1, None, "router"))


class _NoServer:
    def stop(self) -> None:
        pass


# test_mcp_servers.py's test_mcp_empty_tool_list calls `server.stop()` in a `finally` that
# its start's skip (MCP is not claimed) reaches before the module's `server` is ever
# assigned; this stands in (through `from utils import *`) so the test skips as its
# neighbours do instead of failing on a NameError.
server = _NoServer()


def parallel_function_calls(function_list: List[Tuple[Callable[..., Any], Tuple[Any, ...]]]) -> List[Any]:
    with ThreadPoolExecutor() as ex:
        futures = [ex.submit(f, *a) for f, a in function_list]
    return [f.result() if f.exception() is None else None for f in futures]


def match_regex(regex: str, text: str) -> bool:
    return re.search(regex, text, flags=re.IGNORECASE | re.MULTILINE | re.DOTALL) is not None


def is_slow_test_allowed() -> bool:
    return os.environ.get("SLOW_TESTS") in ("1", "ON")


def download_file(url: str, output_file_path: str | None = None) -> str:
    pytest.skip("no network: downloads are not claimed")
