"""What the run needs of a generation backend and of a scorer: the contracts the pools, the
weight-sync channel and the episode loops are written against.

Today's implementations: rollout/worker.py's GenerationWorker (vLLM) with rollout/engine.py's
VllmStepEngine, and reward/scorer.py's VerifierScorer (verifiers in a killable child process). A
second backend (SGLang, a remote OpenAI-compatible server) or a model-based reward is one new
class that provides these methods; docs/development.md ("How to add") names the files it touches.
"""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence, Tuple

from common.messages import GenerationRequest, Outcome, ScoringRequest


class GenerationBackend(Protocol):
    """One generation engine, run as one Ray actor by rollout/pool.py's RolloutPool (one per
    `rollout.num_workers`) and fed new weights by the weight-sync channel.

    Built as `Backend(model_path, rollout_cfg, engine_seed)`; Ray restarts it when it dies, and
    the pool then calls `recover` (the channel re-joins it and pushes the current weights)."""

    def ready(self) -> int:
        """The policy version of the weights it holds (0: the initial ones). Answered between two
        calls only: the pool's `between_calls` waits on it for every worker to be idle."""

    def generate(self, *requests: GenerationRequest, n: int, greedy: bool,
                 temperature: Optional[float] = None) -> Tuple[Any, ...]:
        """`n` completions per request, sampled with its seed: one PromptGroup per request (its
        own Ray return value), then a ChunkReport (stats, the version of every group).
        `temperature` replaces rollout.temperature (evaluation's samples)."""

    def sync_ranks(self) -> int:
        """Members of the weight-sync group this engine brings (one per tensor-parallel rank)."""

    def node_ip(self) -> str:
        """The node it runs on (the channel uses shared memory when every engine is on the
        learner's node)."""

    def init_weight_sync(self, host: str, port: int, base_rank: int, world_size: int, timeout_s: float,
                         backend: str) -> None:
        """Join the weight-sync group at `host:port` as ranks `base_rank`.. (a torch.distributed
        group of `backend`, learner rank 0 its root)."""

    def receive_weights(self, wire_spec: dict, version: int) -> dict:
        """Load the weights the learner broadcasts (described by `wire_spec`, common/weight_sync.py);
        from the next call on, sample with them as `version`. Returns the timings
        (`policy_version`, `load_s`, `wait_s`)."""

    def pid(self) -> int:
        """Its process (tests and recovery kill engines by pid, as a cluster loses them)."""


class StepEngine(Protocol):
    """The request-level engine the multi-turn loops drive (rollout/episodes.py, the agents'
    endpoint in rollout/endpoint.py): requests join and leave a running batch between steps.

    Outputs have vLLM's RequestOutput shape: `request_id`, `finished`, and `outputs`, each with
    `token_ids`, `logprobs` (the chosen token's entry per step), `text`, `finish_reason` and
    `stop_reason`."""

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: Any) -> None:
        """Start sampling after `prompt_ids` with `params` (the backend's sampling parameters);
        raises when the engine refuses the request (too long, bad parameters)."""

    def step(self) -> List[Any]:
        """Advance every running request by one engine step; the outputs of this step."""


class Scorer(Protocol):
    """Scores completions for one verifier-pool actor (reward/pool.py's VerifierWorker)."""

    restarts: int
    """How often its scoring process was replaced (each after a timeout or a crash)."""

    @property
    def pid(self) -> int:
        """The process that runs the scoring (tests kill it)."""

    def score(self, requests: Sequence[ScoringRequest]) -> List[Outcome]:
        """Exactly one Outcome per request, in order; a slow or failing call scores 0 and is
        named in the outcome's `timed_out` or `errors`, never raised."""
