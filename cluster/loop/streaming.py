"""Streaming rollouts (rollout.streaming): a batch source beside SyncBatches and AsyncBatches,
behind the same `next(step)`.

Each generation worker is fed by a thread of its own: it hands the worker the next issued
prompts as the worker's requests finish (`RolloutPool.advance`, a short call of at most
`rollout.stream_steps` engine steps), so an engine's batch stays full instead of draining a
chunk down to its longest sample. Each group is handed to the verifier pool as soon as it ends.

Which groups form a step never depends on how fast they finished: the prompts of step s are
drawn from the sampler (and seeded) when step s enters the window of `trainer.async_lookahead`
steps ahead of the learner, and step s is exactly their groups, waiting for the slowest. No
sample is dropped for being slow; DAPO's dynamic sampling issues its extra rounds for the step,
and a group whose oldest token is more than `algo.max_staleness` versions old is dropped,
counted and its prompt issued again.

A weight push reaches the engines between two calls. Without rollout.partial it first waits
until the engines carry no running request (`drained`), so each sample has one version; with
it the requests keep running across the push, each keeping its KV cache (computed by the older
weights), and each sample records the versions of its spans (PromptGroup.version_spans).

A checkpoint waits until every step issued ahead of the learner is complete and saves those
batches (as AsyncBatches does): no partial sample is in flight in a checkpoint, and a resume
trains on exactly what the interrupted run made ahead. A worker lost mid-call loses the
requests it carried: they are issued again, with the same seeds, once Ray restarted it and the
pool gave it the current weights.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional

import ray

from cluster.loop.batches import (AGENT_STATS, ENGINE_COUNTS, TOOL_STATS, Batch, engine_metrics, episode_metrics, filled_batch,
                                  generation_requests, reseeded)
from common import seeds
from common.messages import GenerationRequest, RestartEvent, StreamReport
from common.ray_utils import death_cause


@dataclass
class _Ticket:
    """One issued prompt: its request and, once its group finished and was handed to the
    verifiers, what came back."""
    number: int
    step: int
    round: int
    request: GenerationRequest
    issued: float
    scored: Any = None
    """Ref of the scored group."""
    score_report: Any = None
    """Ref of the scoring call's ChunkReport (informative, reward stats)."""
    score_index: int = 0
    """The group's position in that call."""
    version: int = 0
    newest: int = 0
    lengths: tuple = ()
    version_tokens: tuple = ()
    episode_stats: Dict[str, float] = field(default_factory=dict)
    """Tool episodes and agents: the group's share of its call's turns, calls and failures."""
    dropped: bool = False
    """Superseded: stale, its prompt issued again."""

    @property
    def done(self) -> bool:
        return self.scored is not None


@dataclass
class _Step:
    step: int
    sampler_state: Dict[str, Any]
    tickets: List[_Ticket] = field(default_factory=list)
    rounds: int = 1
    informative: Dict[int, bool] = field(default_factory=dict)
    reward_stats: Dict[str, float] = field(default_factory=dict)
    counted: set = field(default_factory=set)
    """Scoring reports whose stats are in reward_stats."""
    stale: int = 0


class StreamingBatches:
    """The batch source of rollout.streaming (trainer.mode=async)."""

    def __init__(self, roles, sampler, cfg, first_step: int, last_step: int, lookahead: int,
                 ready: Optional[List[tuple]] = None):
        self.roles, self.sampler, self.cfg = roles, sampler, cfg
        self.pool = roles.rollout
        self.last_step, self.lookahead = last_step, lookahead
        self.n, self.size = cfg.algo.group_size, cfg.trainer.prompts_per_step
        self.cond = threading.Condition()
        self.queue: Deque[_Ticket] = deque()
        self.tickets: Dict[int, _Ticket] = {}
        self.steps: Dict[int, _Step] = {}
        self.made: Dict[int, Batch] = {}
        for step, batch in ready or []:
            self.made[step] = batch
        self.returned = first_step - 1
        self.next_issue = first_step + len(self.made)
        self.numbers = 0
        self.inflight: List[set] = [set() for _ in self.pool.workers]
        self.paused = 0
        self.closing = False
        self.error: Optional[BaseException] = None
        self.restarts: List[RestartEvent] = []
        self.interval = self._new_interval()
        self.capacity = self._capacity()
        self.pool.pause_stream = None if cfg.rollout.partial else self.drained
        with self.cond:
            self._issue_window()
        self.threads = [threading.Thread(target=self._feed, args=(w,), name=f"stream-{w}", daemon=True)
                        for w in range(len(self.pool.workers))]
        for thread in self.threads:
            thread.start()

    def _capacity(self) -> int:
        """Groups each engine carries at once (rollout.stream_groups; 0: its batch's worth)."""
        if self.cfg.rollout.stream_groups:
            return self.cfg.rollout.stream_groups
        slots = ray.get(self.pool.workers[0].batch_slots.remote())
        return max(1, slots // self.n)

    @staticmethod
    def _new_interval() -> Dict[str, Any]:
        """What the engines did since the last batch was handed out (the sampled side)."""
        return {"lengths": [], **{key: 0.0 for key in ENGINE_COUNTS}}

    # ----- issuing (under self.cond)

    def _issue(self, step: int, round_: int, requests: List[GenerationRequest], front: bool = False) -> None:
        made = []
        for request in requests:
            ticket = _Ticket(self.numbers, step, round_, request, time.perf_counter())
            self.numbers += 1
            self.tickets[ticket.number] = ticket
            self.steps[step].tickets.append(ticket)
            made.append(ticket)
        if front:  # a step the learner waits for goes before the steps issued after it
            self.queue.extendleft(reversed(made))
        else:
            self.queue.extend(made)
        self.cond.notify_all()

    def _issue_window(self) -> None:
        """Draw and issue the prompts of every step that entered the window."""
        while self.next_issue <= min(self.last_step, self.returned + self.lookahead):
            step = self.next_issue
            self.steps[step] = _Step(step, self.sampler.state_dict())
            seed = seeds.round_seed(self.cfg.trainer.seed, step, 0)
            self._issue(step, 0, generation_requests(self.sampler.next_batch(self.size), seed))
            self.next_issue += 1

    # ----- the feeders (one thread per worker)

    def _take(self, w: int) -> Optional[List[_Ticket]]:
        """The tickets worker `w` takes now; None once the stream closes."""
        with self.cond:
            while True:
                if self.closing or self.error is not None:
                    return None
                room = 0 if self.paused else self.capacity - len(self.inflight[w])
                take = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
                if take or self.inflight[w]:
                    self.inflight[w].update(t.number for t in take)
                    return take
                self.cond.wait(0.5)

    def _feed(self, w: int) -> None:
        try:
            while True:
                take = self._take(w)
                if take is None:
                    return
                try:
                    self._call(w, take)
                except ray.exceptions.RayActorError as error:
                    if self.pool.recover is None:
                        raise
                    self._lost(w, error)
        except BaseException as error:  # raised to the learner's thread at its next batch
            with self.cond:
                self.error = error
                self.cond.notify_all()

    def _call(self, w: int, take: List[_Ticket]) -> None:
        if self.cfg.rollout.multi_turn:
            return self._call_episodes(w, take)
        return_after = max(1, self.capacity // 4)
        stream = self.pool.advance(w, [t.request for t in take], [t.number for t in take], self.n, return_after)
        scoring, last = [], None
        for ref in stream:
            if last is not None:  # not the report (which comes last): score it now
                scoring.append(self.roles.verifiers.submit([last]))
            last = ref
        report: StreamReport = ray.get(last)
        with self.cond:
            for number, (scored, score_report), version, newest, lengths, tokens in zip(
                    report.tickets, scoring, report.versions, report.newest, report.lengths, report.version_tokens):
                ticket = self.tickets[number]
                ticket.scored, ticket.score_report = scored[0], score_report
                ticket.version, ticket.newest, ticket.lengths, ticket.version_tokens = version, newest, lengths, tokens
                self.inflight[w].discard(number)
                self.interval["lengths"] += list(lengths)
            for key in ENGINE_COUNTS:
                self.interval[key] += report.stats.get(key, 0.0)
            self.cond.notify_all()

    def _call_episodes(self, w: int, take: List[_Ticket]) -> None:
        """Tool episodes and agents stream by the episode: worker `w` runs the taken prompts'
        episodes in one call (a push waits for it, so no episode crosses a push), each group
        scored as the call ends."""
        with self.pool._submitting:
            refs = self.pool.workers[w].generate.options(num_returns=len(take) + 1).remote(
                *[t.request for t in take], n=self.n, greedy=False)
        report = ray.get(refs[-1])
        scoring = self.roles.verifiers.submit(refs[:-1])
        tokens = report.stats.get("completion_tokens", 0.0) / len(take)
        episode_keys = ("completions", "completion_tokens", *TOOL_STATS,
                        *(AGENT_STATS if self.cfg.rollout.agent is not None else ()))
        with self.cond:
            for k, (ticket, version) in enumerate(zip(take, report.versions)):
                ticket.scored, ticket.score_report, ticket.score_index = scoring[0][k], scoring[1], k
                ticket.version = ticket.newest = version
                ticket.lengths = (tokens / self.n,) * self.n  # the call's mean: episodes report no lengths
                ticket.version_tokens = ((version, int(tokens)),)
                ticket.episode_stats = {key: report.stats.get(key, 0.0) / len(take) for key in episode_keys}
                self.inflight[w].discard(ticket.number)
            for key in ENGINE_COUNTS:
                self.interval[key] += report.stats.get(key, 0.0)
            self.cond.notify_all()

    def _lost(self, w: int, error: BaseException) -> None:
        """Worker `w` died mid-call: what it carried is issued again (same seeds, ahead of the
        rest) once Ray restarted it and it holds the current weights."""
        started = time.monotonic()
        with self.cond:
            lost = sorted(self.inflight[w])
            self.inflight[w].clear()
            self.queue.extendleft(self.tickets[number] for number in reversed(lost))
            self.cond.notify_all()
        self.pool._restarted(w)
        with self.cond:
            self.restarts.append(RestartEvent("generation worker", death_cause(error), w, time.monotonic() - started))

    # ----- a weight push without partial rollouts

    @contextlib.contextmanager
    def drained(self):
        """No request running in any engine until the block ends (feeders take nothing new)."""
        with self.cond:
            self.paused += 1
            while any(self.inflight) and self.error is None and not self.closing:
                self.cond.wait(0.5)
        try:
            yield
        finally:
            with self.cond:
                self.paused -= 1
                self.cond.notify_all()

    # ----- the learner's side

    def _wait(self, predicate) -> None:
        while not predicate():
            if self.error is not None:
                raise self.error
            self.cond.wait(0.5)

    def _settle(self, step: int, version: Optional[int]) -> None:
        """Wait until step `step` is complete: every live ticket done and scored, DAPO's extra
        rounds issued and done, and (`version` given) no group staler than algo.max_staleness."""
        algo, slot = self.cfg.algo, self.steps[step]
        while True:
            live = [t for t in slot.tickets if not t.dropped]
            self._wait(lambda live=live: all(t.done for t in live))
            new = [t for t in live if t.number not in slot.informative]
            self.cond.release()
            try:  # the scoring reports are small; the groups stay in the object store
                reports = ray.get([t.score_report for t in new])
            finally:
                self.cond.acquire()
            for ticket, report in zip(new, reports):
                slot.informative[ticket.number] = bool(report.informative[ticket.score_index])
                if ticket.score_report not in slot.counted:
                    slot.counted.add(ticket.score_report)
                    for key, value in report.stats.items():
                        slot.reward_stats[key] = slot.reward_stats.get(key, 0.0) + value
            if version is not None:
                stale = [t for t in live if version - t.version > algo.max_staleness]
                if stale:
                    for ticket in stale:
                        ticket.dropped = True
                    slot.stale += len(stale)
                    self._issue(step, -1, reseeded([t.request for t in stale],
                                                   seeds.regenerated_seed(self.cfg.trainer.seed, step)), front=True)
                    continue
            if algo.dynamic_sampling and slot.rounds < algo.max_sampling_rounds:
                informative = sum(slot.informative[t.number] for t in live)
                if informative < self.size:
                    seed = seeds.round_seed(self.cfg.trainer.seed, step, slot.rounds)
                    self._issue(step, slot.rounds, generation_requests(
                        self.sampler.next_batch(self.size - informative), seed), front=True)
                    slot.rounds += 1
                    continue
            return

    def _form(self, step: int) -> Batch:
        """Step `step`'s Batch from its settled tickets, in issue order."""
        slot, algo = self.steps.pop(step), self.cfg.algo
        live = [t for t in slot.tickets if not t.dropped]
        made = list(slot.tickets)
        if algo.dynamic_sampling:
            kept = [t for t in live if slot.informative[t.number]]
            spare = [t for t in live if not slot.informative[t.number]]
            kept, dynamic = filled_batch(kept, spare, self.size, slot.rounds)
        else:
            kept, dynamic = live, {}
        for ticket in made:
            self.tickets.pop(ticket.number, None)
        restarts, self.restarts = self.restarts, []
        metrics = {
            "completions": float(sum(len(t.lengths) for t in made)),
            "completion_tokens": float(sum(sum(t.lengths) for t in made)),
            "rollout_actor_restarts": float(len(restarts)),
            "dropped_stale": float(slot.stale),
            **dynamic,
            **episode_step_metrics(made),
            **version_metrics(kept),
        }
        # From the step's first prompt issued until it was complete (overlapping other steps').
        times = {"time_generate": time.perf_counter() - min(t.issued for t in made)}
        return Batch(refs=[t.scored for t in kept], items=[t.request for t in kept],
                     versions=[t.version for t in kept], reward_stats=slot.reward_stats, metrics=metrics,
                     times=times, restarts=restarts, sampler_state=slot.sampler_state)

    def next(self, step: int) -> Batch:
        """Step `step`'s batch, once its groups are done (the engines go on with later steps')."""
        with self.cond:
            batch = self.made.pop(step, None)
            if batch is None:
                assert step in self.steps, f"streaming batches out of order: step {step} was not issued"
                self._settle(step, self.roles.channel.version)
                batch = self._form(step)
            interval, self.interval = self.interval, self._new_interval()
            batch.metrics.update(interval_metrics(interval, batch.metrics.pop("_trained_lengths", [])))
            batch.metrics.update(lag_metrics(batch.metrics.pop("_token_versions", {}), self.roles.channel.version))
            self.returned = step
            self._issue_window()
        return batch

    @property
    def ahead(self) -> int:
        """Steps issued (or saved) beyond the one in training."""
        return len(self.steps) + len(self.made)

    def ahead_state(self) -> tuple:
        """(the (step, Batch) pairs made ahead of the learner, the sampler's state after them),
        for a checkpoint: waits until every issued step is complete."""
        with self.cond:
            for step in sorted(self.steps):
                self._settle(step, None)
                self.made[step] = self._form(step)
            return sorted(self.made.items()), self.sampler.state_dict()

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        for thread in self.threads:
            thread.join()
        self.pool.pause_stream = None
        with contextlib.suppress(Exception):
            self.pool.abort_stream()


def version_metrics(kept: List[_Ticket]) -> Dict[str, float]:
    """Per-step metrics of the trained groups' policy versions and lengths."""
    tokens: Dict[int, int] = {}
    for ticket in kept:
        for version, count in ticket.version_tokens:
            tokens[version] = tokens.get(version, 0) + count
    return {  # the trained tokens' version spread: the learner's version_spread
        "multi_version_groups": float(sum(t.newest != t.version for t in kept)),
        "_token_versions": tokens,
        "_trained_lengths": [n for t in kept for n in t.lengths],
    }


def episode_step_metrics(made: List[_Ticket]) -> Dict[str, float]:
    """A step's tool-episode and agent metrics (as batches.py's for a chunked step), from its
    groups' shares of their calls' stats; none for single-turn groups."""
    totals: Dict[str, float] = {}
    for ticket in made:
        for key, value in ticket.episode_stats.items():
            totals[key] = totals.get(key, 0.0) + value
    return {**episode_metrics(totals), **{key: totals[key] for key in AGENT_STATS if key in totals}}


def interval_metrics(interval: Dict[str, Any], trained: List[int]) -> Dict[str, float]:
    """Length distribution of the trained completions against all sampled since the last batch,
    and how full the engines ran."""
    return {**length_stats("completion_len_trained", trained),
            **length_stats("completion_len_sampled", interval["lengths"]),
            **engine_metrics(interval)}


def lag_metrics(tokens: Dict[int, int], version: int) -> Dict[str, float]:
    """Tokens per policy version of a batch, as lags behind the learner's `version`: the mean
    and largest lag, and the tokens at each lag (`tokens_lag_0` the learner's own version)."""
    total = sum(tokens.values())
    if not total:
        return {}
    lags = {version - v: n for v, n in tokens.items()}
    return {"token_lag_mean": sum(lag * n for lag, n in lags.items()) / total, "token_lag_max": float(max(lags)),
            **{f"tokens_lag_{lag}": float(n) for lag, n in sorted(lags.items())}}


def length_stats(name: str, lengths: List[int]) -> Dict[str, float]:
    if not lengths:
        return {}
    ordered = sorted(lengths)
    return {f"{name}_mean": sum(ordered) / len(ordered), f"{name}_p90": float(ordered[int(0.9 * (len(ordered) - 1))]),
            f"{name}_max": float(ordered[-1])}
