"""The unit that travels from rollout to learner: one prompt and its G completions.

A generation worker creates it and puts it in the Ray object store itself; the verifier pool
adds rewards and puts the scored copy; learner ranks fetch it by reference. The driver only
ever holds ObjectRefs to it (the buffer), never the payload.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class PromptGroup:
    index: int
    """Position of the prompt in the training set (or the held-out set for evaluation)."""
    prompt: str
    answer: str
    prompt_ids: List[int]
    completions: List[str]
    completion_ids: List[List[int]]
    finish_reasons: List[str]
    """`stop` (ended with EOS) or `length` (truncated at max_new_tokens)."""
    policy_version: int
    """Version of the weights that generated the completions."""
    sampler_logprobs: Optional[List[List[float]]] = None
    """Per completion, the sampler's log-prob of each token it chose (None for greedy
    evaluation): the behaviour policy that importance weights correct for."""
    fields: Dict[str, Any] = field(default_factory=dict)
    """The row's other columns, for verifiers that need them (`tests` for code, `language`)."""
    rewards: Optional[List[float]] = None
    """Weighted sum of the verifier scores, one per completion (set by the verifier pool)."""
    scores: Dict[str, List[float]] = field(default_factory=dict)
    """Per-verifier scores, one list per verifier name."""
    timed_out: List[List[str]] = field(default_factory=list)
    """Per completion, the verifiers that ran out of time on it (scored 0)."""
    loss_masks: Optional[List[List[int]]] = None
    """Multi-turn episodes: per completion, 1 for each token the sampler chose and 0 for tool
    results (left out of the loss, the KL and the entropy). None: every token is the model's."""
    transcripts: Optional[List[str]] = None
    """Multi-turn episodes: per completion, the model's turns and the tool results in order
    (`completions` holds the model's turns only). Verifiers get it as the field `transcript`."""
    version_spans: Optional[List[List[Tuple[int, int, int]]]] = None
    """Streaming rollouts: per completion, (policy version, start, end) of each span of its
    tokens sampled by one version (a sample may span a weight push with rollout.partial; the
    oldest is `policy_version`). None: every token by `policy_version`."""

    @property
    def group_size(self) -> int:
        return len(self.completions)
