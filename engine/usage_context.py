"""Who built an engine (vLLM's `UsageContext` names): offline `LLM`, a server, or code
using the engine classes directly. On a GPU it picks the step's default token budget."""

from __future__ import annotations

from enum import Enum


class UsageContext(str, Enum):
    UNKNOWN_CONTEXT = "UNKNOWN_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    ENGINE_CONTEXT = "ENGINE_CONTEXT"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"
