"""The streaming batch source's bookkeeping (cluster/loop/streaming.py), with engines whose
completions take a scripted number of calls: which groups form a step, DAPO's extra rounds,
stale groups issued again, a worker lost mid-call, a checkpoint of what was made ahead. The
real engines, pushes and resume run in tests/integration/test_streaming.py and tests/e2e.
"""
from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field

import pytest
import ray

from cluster.loop import streaming
from common.config import Config
from common.messages import ChunkReport, StreamReport


class Sampler:
    def __init__(self):
        self.position = 0

    def next_batch(self, n):
        out = [(self.position + i, types.SimpleNamespace(prompt=f"p{self.position + i}", answer="0", fields={}))
               for i in range(n)]
        self.position += n
        return out

    def state_dict(self):
        return {"position": self.position}


@dataclass
class FakePool:
    """Workers whose request for prompt i runs `calls(i)` calls before it finishes; `die` makes a
    worker's next call fail once. Groups are plain dicts (the 'refs' of these tests)."""
    workers: list
    calls: object
    version: int = 0
    carried: dict = field(default_factory=dict)
    died: list = field(default_factory=list)
    die: set = field(default_factory=set)
    pause_stream: object = None
    recover: object = True
    _submitting: object = field(default_factory=threading.RLock)

    def advance(self, w, requests, tickets, n, return_after):
        if w in self.die:
            self.die.discard(w)
            self.carried = {k: v for k, v in self.carried.items() if v[0] != w}
            raise ray.exceptions.RayActorError()
        for t, r in zip(tickets, requests):
            self.carried[t] = [w, r, self.calls(r.index), self.version]
        finished = []
        for t, entry in list(self.carried.items()):
            if entry[0] != w:
                continue
            entry[2] -= 1
            if entry[2] <= 0:
                finished.append((t, entry))
                del self.carried[t]
        groups = [{"index": e[1].index, "seed": e[1].seed, "oldest": e[3], "newest": self.version}
                  for _, e in finished]
        report = StreamReport(tickets=tuple(t for t, _ in finished), versions=tuple(e[3] for _, e in finished),
                              newest=(self.version,) * len(finished),
                              lengths=tuple((4 * e[1].index + 1,) * n for _, e in finished),
                              version_tokens=tuple(((e[3], 1),) for _, e in finished),
                              stats={"completion_tokens": 1.0, "sampled_tokens": 1.0, "engine_steps": 1.0,
                                     "engine_slots": 4.0})
        return iter([*groups, report])

    def _restarted(self, w):
        self.died.append(w)

    def abort_stream(self):
        self.carried.clear()


class Verifiers:
    def __init__(self, informative=lambda group: True):
        self.informative = informative

    def submit(self, refs):
        return ([dict(group, scored=True) for group in refs],
                ChunkReport({"reward_sum": float(len(refs))}, informative=tuple(map(self.informative, refs))))


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Plain objects stand in for refs: ray.get gives them back."""
    fake = types.SimpleNamespace(get=lambda x, **_: x, exceptions=ray.exceptions)
    monkeypatch.setattr(streaming, "ray", fake)


def source(pool, verifiers=None, lookahead=1, last_step=4, ready=None, first_step=1, sampler=None, tools=(),
           **algo):
    cfg = Config()
    cfg.rollout.tools = list(tools)
    cfg.trainer.prompts_per_step, cfg.algo.group_size = 4, 2
    cfg.rollout.streaming, cfg.rollout.stream_groups = True, 2
    for key, value in algo.items():
        setattr(cfg.algo, key, value)
    roles = types.SimpleNamespace(rollout=pool, verifiers=verifiers or Verifiers(),
                                  channel=types.SimpleNamespace(version=0))
    return streaming.StreamingBatches(roles, sampler or Sampler(), cfg, first_step, last_step, lookahead, ready), roles


def test_a_step_is_its_issued_prompts_in_order_whatever_finishes_first():
    # Prompt 0 of each step is slow: later prompts finish first, the step still waits for it.
    pool = FakePool(workers=[0, 1], calls=lambda i: 5 if i % 4 == 0 else 1)
    batches, _ = source(pool)
    try:
        for step in (1, 2, 3):
            batch = batches.next(step)
            assert [r.index for r in batch.items] == [4 * (step - 1) + i for i in range(4)]
            assert [g["index"] for g in batch.refs] == [r.index for r in batch.items]
            assert batch.sampler_state == {"position": 4 * (step - 1)}
            assert batch.metrics["completions"] == 8
            assert batch.metrics["completion_len_trained_max"] == 4 * batch.items[-1].index + 1
    finally:
        batches.close()


def test_dynamic_sampling_issues_extra_rounds_for_the_step():
    pool = FakePool(workers=[0], calls=lambda i: 1)
    batches, _ = source(pool, Verifiers(lambda g: g["index"] % 2 == 0), dynamic_sampling=True,
                        max_sampling_rounds=3)
    try:
        batch = batches.next(1)
        # Round 0 gives 0 and 2, round 1 draws two more (4, 5), round 2 one (6), as `collect` does.
        assert [r.index for r in batch.items] == [0, 2, 4, 6]
        assert batch.metrics["sampling_rounds"] == 3 and batch.metrics["dynamic_filled"] == 0
    finally:
        batches.close()


def test_stale_groups_are_dropped_counted_and_issued_again():
    pool = FakePool(workers=[0], calls=lambda i: 1)
    batches, roles = source(pool, lookahead=2, max_staleness=1)
    try:
        with batches.cond:
            batches._wait(lambda: all(t.done for t in batches.steps[2].tickets))
            first_seeds = {t.request.seed for t in batches.steps[2].tickets}
        roles.channel.version = 2  # the learner moved on twice before step 2 was trained
        pool.version = 2
        batches.next(1)
        batch = batches.next(2)
        assert batch.metrics["dropped_stale"] == 4 and batch.versions == [2] * 4
        assert [r.index for r in batch.items] == [4, 5, 6, 7]
        assert {g["seed"] for g in batch.refs}.isdisjoint(first_seeds)  # the regeneration round's seeds
    finally:
        batches.close()


def test_a_lost_worker_s_requests_run_again_exactly_once():
    # Each worker's first call fails once: which worker's feeder takes work first is up to the
    # threads, so at least one loss happens whatever the order.
    pool = FakePool(workers=[0, 1], calls=lambda i: 2, die={0, 1})
    batches, _ = source(pool)
    try:
        seen = [r.index for step in (1, 2, 3, 4) for r in batches.next(step).items]
        assert seen == list(range(16))
        assert pool.died and len(pool.died) == len(set(pool.died)) and set(pool.died) <= {0, 1}
    finally:
        batches.close()


def test_a_checkpoint_holds_the_steps_made_ahead_and_a_resume_trains_them():
    pool = FakePool(workers=[0], calls=lambda i: 3)
    batches, _ = source(pool, lookahead=2)
    batches.next(1)
    made, sampler_state = batches.ahead_state()
    assert [step for step, _ in made] == [2, 3] and sampler_state == {"position": 12}
    first = [r.index for r in batches.next(2).items]
    batches.close()
    sampler = Sampler()
    sampler.position = sampler_state["position"]
    resumed, _ = source(FakePool(workers=[0], calls=lambda i: 1), lookahead=2, ready=made, first_step=2,
                        sampler=sampler)
    try:
        assert [r.index for r in resumed.next(2).items] == first
        assert [r.index for r in resumed.next(3).items] == [8, 9, 10, 11]
        assert [r.index for r in resumed.next(4).items] == [12, 13, 14, 15]
    finally:
        resumed.close()


def test_a_push_without_partial_rollouts_waits_for_running_requests():
    pool = FakePool(workers=[0], calls=lambda i: 3)
    batches, _ = source(pool)
    try:
        assert pool.pause_stream is not None
        with pool.pause_stream():
            assert not pool.carried  # nothing runs in the engines during the push
        assert [r.index for r in batches.next(1).items] == [0, 1, 2, 3]
    finally:
        batches.close()


def test_lag_and_length_metrics():
    assert streaming.lag_metrics({3: 30, 4: 10}, 4) == {"token_lag_mean": 0.75, "token_lag_max": 1.0,
                                                         "tokens_lag_0": 10.0, "tokens_lag_1": 30.0}
    assert streaming.length_stats("x", [1, 2, 3, 4, 100]) == {"x_mean": 22.0, "x_p90": 4.0, "x_max": 100.0}
    assert streaming.lag_metrics({}, 1) == {}


def test_version_spans_of_a_completion():
    from rollout.worker import version_spans

    span = types.SimpleNamespace
    done = span(token_ids=[1, 2, 3, 4, 5], weight_versions=[span(version="3", start=0, end=2),
                                                            span(version="4", start=2, end=5)])
    assert version_spans(done, 9) == [(3, 0, 2), (4, 2, 5)]
    assert version_spans(span(token_ids=[1, 2], weight_versions=None), 7) == [(7, 0, 2)]


def test_partial_rollouts_refused_where_they_cannot_run():
    from common.config import ConfigError

    def check(**sections):
        cfg = Config()
        for dotted, value in sections.items():
            section, key = dotted.split("__")
            setattr(getattr(cfg, section), key, value)
        with pytest.raises(ConfigError) as error:
            cfg.check()
        return str(error.value)

    assert "trainer.mode=async" in check(rollout__streaming=True)
    assert "rollout.streaming" in check(rollout__partial=True, trainer__mode="async")
    assert "max_staleness=0" in check(rollout__partial=True, rollout__streaming=True, trainer__mode="async",
                                      algo__max_staleness=0)
    assert "adapter" in check(rollout__partial=True, rollout__streaming=True, trainer__mode="async",
                              learner__lora=_lora())


def _lora():
    from common.config import LoraConfig

    lora = LoraConfig()
    lora.rank, lora.push = 8, "adapter"
    return lora



class EpisodeWorker:
    """A worker whose `generate` runs a call of episodes (tools or agents) to their end."""
    def __init__(self, calls: list):
        self.calls = calls
        self.generate = self

    def options(self, num_returns):
        return self

    def remote(self, *requests, n, greedy):
        self.calls.append([r.index for r in requests])
        return [*({"index": r.index} for r in requests),
                ChunkReport({"completion_tokens": 6.0 * n * len(requests)}, versions=(0,) * len(requests))]


def test_tool_episodes_and_agents_stream_by_the_episode():
    calls: list = []
    pool = FakePool(workers=[EpisodeWorker(calls)], calls=None)
    batches, _ = source(pool, tools=["calculator"])
    try:
        batch = batches.next(1)
        assert [r.index for r in batch.items] == [0, 1, 2, 3]
        assert batch.metrics["completion_tokens"] == 48 and batch.metrics["completions"] == 8
        assert all(len(call) <= 2 for call in calls)  # rollout.stream_groups episodes' prompts a call
    finally:
        batches.close()
