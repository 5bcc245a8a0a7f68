"""Where each step's scored prompt groups come from: made on demand (sync) or ahead (async).

`collect` generates and scores one batch. In sync mode the driver calls it at the start of each
step, with the weights the learner holds (on-policy). In async mode a background thread runs it
for the next `trainer.async_lookahead` steps while the learner trains on this one; the weight
push at the end of a step reaches each worker between two of its generation calls, so every
group records the one policy version that made it. Groups older than `algo.max_staleness`
versions are dropped and their prompts generated again with the current weights; the learner's
truncated importance weights (`algo.is_cap`) correct for the staleness that remains.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pickle
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import ray

from cluster.loop.launch import say
from common import seeds
from common.dispatch import Dispatched
from common.messages import GenerationRequest, RestartEvent


class Timer:
    """Seconds spent in each named phase (summed when a phase runs more than once)."""
    def __init__(self) -> None:
        self.times: Dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start


@dataclass
class Batch:
    """One step's scored prompt groups, by reference, and what it took to make them."""
    refs: List[Any]
    """ObjectRefs of the scored groups, in sampling order."""
    items: List[GenerationRequest]
    """The request of each group: what to generate again if it turns out stale."""
    versions: List[int]
    """Policy version that generated each group."""
    reward_stats: Dict[str, Any]
    metrics: Dict[str, float]
    times: Dict[str, float]
    restarts: List[RestartEvent] = field(default_factory=list)
    """Generation actors that died while making this batch."""
    sampler_state: Dict[str, int] = field(default_factory=dict)
    """The prompt sampler's state before this batch was drawn (a checkpoint taken before this
    batch is trained resumes from here, so no prompt is lost or repeated)."""


def generation_requests(pairs: Sequence[Tuple[int, Any]], round_seed: int) -> List[GenerationRequest]:
    """One request per (index, problem) pair of a generation round, seeded per prompt: the same
    samples whichever worker draws it, and no two prompts share a random stream."""
    return [GenerationRequest(index, problem.prompt, problem.answer, problem.fields,
                              seeds.prompt_seed(round_seed, index)) for index, problem in pairs]


def reseeded(requests: Sequence[GenerationRequest], round_seed: int) -> List[GenerationRequest]:
    """The same prompts in another round (stale groups generated again)."""
    return [dataclasses.replace(r, seed=seeds.prompt_seed(round_seed, r.index)) for r in requests]


@dataclass
class _Row:
    """One generated and scored group of a collection round."""
    ref: Any
    request: GenerationRequest
    version: int
    informative: bool


def collect(step: int, roles, sampler, cfg, round_seed: Optional[int] = None,
            items: Optional[Sequence[GenerationRequest]] = None) -> Batch:
    """Generate and score one batch of prompt groups.

    With DAPO's dynamic sampling, groups whose rewards are all equal (zero advantage) are
    dropped and more prompts are generated, up to `algo.max_sampling_rounds` rounds; if the
    batch is still short, dropped groups fill it (they add nothing to the gradient).
    `items` regenerates given prompts instead of drawing new ones (stale groups).
    """
    timer = Timer()
    size = cfg.trainer.prompts_per_step if items is None else len(items)
    state = sampler.state_dict()
    rounds = cfg.algo.max_sampling_rounds if cfg.algo.dynamic_sampling and items is None else 1
    kept: List[_Row] = []
    spare: List[_Row] = []
    totals: Dict[str, float] = {}
    restarts: List[RestartEvent] = []
    gen_totals: Dict[str, float] = {"completions": 0.0, "completion_tokens": 0.0, "rollout_actor_restarts": 0.0,
                                    "time_engine": 0.0, "engine_slots": 0.0, "sampled_tokens": 0.0,
                                    **{key: 0.0 for key in TOOL_STATS},
                                    **({key: 0.0 for key in AGENT_STATS} if cfg.rollout.agent is not None else {})}
    for round_ in range(rounds):
        # Round 0's seed is the plain step seed: runs without dynamic sampling are unchanged.
        seed = seeds.round_seed(cfg.trainer.seed, step, round_) if round_seed is None else round_seed
        requests = (reseeded(items, seed) if items is not None
                    else generation_requests(sampler.next_batch(size - len(kept)), seed))
        gen, scores = generate_and_score(roles, requests, cfg.algo.group_size, timer)
        totals = scores.stats if not totals else {k: totals[k] + scores.stats[k] for k in totals}
        restarts += gen.restarts
        gen_stats = {**gen.stats, "rollout_actor_restarts": gen.stats.get("actor_restarts", 0.0)}
        gen_totals = {k: gen_totals[k] + gen_stats.get(k, 0.0) for k in gen_totals}
        keep_agent_records(cfg, step, gen.stats, gen.records)
        rows = [_Row(ref, request, version, informative) for ref, request, version, informative
                in zip(scores.refs, requests, gen.versions, scores.informative)]
        if not cfg.algo.dynamic_sampling or items is not None:
            kept = rows
            break
        kept += [r for r in rows if r.informative]
        spare += [r for r in rows if not r.informative]
        if len(kept) >= size:
            break
    metrics = {**{k: v for k, v in gen_totals.items() if k not in TOOL_STATS + ENGINE_STATS},
               **episode_metrics(gen_totals), **engine_metrics(gen_totals)}
    if cfg.algo.dynamic_sampling and items is None:
        kept, dynamic = filled_batch(kept, spare, size, round_ + 1)
        metrics.update(dynamic)
    return Batch(refs=[r.ref for r in kept], items=[r.request for r in kept], versions=[r.version for r in kept],
                 reward_stats=totals, metrics=metrics, times=timer.times, restarts=restarts, sampler_state=state)


def filled_batch(kept: list, spare: list, size: int, rounds: int) -> Tuple[list, Dict[str, float]]:
    """DAPO's dynamic sampling: the informative groups, topped up to `size` with uniform ones
    (in their order) when the rounds ran out, and the step's metrics of it."""
    filled = max(size - len(kept), 0)
    return (kept + spare[:filled])[:size], {"dynamic_dropped": float(len(spare) - filled),
                                            "dynamic_filled": float(filled), "sampling_rounds": float(rounds)}


TOOL_STATS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_seconds", "tool_wait_seconds",
              "observation_tokens", "engine_steps")


ENGINE_STATS = ("time_engine", "engine_slots", "sampled_tokens")
ENGINE_COUNTS = ("engine_steps", *ENGINE_STATS)  # what each engine call reports of its steps


def engine_metrics(totals: Dict[str, float]) -> Dict[str, float]:
    """The engines' steps and seconds inside them, their slot occupancy (tokens sampled in those
    steps / (steps x max_num_seqs)) and tokens sampled per second inside steps (summed over
    engines); the last two only when the engines stepped (a streamed step made while the one
    before it trained has no steps of its own). Sampled tokens are the engines' own count:
    a tool episode's observation tokens are not among them, and a streaming sample's tokens
    count in the interval whose steps sampled them."""
    out = {key: totals.get(key, 0.0) for key in ENGINE_COUNTS}
    if totals.get("engine_slots") and totals.get("time_engine"):
        out["slot_occupancy"] = totals.get("sampled_tokens", 0.0) / totals["engine_slots"]
        out["tokens_per_s_engine"] = totals.get("sampled_tokens", 0.0) / totals["time_engine"]
    return out


AGENT_STATS = ("agent_errors", "agent_timeouts", "template_drift", "off_chain_calls", "agent_requests",
               "agent_rejected")
DRIFT_FILE = "template_drift.json"


def keep_agent_records(cfg, step: int, stats: Dict[str, float], records: Dict[str, Any]) -> None:
    """An agent run's records of a batch: the first session whose chat template's rendering of
    its history left the sampled ids is saved once in the run folder (DRIFT_FILE), the first
    agent failure of a step is printed."""
    drift = records.get("first_drift")
    error = records.get("first_agent_error")
    if error is not None:
        failed = stats.get("agent_errors", 0.0) + stats.get("agent_timeouts", 0.0)
        say(f"step {step}: {failed:g} agent episodes failed (scored 0); the first: {error}")
    if drift is None or cfg.trainer.run_name is None:  # no drift, or no run folder (roles driven directly)
        return
    path = Path(cfg.trainer.output_dir).expanduser() / cfg.trainer.run_name / DRIFT_FILE
    if not path.exists():
        path.write_text(json.dumps({"step": step, **drift}, indent=1) + "\n")


def episode_metrics(totals: Dict[str, float]) -> Dict[str, float]:
    """Per-step metrics of multi-turn episodes (none for single-turn runs): turns and calls per
    episode, failed calls, the seconds tools ran (summed over calls) and the seconds the engines
    sat idle waiting only for tools and the share of trained-on sequence that is tool output
    (the engines' steps: engine_metrics)."""
    if not totals.get("turns"):
        return {}
    n = max(totals["completions"], 1.0)
    return {"turns_mean": totals["turns"] / n, "tool_calls_mean": totals["tool_calls"] / n,
            "tool_errors": totals["tool_errors"], "tool_timeouts": totals["tool_timeouts"],
            "time_tools": totals["tool_seconds"], "time_tools_blocking": totals["tool_wait_seconds"],
            "observation_token_fraction": totals["observation_tokens"] / max(totals["completion_tokens"], 1.0)}


def generate_and_score(roles, requests: Sequence[GenerationRequest], n: int,
                       timer: Timer) -> Tuple[Dispatched, Dispatched]:
    """Sample `n` completions per request and score them, each chunk handed to the verifier pool
    as soon as it is generated: (the generation's results, the scoring's: scored group refs in
    order). `time_generate` runs until the last chunk is generated; `time_reward` is what
    scoring adds after it (the phase is off the step's critical path when it is near 0)."""
    pending: List[tuple] = []

    def score_chunk(positions, refs) -> None:
        pending.append((positions, *roles.verifiers.submit(refs)))

    with timer("time_generate"):
        gen = roles.rollout.generate(requests, n, greedy=False, on_chunk=score_chunk)
    with timer("time_reward"):
        scores = roles.verifiers.gather(pending, len(requests))
    return gen, scores


def drop_stale(batch: Batch, version: int, max_staleness: int, step: int, roles, sampler, cfg) -> Dict[str, float]:
    """Replace the groups more than `max_staleness` versions older than `version` (the learner's
    weights) by groups generated again now; returns the staleness metrics of what is trained."""
    stale = [i for i, v in enumerate(batch.versions) if version - v > max_staleness]
    if stale:
        fresh = collect(step, roles, sampler, cfg, round_seed=seeds.regenerated_seed(cfg.trainer.seed, step),
                        items=[batch.items[i] for i in stale])
        for j, i in enumerate(stale):
            batch.refs[i], batch.versions[i] = fresh.refs[j], fresh.versions[j]
        batch.reward_stats = {k: batch.reward_stats[k] + fresh.reward_stats[k] for k in batch.reward_stats}
        for key, value in fresh.times.items():
            batch.times[key] = batch.times.get(key, 0.0) + value
        for key in ("completions", "completion_tokens", "rollout_actor_restarts"):
            batch.metrics[key] += fresh.metrics[key]
        batch.restarts += fresh.restarts
    staleness = [version - v for v in batch.versions]
    return {"staleness_max": float(max(staleness)), "staleness_mean": sum(staleness) / len(staleness),
            "dropped_stale": float(len(stale))}


class SyncBatches:
    """On-policy: each batch is generated when its step starts, with the learner's weights."""
    def __init__(self, roles, sampler, cfg):
        self.roles, self.sampler, self.cfg = roles, sampler, cfg

    def next(self, step: int) -> Batch:
        return collect(step, self.roles, self.sampler, self.cfg)

    @property
    def ahead(self) -> int:
        """Batches being generated or waiting beyond the one in training."""
        return 0

    def ahead_state(self) -> tuple:
        """(batches made ahead of the learner: none in sync mode, the sampler's state)."""
        return [], self.sampler.state_dict()

    def close(self) -> None:
        pass


class AsyncBatches:
    """Off-policy by a bounded amount: batches for the next `lookahead` steps are generated and
    scored in a background thread while the learner trains (Ray calls are thread-safe)."""
    def __init__(self, roles, sampler, cfg, first_step: int, last_step: int, lookahead: int,
                 ready: Optional[List[tuple]] = None):
        """`ready`: (step, Batch) pairs made ahead before a checkpoint, trained first (a
        resumed run trains on what the straight run made with the previous version's weights)."""
        self.roles, self.sampler, self.cfg = roles, sampler, cfg
        self.last_step, self.lookahead = last_step, lookahead
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self.pending: Deque[tuple] = deque()  # (step, future, started event)
        self.next_step = first_step
        for step, batch in ready or []:
            assert step == self.next_step, f"a saved batch of step {step} where step {self.next_step} comes"
            future, started = Future(), threading.Event()
            future.set_result(batch)
            started.set()
            self.pending.append((step, future, started))
            self.next_step += 1
        self._fill()

    def _fill(self) -> None:
        while len(self.pending) < self.lookahead and self.next_step <= self.last_step:
            started = threading.Event()
            step = self.next_step

            def job(step=step, started=started) -> Batch:
                started.set()
                return collect(step, self.roles, self.sampler, self.cfg)

            self.pending.append((step, self.executor.submit(job), started))
            self.next_step += 1

    def next(self, step: int) -> Batch:
        pending_step, future, _ = self.pending.popleft()
        assert pending_step == step, f"async batches out of order: {pending_step} for step {step}"
        batch: Batch = future.result()
        self._fill()  # the next batches start generating before this one is trained
        return batch

    @property
    def ahead(self) -> int:
        return len(self.pending)

    def ahead_state(self) -> tuple:
        """(the (step, Batch) pairs made ahead of the learner, the sampler's state after them),
        for a checkpoint: the batches were made with older weights than the checkpoint's, so a
        resume must train on them rather than make them again. Waits until they are made (the
        next step would wait for the first of them anyway)."""
        made = [(step, future.result()) for step, future, _ in self.pending]
        return made, self.sampler.state_dict()

    def close(self) -> None:
        for _, future, _ in self.pending:
            future.cancel()
        for _, future, started in self.pending:
            if started.is_set():
                with contextlib.suppress(Exception):
                    future.result()  # let a running job end before the actors go away
        self.executor.shutdown(wait=True)


AHEAD_FILE = "ahead_batches.pkl"


def freeze(made: List[tuple]) -> bytes:
    """Batches made ahead, with their groups' payloads (fetched from the object store: the
    checkpoint must hold them, not references that die with this Ray), as bytes."""
    frozen = [(step, dataclasses.replace(batch, refs=ray.get(list(batch.refs)), restarts=[]))
              for step, batch in made]
    return pickle.dumps(frozen)


def thaw(data: bytes) -> List[tuple]:
    """What `freeze` wrote, the groups put back in the object store."""
    return [(step, dataclasses.replace(batch, refs=[ray.put(group) for group in batch.refs],
                                       items=[_as_request(item) for item in batch.items]))
            for step, batch in unpickle(data)]


def unpickle(data: bytes):
    """`pickle.loads`, reading the batches of a checkpoint written before a class moved."""
    return _Unpickler(io.BytesIO(data)).load()


class _Unpickler(pickle.Unpickler):
    """Reads checkpoints written before a class moved: (module, name) as pickled -> where it is now."""
    MOVED = {("rollout.datasets", "Problem"): ("common.problem", "Problem"),
             ("cluster.batches", "Batch"): ("cluster.loop.batches", "Batch")}

    def find_class(self, module: str, name: str):
        return super().find_class(*self.MOVED.get((module, name), (module, name)))


def _as_request(item) -> GenerationRequest:
    """A saved batch's item; checkpoints written before requests were typed hold (index,
    problem) pairs. The seed is left at 0: a stale group is generated again with a seed of the
    regeneration's round (`reseeded`), never with the one it was first made with."""
    if isinstance(item, GenerationRequest):
        return item
    index, problem = item
    return GenerationRequest(index, problem.prompt, problem.answer, problem.fields, 0)
