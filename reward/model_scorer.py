"""The Scorer of a verifier actor when some verifiers are models (`reward_model`, `judge`): the rule
verifiers run in the usual killable child process (reward/scorer.py), each model verifier's texts
go to its own pool of actors (reward/reward_model.py, reward/judge.py), and every outcome's
reward is the weighted sum of all of them (`reward.weights`).

A batch is cut into one share per model actor, sent to all at once and awaited together up to the
verifier's `timeout_s`; a share not back by then scores 0 for that verifier and is counted as timed
out. An actor that dies mid-share is restarted by Ray and the share runs again on it
(`max_task_retries`), so each completion gets one score.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import ray

from common.config import RewardConfig
from common.messages import Outcome, ScoringRequest
from reward.registry import MODEL_VERIFIERS, combine
from reward.reward_model import model_text
from reward.verdicts import judge_prompt, parse_verdict, verdict_regex

__all__ = ["ModelBackedScorer"]


class ModelBackedScorer:
    """A Scorer (common/backends.py) over the rule verifiers (in `make_scorer`'s scorer) and the
    model verifiers, whose actors `model_workers` holds by verifier name."""

    def __init__(self, make_scorer: Callable[[RewardConfig, Sequence[str]], Any],
                 model_workers: Dict[str, Sequence[Any]], settings: RewardConfig, search_path: Sequence[str] = ()):
        self.settings = settings
        self.model_workers = {name: list(workers) for name, workers in model_workers.items()}
        rules = [n for n in dict.fromkeys(settings.verifiers) if n not in MODEL_VERIFIERS]
        self.rules = make_scorer(dataclasses.replace(settings, verifiers=rules), search_path) if rules else None
        self._next = 0  # the first actor of the next batch's shares: spreads the verifier actors' calls
        self._verdict = verdict_regex(settings.judge) if "judge" in model_workers else None

    @property
    def restarts(self) -> int:
        return self.rules.restarts if self.rules is not None else 0

    @property
    def pid(self) -> int:
        return self.rules.pid if self.rules is not None else os.getpid()

    def _inputs(self, name: str, items: Sequence[ScoringRequest]) -> List[str]:
        if name == "judge":
            return [judge_prompt(self.settings.judge.template, r.prompt, r.completion, r.answer) for r in items]
        return [model_text(r.prompt, r.completion) for r in items]

    def _submit(self, name: str, texts: List[str]):
        workers = self.model_workers[name]
        size = max(1, math.ceil(len(texts) / len(workers)))
        shares = []
        for start in range(0, len(texts), size):
            worker = workers[(self._next + start // size) % len(workers)]
            call = worker.judge if name == "judge" else worker.score
            shares.append((start, len(texts[start:start + size]), call.remote(texts[start:start + size])))
        return shares

    def score(self, requests: Sequence[ScoringRequest]) -> List[Outcome]:
        items = list(requests)
        if not items:
            return []
        submitted = {name: self._submit(name, self._inputs(name, items)) for name in self.model_workers}
        self._next += 1
        outcomes = self.rules.score(items) if self.rules is not None else [Outcome() for _ in items]
        refs = [ref for shares in submitted.values() for _, _, ref in shares]
        timeout = max(self.settings.model.timeout_s if "reward_model" in submitted else 0.0,
                      self.settings.judge.timeout_s if "judge" in submitted else 0.0)
        done = set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0])
        results: Dict[str, List[Optional[Any]]] = {}
        for name, shares in submitted.items():
            values: List[Optional[Any]] = [None] * len(items)
            for start, count, ref in shares:
                if ref in done:
                    values[start:start + count] = ray.get(ref)
                else:
                    ray.cancel(ref)
            results[name] = values
        return [self._outcome(outcome, {name: values[i] for name, values in results.items()})
                for i, outcome in enumerate(outcomes)]

    def _outcome(self, outcome: Outcome, got: Dict[str, Optional[Any]]) -> Outcome:
        scores, timed_out, counts = dict(outcome.scores), list(outcome.timed_out), dict(outcome.counts)
        for name, value in got.items():
            if value is None:
                scores[name] = 0.0
                timed_out.append(name)
            elif name == "judge":
                verdict = parse_verdict(value, self.settings.judge, self._verdict)
                if verdict is None:
                    counts["judge_unparseable"] = counts.get("judge_unparseable", 0.0) + 1.0
                    verdict = self.settings.judge.unparseable_score
                scores[name] = verdict
            else:
                scores[name] = float(value)
        return dataclasses.replace(outcome, scores=scores, timed_out=timed_out, counts=counts,
                                   reward=combine(scores, self.settings.weights))
