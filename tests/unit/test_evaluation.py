"""pass@k and maj@k (cluster/loop/evaluation.py) against hand-worked numbers and brute force."""
from __future__ import annotations

from itertools import combinations

import pytest

from cluster.loop.evaluation import default_ks, format_table, maj_at_k, mean_metrics, pass_at_k, prompt_metrics


def test_pass_at_k_hand_worked():
    # n=4, c=1: one draw finds it 1/4 of the time; two draws: 1 - C(3,2)/C(4,2) = 1 - 3/6.
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)/C(5,2)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(3, 3, 1) == 1.0


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_brute_force_enumeration(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            draws = list(combinations(range(n), k))
            brute = sum(any(samples[i] for i in d) for d in draws) / len(draws)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_impossible_counts():
    for args in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*args)


def test_maj_at_k_majority_ties_and_no_answers():
    # 3 votes for "7" (right), 1 for "8": the majority is right.
    assert maj_at_k(["7", "8", "7", "7"], [True, False, True, True], 4) == 1.0
    # 2-2 tie between a right and a wrong answer: half a point, whatever the order.
    assert maj_at_k(["7", "8", "8", "7"], [True, False, False, True], 4) == 0.5
    assert maj_at_k(["8", "7", "7", "8"], [False, True, True, False], 4) == 0.5
    # three-way tie with one right answer: a third.
    assert maj_at_k(["1", "2", "3"], [False, True, False], 3) == pytest.approx(1 / 3)
    # whitespace does not split a vote; samples with no answer do not vote.
    assert maj_at_k([" 7", "7 ", None, "8"], [True, True, False, False], 4) == 1.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def test_maj_at_k_averages_disjoint_runs_and_maj_at_1_is_pass_at_1():
    answers, correct = ["7", "8", "7", "9"], [True, False, True, False]
    assert maj_at_k(answers, correct, 1) == pytest.approx(pass_at_k(4, 2, 1))
    # runs [7, 8] (tie: 1/2) and [7, 9] (tie: 1/2)
    assert maj_at_k(answers, correct, 2) == pytest.approx(0.5)


def test_prompt_metrics_mean_and_table():
    rows = [prompt_metrics(["1", "1"], [True, True], [1, 2]), prompt_metrics(["2", "3"], [False, False], [1, 2])]
    assert rows[0] == {"pass@1": 1.0, "maj@1": 1.0, "pass@2": 1.0, "maj@2": 1.0}
    mean = mean_metrics(rows)
    assert mean == {"pass@1": 0.5, "maj@1": 0.5, "pass@2": 0.5, "maj@2": 0.5}
    table = format_table({f"eval/{k}": v for k, v in mean.items()} | {"eval/greedy": 0.25, "eval/mean_length": 12.5})
    lines = [line.split()[0] for line in table.splitlines()]
    assert lines == ["eval/greedy", "eval/pass@1", "eval/pass@2", "eval/maj@1", "eval/maj@2", "eval/mean_length"]
    assert "25.0%" in table and "12.5" in table
    assert default_ks(8, []) == [1, 8] and default_ks(8, [4, 2, 4]) == [2, 4]
