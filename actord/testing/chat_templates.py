"""Chat templates for tests: a tiny one for the tiny models, Gemma 3's, a Hermes-style one
with tools.

Kept beside the model writers (actord/testing/models.py names them all) because the tiny
GGUFs carry no useful template of their own and the real Gemma 3 270M ships none: tests
and the daemon (--chat-template-file) supply these.
"""

# A small chat template in the Hugging Face style (Jinja2, the GGUF key
# tokenizer.chat_template) for the tiny models: role headers, an EOS after each message.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Gemma 3's instruction-tuned chat template (what the gemma-3-*-it GGUFs carry as
# tokenizer.chat_template). The 270M GGUF from the registry package is the pretrained model
# and ships none, so tests and the daemon (--chat-template-file) supply this one.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# A Hermes/Qwen 2.5-style tool-calling template (for tests: the tiny models' tokens are
# random, so what matters is the markup): tools in a system turn, calls in <tool_call>
# tags, results in <tool_response> tags in a user turn.
HERMES_TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}<|im_start|>assistant
{% if message['content'] %}{{ message['content'] }}
{% endif %}{% for tc in message['tool_calls'] %}<tool_call>
{"name": "{{ tc['function']['name'] }}", "arguments": {{ tc['function']['arguments'] | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
