"""The socket's `chat` stream with tools: what each `completion.chunk` carries (the chunk
the method hands the connection), pinned as OpenAI's `tool_calls` deltas, whatever shape the
chat package streams its calls in."""

from __future__ import annotations

import json

import msgspec
import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem
from actord.testing.models import HERMES_TOOL_TEMPLATE, write_tiny_llama

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-tools.gguf", seed=1,
                                chat_template=HERMES_TOOL_TEMPLATE, control_tokens=("<tool_call>", "</tool_call>")))


@pytest.mark.anyio
async def test_the_socket_streams_each_tool_call_as_an_openai_delta(tools_model):
    from actord.frontends.rpc.methods import METHODS

    method = METHODS["chat"]
    params = msgspec.convert({"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": [WEATHER],
                              "tool_choice": "required", "parallel_tool_calls": False, "n_predict": 120,
                              "stream": True}, method.params)
    chunks: list[dict] = []
    async with ActorSystem(Config(model=tools_model, slots=1, ctx=2048, batch=64)) as s:
        out = await method.call(s, params, chunks.append)
    wire = [json.loads(msgspec.json.encode(c)) for c in chunks]  # as the connection writes them
    [call] = out["message"]["tool_calls"]
    assert set(call) == {"id", "name", "arguments"} and call["name"] == "get_weather"
    deltas = [d for c in wire for d in c.get("tool_calls", [])]
    assert deltas == [{"index": 0, "id": call["id"], "type": "function",
                       "function": {"name": "get_weather", "arguments": call["arguments"]}}]
    assert all(set(c) <= {"slot", "content", "tokens", "tool_calls", "logprobs", "n_prompt", "n_cached"}
               for c in wire), wire
    # The first chunk says how the prompt was placed (TokenChunk), the others do not.
    assert wire[0]["n_prompt"] == out["completion"]["n_prompt_tokens"] and all("n_prompt" not in c for c in wire[1:])
    assert "".join(c["content"] for c in wire) == out["message"]["content"] == ""
