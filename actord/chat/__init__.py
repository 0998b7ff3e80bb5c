"""Chat: messages rendered with the model's template, tool calls planned and parsed, n
choices from one prefill, and the turn that ties them together.

    template.py  chat messages -> the model's prompt (sandboxed Jinja), the prompter and its turn memory
    tools.py     tool calling: the tools in the prompt, the call grammar, the output parsed back
    choices.py   n choices of one prompt from one prefill
    turn.py      one chat turn, the body of the `chat` verb
"""
