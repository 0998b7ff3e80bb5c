"""Chat: messages rendered with the model's template, tool calls planned and parsed, n
choices from one prefill, and the turn that ties them together.

    messages.py     the shapes: a message, a tool and a call, the chat request and its result
    template.py     the model's chat template, compiled in a bounded Jinja sandbox
    prompter.py     messages -> prompt tokens, reusing a served turn's exact tokens (the turn memory)
    tools.py        tool calling: the tools in the prompt, the call grammar, the format's choice
    tool_output.py  tool calls parsed back from the output, and the typed events a stream carries
    choices.py      n choices of one prompt from one prefill
    turn.py         one chat turn, the body of the `chat` verb, and its precheck
    defaults.py     what a turn gets where its API said nothing (length, sampling), in one place

Nothing here knows a wire: the fronts (actord/frontends) decode into these shapes and
write the events in their own (OpenAI's tool shapes: actord/frontends/http/openai/tools_wire.py).
"""
