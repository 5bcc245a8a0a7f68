"""One prompt row as the driver prepares it (data/) and the generation pool sends it (rollout/):
the prompt, its reference answer and what the verifiers and the warm-up need besides."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: Optional[str] = None
    """A target completion for the supervised warm-up, when known."""
    fields: Dict[str, Any] = field(default_factory=dict, hash=False)
    """The row's other columns, passed to the verifiers (`tests` for code, `language`, ...)."""
    messages: Optional[Tuple[Tuple[str, str], ...]] = None
    """A conversational row's (role, content) messages; `prompt` is then its last user
    message until data/prompts.py renders the row into the text the model sees."""
    warmup_prompt: Optional[str] = None
    """The text the warm-up trains after, when it is not `prompt`: in agent runs the agent gets
    the conversation and the endpoint renders it, so the warm-up takes that rendering."""
