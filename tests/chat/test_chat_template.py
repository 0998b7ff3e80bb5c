"""Chat templates (actord.chat.template): the sandboxed Jinja2 environment, prefix stability, bounds.

Why: a mind's next turn must decode only its new messages, which needs the rendered prompt
of turn n+1 to extend turn n's prompt plus the reply; and a template is code a request may
supply, so it runs sandboxed and its failures are typed refusals.
"""

from __future__ import annotations

import sys

import jinja2
import pytest
from hypothesis import given, settings, strategies as st

from actord.chat.template import ChatTemplate
from actord.vocabulary.errors import ChatTemplateError
from actord.testing.models import GEMMA3_CHAT_TEMPLATE, TINY_CHAT_TEMPLATE, write_tiny_llama


@pytest.fixture(scope="module")
def tiny_template(tmp_path_factory) -> str:
    """The template as stored in a generated GGUF (tokenizer.chat_template), read back."""
    import gguf

    path = write_tiny_llama(tmp_path_factory.mktemp("m") / "chat.gguf", seed=3, chat_template=TINY_CHAT_TEMPLATE)
    field = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def test_generated_model_carries_the_template(tiny_template):
    assert tiny_template == TINY_CHAT_TEMPLATE


# Text without edge whitespace: Gemma's template trims message contents.
_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=40).map(str.strip).filter(bool)


@st.composite
def conversations(draw):
    """(messages ending with a user turn, the reply, the next user message)."""
    n = draw(st.integers(0, 4))
    msgs = [{"role": "system", "content": draw(_text)}] if draw(st.booleans()) else []
    for _ in range(n):
        msgs += [{"role": "user", "content": draw(_text)}, {"role": "assistant", "content": draw(_text)}]
    msgs.append({"role": "user", "content": draw(_text)})
    return msgs, draw(_text), draw(_text)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny", "gemma3"])
@settings(max_examples=150, deadline=None)
@given(convo=conversations())
def test_next_turn_prompt_extends_this_prompt_plus_the_reply(which, tiny_template, convo):
    msgs, reply, nxt = convo
    tpl = ChatTemplate(tiny_template if which == "tiny" else GEMMA3_CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>")
    now = tpl.render(msgs)
    later = tpl.render([*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": nxt}])
    assert later.startswith(now + reply)
    assert len(later) > len(now + reply)


def test_gemma3_template_matches_plain_jinja2_rendering():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "Bye"}]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    ref = env.from_string(GEMMA3_CHAT_TEMPLATE).render(messages=msgs, add_generation_prompt=True, bos_token="<bos>")
    ours = ChatTemplate(GEMMA3_CHAT_TEMPLATE, bos_token="<bos>").render(msgs)
    assert ours == ref == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
                           "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_template_refusal_is_a_typed_error():
    tpl = ChatTemplate(GEMMA3_CHAT_TEMPLATE, bos_token="<bos>")
    with pytest.raises(ChatTemplateError, match="alternate"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_sandbox_refuses_reaching_python_internals():
    tpl = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="SecurityError|unsafe"):
        tpl.render([{"role": "user", "content": "x"}])
    mutating = ChatTemplate("{% set l = [] %}{{ l.append(1) }}")
    with pytest.raises(ChatTemplateError):
        mutating.render([])


def test_broken_template_source_is_a_typed_error():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_environment_is_the_hugging_face_one():
    tpl = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                       "{{ m | tojson }}{% endfor %}{{ strftime_now('%Y') | length }}")
    out = tpl.render([{"role": "user", "content": "é"}, {"role": "user", "content": "x"}])
    assert out == '{"role": "user", "content": "é"}4'


def test_a_client_template_that_loops_without_end_is_stopped_by_its_budget():
    """Nested ranges would take minutes; a request's template renders under a step budget."""
    from actord.chat.template import REQUEST_TEMPLATE_BUDGET

    src = "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}"
    tpl = ChatTemplate(src, budget=REQUEST_TEMPLATE_BUDGET)
    with pytest.raises(ChatTemplateError, match="steps"):  # the budget stopped it (no output bound here)
        tpl.render([{"role": "user", "content": "x"}])


def test_the_budget_restores_the_callers_tracer_and_a_normal_template_renders_under_it():
    def mine(frame, event, arg):
        return None

    prev = sys.gettrace()
    sys.settrace(mine)
    try:
        tpl = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", budget=10_000)
        assert tpl.render([{"role": "user", "content": "hi"}]) == "hi"
        assert sys.gettrace() is mine
    finally:
        sys.settrace(prev)


# ---- rendering is bounded in output bytes as it runs (issue 19.6) ----------------------------

BIG = [{"role": "user", "content": "x" * 12_000}]
BOUND = 131_072


@pytest.mark.parametrize("src", [
    "{{ messages[0]['content'] * 1500 }}",  # the issue's template: 18 MB in one step
    "{{ 1500 * messages[0]['content'] }}",
    "{{ ([messages[0]['content']] * 1500) | join('') }}",
    "{% set ns = namespace(x=messages[0]['content']) %}{% for i in range(30) %}{% set ns.x = ns.x ~ ns.x %}"
    "{% endfor %}{{ ns.x }}",  # doubling by concatenation
    "{% set ns = namespace(x=messages[0]['content']) %}{% for i in range(30) %}{% set ns.x = ns.x + ns.x %}"
    "{% endfor %}{{ ns.x }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format('a') }}",
    "{{ 'a'.ljust(999999999) }}",
    "{{ 'a' | center(999999999) }}",
    "{{ 'a\\nb\\nc\\nd' | indent(99999) }}",
    "{{ messages[0]['content'] | replace('x', 'yyyyyyyyyyyyyyyyyyyy') }}",
])
def test_a_template_that_would_build_a_value_past_the_prompt_limit_is_refused_before_building_it(src):
    import tracemalloc

    from actord.vocabulary.errors import PromptTooLong

    tpl = ChatTemplate(src, budget=REQUEST_TEMPLATE_BUDGET_FOR_TESTS, max_bytes=BOUND)
    tracemalloc.start()
    try:
        with pytest.raises(PromptTooLong):
            tpl.render(BIG)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * BOUND  # never the whole (megabytes or gigabytes) value


def test_a_template_that_writes_a_little_many_times_is_stopped_as_its_output_passes_the_limit():
    from actord.vocabulary.errors import PromptTooLong

    tpl = ChatTemplate("{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}",
                       budget=REQUEST_TEMPLATE_BUDGET_FOR_TESTS, max_bytes=BOUND)
    with pytest.raises(PromptTooLong) as e:
        tpl.render(BIG)
    assert BOUND < e.value.data["n_prompt_bytes"] <= BOUND + 12_000  # stopped at the first chunk past it


def test_templates_within_the_limit_render_as_before():
    from actord.testing.models import GEMMA3_CHAT_TEMPLATE

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi " * 1000},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    free = ChatTemplate(GEMMA3_CHAT_TEMPLATE, bos_token="<bos>").render(msgs)
    bounded = ChatTemplate(GEMMA3_CHAT_TEMPLATE, bos_token="<bos>", max_bytes=len(free.encode())).render(msgs)
    assert bounded == free
    tpl = ChatTemplate("{{ '{0:>4}|{1}'.format(messages[0].role, 'x' * 3) }}{{ 'ab' ~ 'cd' }}{{ 'x'|center(9) }}",
                       max_bytes=100)
    assert tpl.render(msgs) == "system|xxxabcd    x    "


REQUEST_TEMPLATE_BUDGET_FOR_TESTS = 2_000_000
