"""The text verbs at the façade (actord/service/text.py): recorded under the socket's method
names with the socket's params, so a trace that holds them replays; a refused one leaves
no record."""

from __future__ import annotations

import anyio
import msgspec
import pytest


def test_text_verbs_record_the_socket_inputs_and_replay(models_dir, tmp_path):
    from actord.chat.messages import ChatMessage
    from actord.frontends.rpc.methods import ApplyTemplateParams, DetokenizeParams, NoParams, TokenizeParams
    from actord.replay.replay import replay
    from actord.vocabulary.config import Config
    from actord.vocabulary.errors import PromptTooLong
    from actord.service.system import ActorSystem
    from actord.testing.models import TINY_CHAT_TEMPLATE, write_tiny_llama

    model = str(write_tiny_llama(models_dir / "replay-chat.gguf", seed=1, chat_template=TINY_CHAT_TEMPLATE))
    events: list = []
    msgs = [ChatMessage(role="user", content="hello")]

    async def run():
        cfg = Config(model=model, slots=1, ctx=512, page_dir=str(tmp_path / "p"), max_prompt_bytes=64)
        async with ActorSystem(cfg, trace=events) as s:
            out = await s.tokenize("hello", with_pieces=True)
            assert out.pieces is not None and len(out.pieces) == len(out.tokens) > 0
            assert await s.detokenize(out.tokens) == "hello"
            src = await s.chat_template()
            assert src.template == TINY_CHAT_TEMPLATE and src.origin == "model"
            assert "hello" in await s.apply_template(msgs)
            with pytest.raises(PromptTooLong):
                await s.tokenize("x" * 65)  # over the bound: refused before it is recorded

    anyio.run(run)
    inputs = [(e.method, e.params) for e in events if type(e).__name__ == "Input"]
    b = msgspec.to_builtins
    assert inputs == [
        ("tokenize", b(TokenizeParams(content="hello", with_pieces=True))),
        ("detokenize", b(DetokenizeParams(tokens=inputs[1][1]["tokens"]))),
        ("chat.template", b(NoParams())),
        ("apply_template", b(ApplyTemplateParams(messages=msgs))),
    ]
    r = anyio.run(replay, events, model)
    assert r.ok, r
