"""The stateless verifier pool: Ray actors that score prompt groups by reference.

Each actor fetches the groups it is given, adds per-verifier scores and the weighted reward,
puts the scored group back in the object store and returns the new reference with a few
summary numbers. Scoring is a pure function of the text, so any actor can score any batch.
`reward/` imports no other room: the groups are read by attribute (prompt, completions, answer).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import ray

from reward.verifiers import score_completion


def _empty_stats(verifiers: Sequence[str]) -> Dict[str, float]:
    stats = {"completions": 0.0, "reward_sum": 0.0, "reward_sq_sum": 0.0, "uniform_groups": 0.0}
    stats.update({f"score_sum/{name}": 0.0 for name in verifiers})
    return stats


class VerifierWorker:
    def __init__(self, verifiers: List[str], weights: Dict[str, float]):
        self.verifiers = list(verifiers)
        self.weights = dict(weights)

    def score(self, group_refs: List[ray.ObjectRef]) -> Tuple[List[ray.ObjectRef], Dict[str, float]]:
        stats = _empty_stats(self.verifiers)
        scored = []
        for group in ray.get(list(group_refs)):
            group.rewards, group.scores = [], {name: [] for name in self.verifiers}
            for completion in group.completions:
                reward, scores = score_completion(completion, group.answer, self.verifiers, self.weights)
                group.rewards.append(reward)
                for name, value in scores.items():
                    group.scores[name].append(value)
                    stats[f"score_sum/{name}"] += value
                stats["completions"] += 1
                stats["reward_sum"] += reward
                stats["reward_sq_sum"] += reward * reward
            # A group whose rewards are all equal has zero advantage: it teaches nothing.
            stats["uniform_groups"] += float(len(set(group.rewards)) <= 1)
            scored.append(ray.put(group))
        return scored, stats


class VerifierPool:
    def __init__(self, verifiers: List[str], weights: Dict[str, float], num_workers: int, num_cpus: float):
        actor = ray.remote(num_cpus=num_cpus)(VerifierWorker)
        self.verifiers = list(verifiers)
        self.workers = [actor.remote(verifiers, weights) for _ in range(num_workers)]

    def score(self, group_refs: Sequence[ray.ObjectRef]) -> Tuple[List[ray.ObjectRef], Dict[str, float]]:
        """Scored group refs (same order) and summed stats over every completion."""
        num = len(self.workers)
        calls = []
        for w, worker in enumerate(self.workers):
            positions = list(range(w, len(group_refs), num))
            if positions:
                calls.append((positions, worker.score.remote([group_refs[i] for i in positions])))
        scored: List[ray.ObjectRef] = [None] * len(group_refs)  # type: ignore[list-item]
        total = _empty_stats(self.verifiers)
        for positions, call in calls:
            refs, stats = ray.get(call)
            for i, ref in zip(positions, refs):
                scored[i] = ref
            for key, value in stats.items():
                total[key] += value
        return scored, total

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)


def summarize(stats: Dict[str, float], verifiers: Sequence[str]) -> Dict[str, float]:
    """Means of the summed stats: reward_mean, reward_std, per-verifier pass rates."""
    n = max(stats["completions"], 1.0)
    mean = stats["reward_sum"] / n
    out = {
        "reward_mean": mean,
        "reward_std": max(stats["reward_sq_sum"] / n - mean * mean, 0.0) ** 0.5,
        "uniform_groups": stats["uniform_groups"],
    }
    out.update({f"score/{name}": stats[f"score_sum/{name}"] / n for name in verifiers})
    return out
