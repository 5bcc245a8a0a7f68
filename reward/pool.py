"""The stateless verifier pool: Ray actors that score prompt groups (or plain rows) by reference.

Work is cut into chunks and handed to whichever actor is free, so the pool finishes when the
work does, not when the unluckiest fixed share does. Each actor owns a Scorer (a killable child
process with a hard limit per verifier call; any Scorer of common/backends.py would do). Each chunk's scored groups come back as the
task's own return values, owned by the caller: an actor that dies later loses nothing already
scored. Actors restart on failure (`max_restarts=-1`) and Ray re-runs the call that was in
flight (`max_task_retries`); scoring is a pure function of the text, so a re-run gives the same
scores and each completion ends up with exactly one.
`reward/` imports no other room but the ground-floor dispatcher: groups are read and written by
attribute (prompt, completions, answer, fields; rewards, scores, timed_out).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import ray

from common.backends import Scorer
from common.config import RewardConfig
from common.dispatch import Dispatched, as_list, chunk_size, dispatch
from common.messages import ChunkReport, Outcome, ScoringRequest
from reward.scorer import VerifierScorer

TASK_RETRIES = 3
"""Re-runs of one chunk after its actor died (each on the restarted actor)."""


def empty_stats(names: Sequence[str]) -> Dict[str, float]:
    stats = {"completions": 0.0, "reward_sum": 0.0, "reward_sq_sum": 0.0, "uniform_groups": 0.0,
             "timeouts": 0.0, "errors": 0.0, "actor_restarts": 0.0, "scorer_restarts": 0.0}
    for name in names:
        stats.update({f"score_sum/{name}": 0.0, f"pass_sum/{name}": 0.0, f"timeouts/{name}": 0.0})
    return stats


def _add_outcome(stats: Dict[str, float], outcome: Outcome) -> None:
    stats["completions"] += 1
    stats["reward_sum"] += outcome.reward
    stats["reward_sq_sum"] += outcome.reward * outcome.reward
    stats["timeouts"] += len(outcome.timed_out)
    stats["errors"] += len(outcome.errors)
    for name, score in outcome.scores.items():
        stats[f"score_sum/{name}"] += score
        stats[f"pass_sum/{name}"] += float(score >= 1.0)
    for name in outcome.timed_out:
        stats[f"timeouts/{name}"] += 1
    for key, value in outcome.counts.items():  # judge_unparseable
        stats[key] = stats.get(key, 0.0) + value


def _add_task_score(stats: Dict[str, float], fields: Mapping[str, Any], outcome: Outcome) -> None:
    """A reasoning-gym row's score under its own task's column as well (data.tasks mixes them)."""
    task = fields.get("task") if "reasoning_gym" in outcome.scores else None
    if task:
        stats[f"task_sum/{task}"] = stats.get(f"task_sum/{task}", 0.0) + outcome.scores["reasoning_gym"]
        stats[f"task_n/{task}"] = stats.get(f"task_n/{task}", 0.0) + 1.0


class VerifierWorker:
    """One pool actor: fetches work, scores it in its Scorer process, returns it."""

    def __init__(self, settings: RewardConfig, search_path: Sequence[str],
                 make_scorer: Callable[[RewardConfig, Sequence[str]], Scorer] = VerifierScorer):
        self.names = list(dict.fromkeys(settings.verifiers))
        self.scorer: Scorer = make_scorer(settings, search_path)
        # Reported once, by the first call after Ray brought this actor back.
        self._restarted = ray.get_runtime_context().was_current_actor_reconstructed

    def _stats(self) -> Dict[str, float]:
        stats = empty_stats(self.names)
        stats["actor_restarts"] = float(self._restarted)
        self._restarted = False
        return stats

    def score_groups(self, *groups) -> Tuple[Any, ...]:
        """Scored copies of the groups (rewards, per-verifier scores, timed-out names per
        completion), then a ChunkReport (summed stats, which groups are informative): one
        return value each."""
        stats, informative = self._stats(), []
        restarts = self.scorer.restarts
        requests = [ScoringRequest(g.prompt, c, g.answer, fields)
                    for g in groups for c, fields in zip(g.completions, _fields(g))]
        outcomes = iter(self.scorer.score(requests))
        for group in groups:
            mine = [next(outcomes) for _ in group.completions]
            group.rewards = [o.reward for o in mine]
            group.scores = {name: [o.scores[name] for o in mine] for name in self.names}
            group.timed_out = [list(o.timed_out) for o in mine]
            for outcome, fields in zip(mine, _fields(group)):
                _add_outcome(stats, outcome)
                _add_task_score(stats, fields, outcome)
            # A group whose rewards are all equal has zero advantage: it teaches nothing.
            uniform = len(set(group.rewards)) <= 1
            stats["uniform_groups"] += float(uniform)
            informative.append(not uniform)
        stats["scorer_restarts"] = float(self.scorer.restarts - restarts)
        return (*groups, ChunkReport(stats, informative=tuple(informative)))

    def score_items(self, *requests: ScoringRequest) -> Tuple[Any, ...]:
        """One Outcome per request, then a ChunkReport (the summed stats)."""
        stats = self._stats()
        restarts = self.scorer.restarts
        outcomes = self.scorer.score(requests)
        for outcome, request in zip(outcomes, requests):
            _add_outcome(stats, outcome)
            _add_task_score(stats, request.fields, outcome)
        stats["scorer_restarts"] = float(self.scorer.restarts - restarts)
        return (*outcomes, ChunkReport(stats))

    def pid(self) -> int:
        import os

        return os.getpid()

    def scorer_pid(self) -> int:
        return self.scorer.pid


class VerifierPool:
    def __init__(self, settings: RewardConfig, placement=None, search_path: Optional[Sequence[str]] = None,
                 make_scorer: Callable[[RewardConfig, Sequence[str]], Scorer] = VerifierScorer):
        """`settings.num_workers` actors, each scoring with `make_scorer(settings, search_path)`;
        `placement(i)`: Ray actor options for actor i (its placement group bundle); custom
        verifiers import from `search_path` first (default: the driver's working directory, where
        a user's `rewards.py` sits)."""
        actor = ray.remote(num_cpus=settings.num_cpus_per_worker, max_restarts=-1,
                           max_task_retries=TASK_RETRIES)(VerifierWorker)
        self.settings = settings
        self._next = 0  # the actor `submit` uses next
        self.names = list(dict.fromkeys(settings.verifiers))
        path = [os.getcwd()] if search_path is None else list(search_path)
        self.workers = [actor.options(**(placement(i) if placement else {})).remote(settings, path, make_scorer)
                        for i in range(settings.num_workers)]
        self.model_pools: List[Any] = []
        """Pools of model actors the scorers call (reward/reward_model.py, reward/judge.py): stopped with it."""

    def ready(self) -> None:
        """Block until every actor has started its scorer process (raises if one cannot)."""
        ray.get([w.pid.remote() for w in self.workers])
        for pool in self.model_pools:
            pool.ready()

    def _dispatch(self, method: str, payload: Sequence[Any], chunks_per_worker: int = 4):
        """Run `method` over `payload` in chunks on whichever worker is free: (one result ref
        per payload entry, in order; summed stats)."""
        def submit(worker, items):
            return as_list(getattr(worker, method).options(num_returns=len(items) + 1).remote(*items))

        return dispatch(self.workers, submit, payload, chunk_size(len(payload), len(self.workers), chunks_per_worker),
                        empty_stats(self.names))

    def submit(self, group_refs: Sequence[ray.ObjectRef]) -> Tuple[List[ray.ObjectRef], ray.ObjectRef]:
        """Score these groups on the next actor, without waiting: (scored group refs, a ref to
        their stats). Ray runs the call once the groups exist, so a chunk is scored while the
        rest of the batch is still being generated; a restarted actor re-runs it."""
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        refs = as_list(worker.score_groups.options(num_returns=len(group_refs) + 1).remote(*group_refs))
        return refs[:-1], refs[-1]

    def gather(self, pending: Sequence[Tuple[Sequence[int], Sequence[ray.ObjectRef], ray.ObjectRef]],
               n: int) -> Dispatched:
        """A batch of n groups scored by `submit` calls, given each call's positions in the
        batch, its scored group refs and its report ref: the refs in order, the summed stats,
        which groups are informative."""
        scored = Dispatched.empty(n, empty_stats(self.names))
        for positions, refs, report in pending:
            scored.add(ray.get(report), positions, refs)
        return scored

    def score(self, group_refs: Sequence[ray.ObjectRef]) -> Tuple[List[ray.ObjectRef], Dict[str, float]]:
        """Scored group refs (same order) and summed stats over every completion."""
        scored = self._dispatch("score_groups", list(group_refs))
        return scored.refs, scored.stats

    def score_items(self, requests: Sequence[ScoringRequest]) -> Tuple[List[Outcome], Dict[str, float]]:
        """Outcomes of plain requests, fetched (for `grpo verify`)."""
        scored = self._dispatch("score_items", list(requests))
        return ray.get(scored.refs), scored.stats

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        for pool in self.model_pools:
            pool.shutdown()


def summarize(stats: Mapping[str, float], names: Sequence[str]) -> Dict[str, float]:
    """Per-step metrics from summed stats: reward mean/std, per-verifier mean score and pass
    rate, timeouts (per verifier too), errors, restarts."""
    n = max(stats["completions"], 1.0)
    mean = stats["reward_sum"] / n
    out = {
        "reward_mean": mean,
        "reward_std": max(stats["reward_sq_sum"] / n - mean * mean, 0.0) ** 0.5,
        "uniform_groups": stats["uniform_groups"],
        "reward_timeouts": stats["timeouts"],
        "reward_errors": stats["errors"],
        "actor_restarts": stats["actor_restarts"],
        "scorer_restarts": stats["scorer_restarts"],
    }
    for name in dict.fromkeys(names):
        out[f"score/{name}"] = stats[f"score_sum/{name}"] / n
        out[f"pass/{name}"] = stats[f"pass_sum/{name}"] / n
        out[f"reward_timeouts/{name}"] = stats[f"timeouts/{name}"]
    if "judge" in names:
        out["judge_unparseable"] = stats.get("judge_unparseable", 0.0)
    for key, count in stats.items():
        if key.startswith("task_n/") and count:
            task = key[len("task_n/"):]
            out[f"task_score/{task}"] = stats[f"task_sum/{task}"] / count
    return out


def _fields(group) -> list:
    """Each completion's row fields; an episode's also hold its `transcript` (model turns and
    tool results), for verifiers that want more than the model's own text."""
    fields = getattr(group, "fields", {}) or {}
    transcripts = getattr(group, "transcripts", None)
    if transcripts is None:
        return [fields] * group.group_size
    return [{**fields, "transcript": t} for t in transcripts]
