"""One chat turn (`ActorSystem.chat`): a conversation rendered into the model's prompt
(actord/chat/prompter.py), tool calling planned (actord/chat/tools.py), the completion run (`n` > 1: several
choices from one prefill, actord/chat/choices.py), the reply parsed and remembered.

Why a module of its own: this is the chat verb's whole body, the socket's `chat` and the
HTTP chat routes' alike; the system keeps only the entry point, so its module stays about
the actors and their lifecycle.

The bytes a client sends are bounded before anything renders or tokenizes them. A
conversation this system served before comes back as the exact tokens of its last prompt +
reply (the prompter's turn memory), so its mind decodes only the new messages; a reply cut
at a stop string no longer matches its tokens and is not remembered. With tools, the turn
renders and samples in the format the request, `--tool-format` or the template names.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from actord.vocabulary.types import CompletionRequest, CompletionResult, RequestLimits, SamplingFields, check_generation
from actord.vocabulary.errors import FileNotFound, InvalidParams, PromptTooLong
from actord.vocabulary.log import get

if TYPE_CHECKING:
    from actord.engine.jobs import ChatTemplateInfo
    from actord.chat.messages import ChatRequest
    from actord.chat.prompter import ChatPrompter
    from actord.chat.host import ChatHost
    from actord.chat.stream import OnToken

log = get("actord.service.system")


def precheck(request: "ChatRequest", limits: RequestLimits) -> "ChatRequest":
    """A turn's own refusals under the daemon's limits, before anything renders: its fields
    (`ChatRequest.check`) and what its completion will ask for beside the prompt (stop
    strings, genes, the budget, sampling, the mind's name: `check_generation`), read on the
    request's own fields. Every front's turn meets it here (`check_turn`); an HTTP front
    meets it once more as it reads the request, so a refusal is its API's 4xx before the
    answer starts. A grammar is checked where it is made (a front's response_format) and
    when the completion is."""
    request.check()
    check_generation(request, limits)
    return request


def check_turn(system: "ChatHost", request: "ChatRequest", n: int) -> None:
    """A turn's refusals before anything is recorded or rendered: its fields (`precheck`),
    a closing system, `n`, and the bytes a client sent (messages, template, tools and calls)."""
    from actord.chat.messages import has_tools

    precheck(request, system.request_limits())
    system.check_open()
    if n != 1:
        from actord.chat.choices import check_n

        check_n(n, system.config.max_n)
    limits = system.request_limits()
    size = sum(len(m.role.encode()) + len(m.content.encode()) for m in request.messages)
    size += len(request.template.encode()) if request.template else 0
    size += len(request.reasoning_budget_message.encode()) if request.reasoning_budget_message else 0
    if request.tools or has_tools(request.messages):
        size += len(msgspec.json.encode(request.tools)) + sum(
            len(c.arguments.encode()) + len(c.name) for m in request.messages for c in m.tool_calls or [])
    if size > limits.max_prompt_bytes:
        raise PromptTooLong(f"chat of {size} bytes is over the limit of {limits.max_prompt_bytes}",
                            n_prompt_bytes=size, max_prompt_bytes=limits.max_prompt_bytes)


async def run_turn(system: "ChatHost", request: "ChatRequest", on_token: "OnToken | None", n: int = 1) -> Any:
    """The turn's ChatResult (with `n` > 1, a list of n, choice 0's reply remembered); the
    façade checked it (`check_turn`) and recorded it."""
    from actord.chat.choices import reply_message
    from actord.chat.messages import has_tools
    from actord.chat.tool_output import StreamAdapter

    prompter = await _prompter(system)
    fields = {f: getattr(request, f) for f in SamplingFields.__struct_fields__}
    turn = None
    if request.tools or has_tools(request.messages):  # tool calling: actord.chat.tools
        turn = tool_turn(system, request, prompter)
        if turn.grammar:
            if request.grammar or request.json_schema is not None:
                raise InvalidParams("a grammar (response_format) and tools both constrain the output: "
                                    "send one, or tool_choice none", param="response_format")
            fields.update(grammar=turn.grammar, grammar_triggers=turn.triggers, preserve=turn.preserve)
    thought = turn_reasoning(system, request, prompter)
    if thought.forces and (fields["grammar"] or fields["json_schema"] is not None) and not fields["grammar_triggers"]:
        raise InvalidParams("reasoning_budget would force a thought's end past a grammar that holds from the "
                            "first token: send one", param="reasoning_budget")
    prompt = await prompter.build(request.messages, template=request.template,
                                  add_generation_prompt=request.add_generation_prompt,
                                  render=turn.render if turn else None,
                                  tools=turn.template_tools if turn else None,
                                  context=thought.context, finish=thought.finish,
                                  continue_final=request.continue_final_message)
    thought.start(prompt.tail)
    completion = CompletionRequest(
        prompt=prompt.tokens, n_predict=request.n_predict, slot=request.slot, mind=request.mind,
        temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, seed=request.seed,
        stop=request.stop, stream=request.stream, genes=request.genes, return_progress=request.return_progress,
        timings_per_token=request.timings_per_token, thought_budget=await thought.thought_budget(system),
        ignore_eos=request.ignore_eos, **fields,
    )

    async def end(result: CompletionResult, message: Any) -> Any:
        return await _end(system, request, prompter, prompt, result, message)

    if n != 1:  # n choices of one prompt, prefilled once (actord/chat/choices.py)
        from actord.chat.choices import chat_choices

        return await chat_choices(system, completion, n, turn, on_token, end, thought)
    scanner = turn.scanner() if turn is not None and turn.parses else None
    sink = StreamAdapter(scanner, on_token) if scanner is not None and on_token is not None else on_token
    outer = thought.sink(sink)
    result = await system.complete(completion, on_token=outer, _input=False)
    return await end(result, reply_message(scanner, sink, result, thought, outer))


def turn_reasoning(system: "ChatHost", request: "ChatRequest", prompter: Any) -> Any:
    """The turn's reasoning (actord.chat.reasoning): the request's fields over the daemon's."""
    from actord.chat.reasoning import for_turn

    config = system.config
    budget = request.reasoning_budget if request.reasoning_budget is not None else config.reasoning_budget
    message = request.reasoning_budget_message
    source = request.template if request.template is not None else prompter.info.template
    return for_turn(source, config.reasoning, request.reasoning_format or config.reasoning_format,
                    request.template_kwargs, budget, config.reasoning_budget_message if message is None else message)


async def render_text(system: "ChatHost", request: "ChatRequest") -> str:
    """The text a turn's prompt is made of (its tools and thinking as the turn renders them),
    without tokenizing or generating: what /apply-template shows."""
    from actord.chat.messages import as_dicts, has_tools

    prompter = await _prompter(system)
    turn = tool_turn(system, request, prompter) if request.tools or has_tools(request.messages) else None
    from actord.chat.prompter import prefills

    thought = turn_reasoning(system, request, prompter)
    tpl = prompter.template(request.template)
    dicts = turn.render if turn else as_dicts(request.messages)
    tools = turn.template_tools if turn else None
    if prefills(request.messages, request.add_generation_prompt, request.continue_final_message):
        return await prompter.continued(tpl, dicts, tools, thought.context)
    text = await tpl.render_async(dicts, add_generation_prompt=request.add_generation_prompt, tools=tools,
                                  context=thought.context)
    return thought.finish(text) if request.add_generation_prompt else text


async def template_info(system: "ChatHost") -> tuple["ChatTemplateInfo", bool]:
    """The model's chat template info, its template replaced by --chat-template-file's when
    one is set (read on a worker thread) or --chat-template's (a built-in name or Jinja
    source: actord/chat/named_templates.py); and whether it was."""
    info = await system.chat_info()
    path = system.config.chat_template_file
    if system.config.chat_template:
        from actord.chat.named_templates import named

        return msgspec.structs.replace(info, template=named(system.config.chat_template)), True
    if not path:
        if info.template is None:  # llama-server's fallback: the architecture's own format, else chatml
            from actord.chat.named_templates import NAMED, builtin_for

            name = builtin_for(info.arch)
            if not system.chat_state.builtin_warned:
                system.chat_state.builtin_warned = True
                log.warning("chat.builtin_template", template=name, arch=info.arch,
                            why="the model ships no tokenizer.chat_template; --chat-template names another")
            return msgspec.structs.replace(info, template=NAMED[name]), False
        return info, False
    try:
        source = await system.run_sync(Path(path).read_text)
    except (OSError, UnicodeDecodeError) as e:
        raise FileNotFound(f"cannot read chat template {path}: {e}", path=path) from None
    return msgspec.structs.replace(info, template=source), True


async def _prompter(system: "ChatHost") -> "ChatPrompter":
    """The system's ChatPrompter, made on the first turn (the model's template, or --chat-template-file)."""
    from actord.chat.prompter import ChatPrompter

    state = system.chat_state
    if state.prompter is not None:
        return state.prompter
    info, from_file = await template_info(system)

    async def tokenize(text: str) -> list[int]:
        return await system.tokens_of(text, add_special=False, parse_special=True)

    state.prompter = ChatPrompter(info, tokenize, memory_tokens=system.config.chat_memory_tokens,
                                  run_sync=system.run_sync, limiter=render_limiter(system),
                                  max_bytes=system.request_limits().max_prompt_bytes)
    return state.prompter


def render_limiter(system: "ChatHost") -> anyio.CapacityLimiter:
    """The system's chat-template render threads (actord.chat.template.RENDER_THREADS), made
    on first use: the chat turns and the socket's apply_template share them."""
    state = system.chat_state
    if state.render_limiter is None:
        from actord.chat.template import RENDER_THREADS

        state.render_limiter = anyio.CapacityLimiter(RENDER_THREADS)
    return state.render_limiter


async def _end(system: "ChatHost", request: Any, prompter: Any, prompt: Any, result: CompletionResult,
               message: Any) -> Any:
    """The turn's ChatResult; its reply remembered for the conversation's next turn."""
    from actord.chat.messages import ChatResult

    if result.stop_reason != "cancelled" and (
        not request.stop or await system.text_of(result.tokens) == result.content
    ):  # a reply cut at a stop string no longer matches its tokens: not reusable
        prompter.remember(prompt, message, result)
    return ChatResult(message=message, completion=result, reused_turn=prompt.reused_turn)


def tool_turn(system: "ChatHost", request: Any, prompter: Any) -> Any:
    """What a chat turn with tools renders and samples under (actord.chat.tools), in the format
    the request, the daemon's --tool-format or the template names."""
    from actord.chat import tools as T

    mode, name = T.check_tools(request.tools, request.tool_choice)
    fmt = request.tool_format or system.config.tool_format
    if fmt == "auto":
        source = request.template if request.template is not None else prompter.info.template
        fmt, why = T.detect_format(source)
        if system.chat_state.tool_format_logged != (fmt, source):
            system.chat_state.tool_format_logged = (fmt, source)
            log.info("chat.tool_format", format=fmt, why=why)
    return T.plan_turn(fmt, request.messages, request.tools, mode, name, request.parallel_tool_calls)
