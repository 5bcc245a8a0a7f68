"""vLLM's engine as the request-level StepEngine (common/backends.py) the multi-turn loops drive."""
from __future__ import annotations

from typing import Any, List, Sequence


class VllmStepEngine:
    """The `LLMEngine` inside an `LLM`, looked up at each call: what the loops see is whatever
    engine the LLM holds at that moment (tests wrap it in a tap that records requests)."""

    def __init__(self, llm):
        self.llm = llm

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: Any) -> None:
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)

    def step(self) -> List[Any]:
        return self.llm.llm_engine.step()
