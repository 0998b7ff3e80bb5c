"""actord: many long-lived LLM sessions on one accelerator, over llama-cpp-python."""

from actord.config import Config
from actord.system import ActorSystem

__all__ = ["ActorSystem", "Config"]
