"""Built-in chat templates by name (actord.chat.named_templates): each writes its format's
markers for a system, user, assistant, user conversation, and an unknown name is refused
naming the field. None writes a BOS but llama2's (whose format repeats it per turn): the
prompter adds the model's, as llama.cpp's tokenizer does after its formats."""

from __future__ import annotations

import pytest

from actord.chat.named_templates import NAMED, named
from actord.chat.template import ChatTemplate
from actord.vocabulary.errors import InvalidParams

MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
EXPECTED = {
    "chatml": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
              "<|im_start|>user\nV<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>"
              "\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|><|start_header_id|>user"
              "<|end_header_id|>\n\nV<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama2": "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST] A </s><s>[INST] V [/INST]",
    "gemma": "<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
             "<start_of_turn>user\nV<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\nA<|end|>\n<|user|>\nV<|end|>\n<|assistant|>\n",
    "zephyr": "<|system|>\nS</s>\n<|user|>\nU</s>\n<|assistant|>\nA</s>\n<|user|>\nV</s>\n<|assistant|>\n",
    "mistral-v7": "[SYSTEM_PROMPT] S[/SYSTEM_PROMPT][INST] U[/INST] A</s>[INST] V[/INST]",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>S<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
                 "<|USER_TOKEN|>U<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>A<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>V<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "deepseek3": "S\n\n<｜User｜>U<｜Assistant｜>A<｜end▁of▁sentence｜><｜User｜>V<｜Assistant｜>",
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_each_named_template_writes_its_format(name):
    assert ChatTemplate(named(name), bos_token="<s>", eos_token="</s>").render(MSGS) == EXPECTED[name]


def test_jinja_source_is_taken_as_is_and_an_unknown_name_is_refused():
    assert named("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(InvalidParams) as e:
        named("chatml2")
    assert e.value.data["param"] == "chat_template" and "chatml" in e.value.message


def test_a_model_without_a_template_gets_gemma_for_gemma_and_chatml_else_and_gemma_renders_as_gemma3s_own():
    from actord.chat.named_templates import NAMED, builtin_for
    from actord.chat.template import ChatTemplate
    from actord.testing.chat_templates import GEMMA3_CHAT_TEMPLATE

    assert [builtin_for(a) for a in ("gemma3", "gemma", "gemma3n", "llama", "qwen2", "")] == \
        ["gemma", "gemma", "gemma", "chatml", "chatml", "chatml"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]
    own = ChatTemplate(GEMMA3_CHAT_TEMPLATE, bos_token="<bos>").render(msgs)
    builtin = ChatTemplate(NAMED["gemma"], bos_token="<bos>").render(msgs)
    assert own == "<bos>" + builtin  # the prompter adds the BOS the built-in formats leave out
