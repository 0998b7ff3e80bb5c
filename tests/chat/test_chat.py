"""Chat turns end to end: the embedded API, JSON-RPC `chat` and `actord chat`, the real model.

What is pinned: a conversation's next turn decodes only its new messages (token-level
prefix stability, over random conversations), a model without a template refuses with a
typed error unless the request names one, and on Gemma 3 270M the prompt is the template's
own rendering, tokenized with its special tokens as single tokens and one BOS.
"""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import jinja2
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from actord.chat.messages import ChatMessage
from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.vocabulary.errors import ChatTemplateError
from actord.service.system import ActorSystem
from actord.testing.models import GEMMA3_CHAT_TEMPLATE, TINY_CHAT_TEMPLATE, write_tiny_llama
from tests.frontends.test_daemon import daemon  # noqa: F401  (the fixture: `actord serve` in its own process)

PY = sys.executable


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny-chat.gguf", seed=1,
                                chat_template=TINY_CHAT_TEMPLATE))


_words = st.lists(st.sampled_from("the model cache hello world page state actor é 42 !".split()),
                  min_size=1, max_size=6).map(" ".join)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=st.one_of(st.none(), _words), users=st.lists(_words, min_size=2, max_size=4),
       n_predict=st.lists(st.integers(1, 6), min_size=4, max_size=4))
def test_each_turn_decodes_only_its_new_messages(chat_model, system, users, n_predict):
    async def main() -> None:
        cfg = Config(model=chat_model, slots=1, ctx=1024, batch=64)
        async with ActorSystem(cfg) as s:
            msgs = [ChatMessage("system", system)] if system else []
            prev = None
            for i, text in enumerate(users):
                msgs.append(ChatMessage("user", text))
                r = await s.chat(messages=msgs, n_predict=n_predict[i], mind="ada")
                c = r.completion
                if prev is not None:
                    assert r.reused_turn
                    unfed = 1 if prev.stop_reason == "length" else 0
                    assert c.n_cached == prev.n_prompt_tokens + len(prev.tokens) - unfed
                    assert c.n_prompt_processed == c.n_prompt_tokens - c.n_cached
                prev = c
                msgs.append(r.message)

    anyio.run(main)



@pytest.mark.anyio
async def test_a_model_without_a_template_chats_in_chatml_said_once_and_a_named_one_streams(tiny_model, chat_model):
    from structlog.testing import capture_logs

    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=512, batch=64)) as s:
        with capture_logs() as logs:
            await s.chat(messages=[ChatMessage("user", "hi")], n_predict=2)
            await s.chat(messages=[ChatMessage("user", "ho")], n_predict=2)
        warned = [e for e in logs if e["event"] == "chat.builtin_template"]
        assert [(e["log_level"], e["template"], e["arch"]) for e in warned] == [("warning", "chatml", "llama")]
        assert await s.apply_template([ChatMessage("user", "hi")]) == \
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        chunks: list[str] = []
        r = await s.chat(messages=[ChatMessage("user", "hi")], template=TINY_CHAT_TEMPLATE, n_predict=5,
                         stream=True, on_token=lambda ch: chunks.append(ch["content"]))
        assert "".join(chunks) == r.message.content and len(r.completion.tokens) == 5
        with pytest.raises(ChatTemplateError):
            await s.chat(messages=[ChatMessage("user", "hi")], template="{{ raise_exception('no') }}")
        assert (await s.slot_list())[0].state == "idle"  # a refusal changed nothing


@pytest.mark.slow
def test_cli_chat_reads_messages_from_stdin_and_prints_typed_errors(daemon, tmp_path):
    sock, proc = daemon
    msgs = json.dumps([{"role": "user", "content": "hello"}])
    base = [PY, "-m", "actord.cli", "--socket", str(sock), "chat", "-n", "4"]
    plain = subprocess.run(base, input=msgs, capture_output=True, text=True, timeout=60)  # chatml: no template of its own
    assert plain.returncode == 0 and json.loads(plain.stdout)["message"]["role"] == "assistant"
    tpl = tmp_path / "t.jinja"
    tpl.write_text(TINY_CHAT_TEMPLATE)
    ok = subprocess.run([*base, "--template", str(tpl)], input=msgs, capture_output=True, text=True, timeout=60)
    out = json.loads(ok.stdout)
    assert ok.returncode == 0 and out["message"]["role"] == "assistant" and len(out["completion"]["tokens"]) == 4
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}))
    streamed = subprocess.run([*base, str(f), "--template", str(tpl), "--stream"], capture_output=True, text=True,
                              timeout=60)
    assert streamed.returncode == 0 and streamed.stdout.startswith(out["message"]["content"])
    proc.kill()
    _, err = proc.communicate(timeout=10)
    warned = [line for line in err.decode().splitlines() if "chat.builtin_template" in line]
    assert len(warned) == 1 and "template=chatml" in warned[0]  # said once, at start, for every chat after


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.anyio
async def test_gemma3_prompt_is_the_templates_own_output_and_the_next_turn_reuses_it(real_model, anyio_backend):
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough for the real model")
    msgs = [ChatMessage("system", "You answer in one short sentence."),
            ChatMessage("user", "What is the capital of France?"),
            ChatMessage("assistant", "Paris."),
            ChatMessage("user", "And of Italy?")]
    ref_text = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(GEMMA3_CHAT_TEMPLATE).render(
        messages=[{"role": m.role, "content": m.content} for m in msgs], add_generation_prompt=True,
        bos_token="<bos>", eos_token="<eos>")
    async with ActorSystem(Config(model=real_model, slots=1, ctx=1024, batch=256)) as s:
        # The registry's 270M is the pretrained model and ships no template: the built-in
        # gemma format renders the same tokens as Gemma 3's own template.
        builtin = await s.chat(messages=msgs, n_predict=1)
        r = await s.chat(messages=msgs, template=GEMMA3_CHAT_TEMPLATE, n_predict=8, mind="gem")
        want = await s.engine.run(J.Tokenize(text=ref_text, add_special=False, parse_special=True))
        assert want[0] == s.props.bos and want.count(s.props.bos) == 1
        sot = await s.engine.run(J.Tokenize(text="<start_of_turn>", add_special=False, parse_special=True))
        assert len(sot) == 1 and want.count(sot[0]) == 4  # special tokens are single tokens
        assert r.completion.n_prompt_tokens == len(want) == builtin.completion.n_prompt_tokens
        held = (await s.slot_list())[0].n_tokens
        assert held >= len(want)
        nxt = [*msgs, r.message, ChatMessage("user", "And of Spain?")]
        r2 = await s.chat(messages=nxt, template=GEMMA3_CHAT_TEMPLATE, n_predict=4, mind="gem")
        unfed = 1 if r.completion.stop_reason == "length" else 0
        assert r2.reused_turn
        assert r2.completion.n_cached == len(want) + len(r.completion.tokens) - unfed


@pytest.mark.anyio
async def test_a_chat_over_the_prompt_byte_limit_is_refused_before_rendering(chat_model, tmp_path):
    from actord.vocabulary.errors import PromptTooLong

    async with ActorSystem(Config(model=chat_model, slots=1, ctx=512, max_prompt_bytes=1000,
                                  page_dir=str(tmp_path))) as s:
        with pytest.raises(PromptTooLong):
            await s.chat(messages=[{"role": "user", "content": "x" * 2000}], n_predict=1)
        assert s.metrics.snapshot()["prompt_tokens_total"] == 0
