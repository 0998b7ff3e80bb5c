"""A capture server for agent CLIs: records every request it gets and answers just enough for
the CLI to go on, so tests/frontends/recorded/ can be made again for a new CLI release.

Why: Claude Code and Codex CLI send requests shaped for a hosted model (mid-conversation
system messages, hosted tools, tool namespaces, `include`), and what they send changes with
each release. Pointed at this server instead of a real API they need no key and no network.
Its first answer calls a tool (Claude Code: Read of ./notes.txt; Codex: a reasoning item and
an `exec_command` of `echo hi`), its later ones answer "done", so a session records the
CLI's first request and its second, with a tool round trip. Streamed answers only (both
CLIs stream).

Record (npm install --prefix /tmp/clis @anthropic-ai/claude-code @openai/codex):

    python scripts/capture_clients.py 18121 /tmp/rec/claude &
    cd /tmp/work && echo hello > notes.txt && HOME=/tmp/h ANTHROPIC_BASE_URL=http://127.0.0.1:18121 \\
        ANTHROPIC_API_KEY=x CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 /tmp/clis/node_modules/.bin/claude -p "Read notes.txt"
    python scripts/capture_clients.py 18122 /tmp/rec/codex &
    HOME=/tmp/h CODEX_HOME=/tmp/h/.codex K=x /tmp/clis/node_modules/.bin/codex exec --skip-git-repo-check \\
        --sandbox read-only -c model_provider=actord \\
        -c 'model_providers.actord={name="actord",base_url="http://127.0.0.1:18122/v1",wire_api="responses",env_key="K"}' "Say hi"

Each request lands in OUT/NNN.json (method, path, headers, body); before committing one as a
fixture, keep the body and a few headers, and zero ids and digests (no key is ever in a body,
but `x-api-key` and `authorization` are in the headers).
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_answer(first: bool) -> list[bytes]:
    if first:
        block = {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": os.getcwd() + "/notes.txt"}}
        body = [sse("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {**block, "input": {}}}),
                sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})]
    else:
        body = [sse("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}}),
                sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": "done"}})]
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": None,
           "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
    return [sse("message_start", {"type": "message_start", "message": msg}), *body,
            sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": 1},
                                  "delta": {"stop_reason": "tool_use" if first else "end_turn", "stop_sequence": None}}),
            sse("message_stop", {"type": "message_stop"})]


def responses_answer(first: bool, n: int) -> list[bytes]:
    if first:
        items = [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAABopaque-from-elsewhere"},
                 {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
                  "arguments": json.dumps({"cmd": "echo hi"}), "status": "completed"}]
    else:
        items = [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                  "content": [{"type": "output_text", "text": "done", "annotations": []}]}]
    resp = {"id": f"resp_{n}", "object": "response", "created_at": int(time.time()), "status": "completed",
            "model": "m", "output": items,
            "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}
    out = [sse("response.created", {"type": "response.created", "response": {**resp, "status": "in_progress",
                                                                              "output": []}})]
    for i, it in enumerate(items):
        out.append(sse("response.output_item.added", {"type": "response.output_item.added", "output_index": i, "item": it}))
        out.append(sse("response.output_item.done", {"type": "response.output_item.done", "output_index": i, "item": it}))
    return out + [sse("response.completed", {"type": "response.completed", "response": resp})]


def serve(port: int, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    seen = {"requests": 0, "turns": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def record(self, body: object) -> None:
            seen["requests"] += 1
            with open(os.path.join(out, f"{seen['requests']:03d}.json"), "w") as f:
                json.dump({"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}, f,
                          indent=1)

        def reply(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_HEAD(self) -> None:  # Claude Code checks the base URL first
            self.record(None)
            self.reply(200, b"", "text/plain")

        def do_GET(self) -> None:
            self.record(None)
            self.reply(200, b"{}", "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
            self.record(body)
            seen["turns"] += 1
            first = seen["turns"] == 1
            events = anthropic_answer(first) if "/messages" in self.path else responses_answer(first, seen["turns"])
            self.reply(200, b"".join(events), "text/event-stream")

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
