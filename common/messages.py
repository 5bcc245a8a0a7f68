"""What crosses a boundary between the run's parts, as types rather than dicts of agreed keys."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple


@dataclass(frozen=True)
class RestartEvent:
    """An actor that died during a step and came back (restarted by Ray, or rebuilt by the driver)."""
    role: str               # "generation worker", "verifier", "learner rank"
    cause: str              # what killed it, in a few words (common.ray_utils.death_cause)
    actor: int = -1         # its index in its pool; -1 when not known
    seconds: Optional[float] = None  # until it was back and ready; None when not timed
    during: Optional[str] = None     # what it was doing ("the weight push", "train_step")

    def line(self, step: int) -> str:
        """The driver's one line for it (printed, not logged)."""
        who = self.role + (f" {self.actor}" if self.actor >= 0 else "")
        during = f" during {self.during}" if self.during else ""
        back = f"; back in {self.seconds:.1f} s" if self.seconds is not None else ""
        return f"step {step}: {who} died{during}: {self.cause}{back}"


@dataclass(frozen=True)
class StepRecord:
    """One GRPO step as the loop commits it: the metrics row it logs, the restarts it prints and
    the identifiers of the samples it trained (cluster/loop/samples.py)."""
    metrics: Dict[str, Any]
    events: Tuple[RestartEvent, ...] = ()
    samples: List[list] = field(default_factory=list)

    @property
    def policy_version(self) -> int:
        return self.metrics["policy_version"]


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt for a generation backend to sample a group for; the driver builds it from a
    data row (cluster/loop/batches.py), the group it yields carries its index, prompt, answer and
    fields on to the verifiers and the learner."""
    index: int
    """Position of the prompt in its split (the training or the evaluation set)."""
    prompt: str
    """The rendered text the engine continues."""
    answer: Optional[str]
    fields: Mapping[str, Any] = field(hash=False)
    """The row's other columns, for the verifiers (`tests` for code, `language`, ...)."""
    seed: int
    """The prompt's seed in its round (common.seeds.prompt_seed): its samples are the same
    whichever worker draws it."""


@dataclass(frozen=True)
class ChunkReport:
    """The last return value of one chunk's call to a pool actor; the items' own results (prompt
    groups, scored groups, outcomes) are the return values before it, each owned by the caller.
    common/dispatch.py merges the reports of a batch's chunks."""
    stats: Mapping[str, float] = field(default_factory=dict, hash=False)
    """Counts and sums over the chunk's items, summed over the chunks."""
    versions: Tuple[int, ...] = ()
    """Generation: the policy version that sampled each item's group."""
    informative: Tuple[bool, ...] = ()
    """Scoring: whether each group's rewards differ (all equal: zero advantage, nothing learnt)."""
    records: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Things worth showing once (an agent's first error, a session's first template drift):
    of each name, the first chunk's is kept."""


@dataclass(frozen=True)
class StreamReport:
    """The last value a streaming generation call (`advance`) yields, after the groups that
    finished during it, in the order they finished."""
    tickets: Tuple[int, ...] = ()
    """The driver's ticket of each finished group's request, in the order the groups came."""
    versions: Tuple[int, ...] = ()
    """The oldest policy version among each group's tokens (its `policy_version`)."""
    newest: Tuple[int, ...] = ()
    """The newest policy version among each group's tokens."""
    lengths: Tuple[Tuple[int, ...], ...] = ()
    """Each group's completion lengths in tokens."""
    version_tokens: Tuple[Tuple[Tuple[int, int], ...], ...] = ()
    """Each group's (policy version, tokens sampled by it) pairs."""
    stats: Mapping[str, float] = field(default_factory=dict, hash=False)
    """Counts and sums over the call (completions, tokens, engine steps and their seconds)."""
    running: int = 0
    """Requests still in the engine after the call."""


@dataclass(frozen=True)
class ScoringRequest:
    """One completion for the verifiers; each verifier is called with these four, in this order."""
    prompt: str
    completion: str
    answer: str
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The row's other columns (an episode's also hold its `transcript`)."""


@dataclass(frozen=True)
class Outcome:
    """One completion's scores: one per verifier, their weighted sum, and the verifiers that ran
    out of time on it or raised (scored 0)."""
    scores: Dict[str, float] = field(default_factory=dict, hash=False)
    reward: float = 0.0
    timed_out: List[str] = field(default_factory=list, hash=False)
    errors: List[str] = field(default_factory=list, hash=False)
    counts: Dict[str, float] = field(default_factory=dict, hash=False)
    """What a verifier counts about this completion besides its score (`judge_unparseable`)."""


# The driver's own state: what a run resolved before its roles start, and what a checkpoint keeps.

@dataclass(frozen=True)
class PromptInfo:
    """How the prompts were rendered (the prompts module's `prepare`): what a run prints and saves
    (prompt_example.txt) and the warm-up's end of turn."""
    chat_template: bool                    # whether the chat template was applied
    first_prompt: str                      # the first training row as the model sees it
    stop_token_ids: Tuple[int, ...]        # the tokenizer's and the chat format's stops
    stop_tokens: Tuple[str, ...]           # those stops as tokens, for the run's output
    longest_prompt: Tuple[int, str]        # (tokens, "train row 7") of the longest rendered prompt
    turn_end_ids: Optional[Tuple[int, ...]] = None  # the chat format's end of turn; None: the EOS
    tools: Optional[str] = None            # how episodes run (tools, agent), for the output

    @classmethod
    def from_dict(cls, info: Dict[str, Any]) -> "PromptInfo":
        turn_end = info.get("turn_end_ids")
        tokens, where = info["longest_prompt"]
        return cls(chat_template=bool(info["chat_template"]), first_prompt=info["first_prompt"],
                   stop_token_ids=tuple(info["stop_token_ids"]), stop_tokens=tuple(info["stop_tokens"]),
                   longest_prompt=(tokens, where), turn_end_ids=tuple(turn_end) if turn_end else None,
                   tools=info.get("tools"))


@dataclass(frozen=True)
class ResolvedInputs:
    """What the driver resolved from the validated config before any actor starts, returned
    rather than written into that config: the roles get a copy of the config with these filled
    in (cluster/loop/launch.run_config)."""
    model_path: str                 # the model folder (built for the built-in model) or hub id
    stop_token_ids: Tuple[int, ...] # rollout.stop_token_ids joined with the prompts' stops, sorted
    prompts: PromptInfo


STATE_FILE = "trainer_state.json"
"""A checkpoint's TrainerState, written last: a folder holding it is complete."""


@dataclass(frozen=True)
class TrainerState:
    """The driver's part of a checkpoint, trainer_state.json (cluster/loop/checkpoint.py). The file's
    keys are these fields in this order."""
    step: int
    policy_version: int = 0
    sampler: Dict[str, Any] = field(default_factory=dict)  # the PromptSampler's state_dict
    accuracy_before: float = 0.0    # held-out greedy accuracy GRPO started from
    seed: int = 0                   # trainer.seed of the run that wrote it
    rng: Optional[Dict[str, Any]] = None  # the driver's Python/NumPy/torch RNG states

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_json(cls, text: str) -> "TrainerState":
        return cls(**json.loads(text))
