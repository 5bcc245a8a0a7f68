"""Evaluation metrics over n samples per prompt: pass@k, maj@k, greedy accuracy, lengths.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of which c are correct,
the chance that k drawn without replacement include a correct one, 1 - C(n-c, k) / C(n, k).
pass@1 is then the mean correctness over the samples.

maj@k votes among k samples' extracted answers (answers compared after removing whitespace;
samples with no answer do not vote), averaged over the n // k disjoint runs of k samples. A tie between t answers counts as the chance
of picking the right one uniformly among them (1/t if one of them is right): the same number
for any order of the samples, never a bias towards the first.
"""
from __future__ import annotations

from collections import Counter
from math import comb
from typing import Dict, List, Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _vote_key(answer: Optional[str]) -> Optional[str]:
    return None if answer is None else "".join(answer.split())


def maj_at_k(answers: Sequence[Optional[str]], correct: Sequence[bool], k: int) -> float:
    """Majority vote over k samples, averaged over the n // k disjoint runs of k samples that n
    samples hold (all samples are drawn alike, so each run is an equally good vote; maj@1 is
    then pass@1). Ties split evenly (see the module's note)."""
    if not 1 <= k <= len(correct):
        raise ValueError(f"maj@k needs 1 <= k <= n (n={len(correct)}, k={k})")
    runs = len(correct) // k
    return sum(_vote(answers[i * k:(i + 1) * k], correct[i * k:(i + 1) * k]) for i in range(runs)) / runs


def _vote(answers: Sequence[Optional[str]], correct: Sequence[bool]) -> float:
    votes: Counter = Counter()
    right = set()
    for answer, ok in zip(answers, correct):
        key = _vote_key(answer)
        if key is None:
            continue
        votes[key] += 1
        if ok:
            right.add(key)
    if not votes:
        return 0.0
    top = max(votes.values())
    leaders = [key for key, count in votes.items() if count == top]
    return sum(key in right for key in leaders) / len(leaders)


def default_ks(n: int, ks: Sequence[int]) -> List[int]:
    return sorted(set(ks)) if ks else sorted({1, n})


def prompt_metrics(answers: Sequence[Optional[str]], correct: Sequence[bool], ks: Sequence[int]) -> Dict[str, float]:
    """pass@k and maj@k of one prompt's samples."""
    n, c = len(correct), sum(map(bool, correct))
    out = {}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(n, c, k)
        out[f"maj@{k}"] = maj_at_k(answers, correct, k)
    return out


def mean_metrics(rows: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """The mean of each metric over prompts."""
    if not rows:
        return {}
    return {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}


def format_table(metrics: Dict[str, float]) -> str:
    """One line per metric, in a stable order: greedy, pass@k, maj@k, the rest."""
    def order(key: str):
        name = key.split("/", 1)[-1]
        kind = 0 if name.startswith("greedy") else 1 if name.startswith("pass@") else 2 if name.startswith("maj@") else 3
        k = int(name.split("@")[1]) if "@" in name else 0
        return kind, k, name

    width = max(len(k) for k in metrics) if metrics else 0
    lines = []
    for key in sorted(metrics, key=order):
        value = metrics[key]
        shown = f"{value:.1%}" if key.split("/")[-1].startswith(("greedy", "pass@", "maj@", "truncated")) else f"{value:.1f}"
        lines.append(f"  {key:<{width}}  {shown}")
    return "\n".join(lines)
