"""Built-in chat templates by name (`--chat-template NAME`), for models that ship none or
ship a wrong one: llama-server's `--chat-template chatml` and friends.

Why small Jinja strings here rather than llama.cpp's built-in formats
(`llama_chat_apply_template`) or llama-cpp-python's Python formatters: a named template is
then rendered like any other, by the one sandboxed renderer (actord/chat/template.py), so the
prompter's turn memory, tools and reasoning treat it as they treat a model's own template;
llama.cpp's formats are C++ string building, and llama-cpp-python's formatters live in the
`llama_cpp` package, which only the engine may import. Each string writes the format as
llama.cpp's `llm_chat_apply_template` writes the same name (roles, markers, BOS), kept
minimal: no tools (a request with tools gets actord's generic tool format), and no BOS (the
prompter adds the model's where it wants one, as llama.cpp's tokenizer does after its formats).
"""

from __future__ import annotations

from actord.vocabulary.errors import InvalidParams

_ROLE_TURNS = """{%- for m in messages %}{{ OPEN + m['role'] + MID + m['content'] + CLOSE }}{%- endfor %}
{%- if add_generation_prompt %}{{ OPEN + 'assistant' + MID }}{%- endif %}"""


def _turns(open_: str, mid: str, close: str) -> str:
    """A format where every turn is OPEN role MID content CLOSE."""
    return ("{%- set OPEN = " + repr(open_) + " %}{%- set MID = " + repr(mid) + " %}{%- set CLOSE = "
            + repr(close) + " %}" + _ROLE_TURNS)


NAMED: dict[str, str] = {
    "chatml": _turns("<|im_start|>", "\n", "<|im_end|>\n"),
    "llama3": _turns("<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>"),
    "phi3": _turns("<|", "|>\n", "<|end|>\n"),
    "zephyr": ("{%- for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}"
               "{%- endfor %}{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}"),
    "llama2": (
        "{%- set ns = namespace(sys='') %}{%- for m in messages %}"
        "{%- if m['role'] == 'system' %}{%- set ns.sys = '<<SYS>>\\n' + m['content'] + '\\n<</SYS>>\\n\\n' %}"
        "{%- elif m['role'] == 'user' %}{{ bos_token + '[INST] ' + ns.sys + m['content'] | trim + ' [/INST]' }}"
        "{%- set ns.sys = '' %}{%- else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{%- endif %}{%- endfor %}"),
    "mistral-v7": (
        "{%- for m in messages %}"
        "{%- if m['role'] == 'system' %}{{ '[SYSTEM_PROMPT] ' + m['content'] + '[/SYSTEM_PROMPT]' }}"
        "{%- elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + '[/INST]' }}"
        "{%- else %}{{ ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}"),
    "gemma": (
        "{%- set ns = namespace(sys='') %}{%- for m in messages %}"
        "{%- if m['role'] == 'system' %}{%- set ns.sys = m['content'] + '\\n\\n' %}"
        "{%- else %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n'"
        " + (ns.sys if m['role'] == 'user' else '') + m['content'] | trim + '<end_of_turn>\\n' }}"
        "{%- if m['role'] == 'user' %}{%- set ns.sys = '' %}{%- endif %}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"),
    "command-r": (
        "{%- for m in messages %}{{ '<|START_OF_TURN_TOKEN|>' + "
        "('<|SYSTEM_TOKEN|>' if m['role'] == 'system' else '<|CHATBOT_TOKEN|>' if m['role'] == 'assistant'"
        " else '<|USER_TOKEN|>') + m['content'] + '<|END_OF_TURN_TOKEN|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}"),
    "deepseek3": (
        "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}"
        "{%- elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
        "{%- else %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}"),
}


# A model that ships no template chats in its architecture's own format where there is one
# here (Gemma 3 270M's package ships none, and chatml's markers are plain text to Gemma), else
# in chatml, llama-server's fallback for every model.
def builtin_for(arch: str) -> str:
    """The built-in template a model of architecture `arch` without its own template gets."""
    return "gemma" if arch.startswith("gemma") else "chatml"


def is_source(value: str) -> bool:
    """Whether `--chat-template`'s value is Jinja source rather than a name (llama-server
    takes either)."""
    return "{{" in value or "{%" in value


def named(value: str) -> str:
    """The template `--chat-template` names (or its value, when that is Jinja source)."""
    if is_source(value):
        return value
    try:
        return NAMED[value]
    except KeyError:
        raise InvalidParams(f"no built-in chat template {value[:60]!r}; one of {', '.join(sorted(NAMED))}, "
                            "or Jinja source", param="chat_template") from None
