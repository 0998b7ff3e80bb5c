"""What chats keep between turns on one system (`ChatState`): the host holds one and the
turn (turn.py) fills it on first use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from actord.chat.prompter import ChatPrompter


@dataclass
class ChatState:
    """What chats keep between turns on one system, each made on first use: the prompter
    (its turn memory), the template render threads, the tool format last logged."""

    prompter: "ChatPrompter | None" = None
    render_limiter: anyio.CapacityLimiter | None = None
    tool_format_logged: tuple[str, str | None] | None = None
    builtin_warned: bool = False  # the model ships no template: said once (template_info)
