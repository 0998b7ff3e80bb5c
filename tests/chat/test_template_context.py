"""The variables llama-server gives every template (actord.chat.template.llama_server_context),
with the real templates its tests use: today's date where Llama 3.3 and firefunction print
it, and firefunction's `functions` (the tools as JSON text)."""

from __future__ import annotations

import datetime

import pytest

from actord.chat.template import ChatTemplate
from tests.chat.test_reasoning import TEMPLATES, TOOL

MSGS = [{"role": "user", "content": "What is today?"}]


@pytest.mark.parametrize("tools", [None, [TOOL]])
@pytest.mark.parametrize("name,fmt", [("meta-llama-Llama-3.3-70B-Instruct", "%d %b %Y"),
                                      ("fireworks-ai-llama-3-firefunction-v2", "%b %d %Y")])
def test_today_is_inside_the_prompt_as_llama_server_renders_it(name, fmt, tools):
    tpl = ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), bos_token="<|begin_of_text|>")
    text = tpl.render(MSGS, tools=tools)
    assert datetime.date.today().strftime(fmt) in text
    if tools and name.startswith("fireworks"):
        assert '"name": "test"' in text  # `functions`: the tools as JSON text


def test_a_request_variable_overrides_the_servers():
    tpl = ChatTemplate("{{ date_string }}|{{ flavour | default('none') }}")
    assert tpl.render(MSGS, context={"date_string": "1 Jan 2000", "flavour": "x"}) == "1 Jan 2000|x"
