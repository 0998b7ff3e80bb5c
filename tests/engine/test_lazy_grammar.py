"""The engine's lazy grammar (tool calls' `auto`) and preserved control tokens, end to end
through the actors on a generated tiny llama: free output until a trigger shows, the grammar
from there; a trigger whose text the grammar cannot take leaves the output free (never an
abort); an at-start trigger only where the output opens; a control token's text kept.
A +100 logit bias makes the random model write what each case needs."""

from __future__ import annotations

import pytest

from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.service.system import ActorSystem

pytestmark = pytest.mark.anyio
PROMPT = [1, 17, 40, 99, 7, 250, 33, 12, 180, 64]


async def _tok(s: ActorSystem, text: str) -> int:
    [t] = await s.engine.run(J.Tokenize(text=text, add_special=False, parse_special=True))
    return t


@pytest.fixture(scope="module")
def marker_model(tmp_path_factory) -> str:
    from actord.testing.models import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("m") / "marker.gguf", seed=1, control_tokens=("<tc>",)))


async def test_a_lazy_grammar_applies_from_its_trigger(tiny_model):
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=512, batch=64)) as s:
        x = await _tok(s, "x")
        r = await s.complete(prompt=PROMPT, n_predict=20, slot=0, logit_bias={str(x): 100}, grammar='root ::= "xx" "y"',
                             grammar_triggers=[{"text": "xx"}])
        assert r.content == "xxy" and r.stop_reason == "eos"  # free "xx", then the grammar's "y" and its end


async def test_a_trigger_the_grammar_cannot_take_leaves_the_output_free(tiny_model):
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=512, batch=64)) as s:
        x = await _tok(s, "x")
        r = await s.complete(prompt=PROMPT, n_predict=12, slot=0, logit_bias={str(x): 100}, grammar='root ::= "x" "y"',
                             grammar_triggers=[{"text": "xx"}])
        assert r.content == "x" * 12 and r.stop_reason == "length"  # the grammar refused "xx": dropped, no abort
        again = await s.complete(prompt=PROMPT, n_predict=4, slot=0)
        assert len(again.tokens) == 4


async def test_an_at_start_trigger_fires_only_where_the_output_opens(tiny_model):
    async with ActorSystem(Config(model=tiny_model, slots=1, ctx=512, batch=64)) as s:
        x, y = await _tok(s, "x"), await _tok(s, "y")
        at_start = [{"text": "x", "at_start": True}]
        r = await s.complete(prompt=PROMPT, n_predict=12, slot=0, logit_bias={str(x): 100}, grammar='root ::= "xz"',
                             grammar_triggers=at_start)
        assert r.content == "xz" and r.stop_reason == "eos"
        r = await s.complete(prompt=PROMPT, n_predict=6, slot=0, logit_bias={str(y): 100}, grammar='root ::= "xz"',
                             grammar_triggers=at_start)
        assert r.content == "y" * 6  # opened with "y": the trigger never fires


async def test_a_preserved_control_token_keeps_its_text(marker_model):
    async with ActorSystem(Config(model=marker_model, slots=1, ctx=512, batch=64)) as s:
        tc = await _tok(s, "<tc>")
        bias = {str(tc): 100}
        kept = await s.complete(prompt=PROMPT, n_predict=3, slot=0, logit_bias=bias, preserve=["<tc>"])
        plain = await s.complete(prompt=PROMPT, n_predict=3, slot=0, logit_bias=bias)
        assert kept.tokens == plain.tokens == [tc] * 3
        assert kept.content == "<tc>" * 3 and plain.content == ""
