"""The phases of a training run, each one named call on the roles: the warm-up, a GRPO step, a
resume from a checkpoint. cluster/loop/training.py calls them in order.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional, Tuple

import ray

from cluster.loop.batches import AHEAD_FILE, AsyncBatches, SyncBatches, Timer, drop_stale, thaw
from cluster.loop.checkpoint import latest_checkpoint, load_trainer_state, restore_driver_rng, skipped_line
from cluster.loop.launch import say
from cluster.loop.roles import Roles, evaluate
from cluster.loop.streaming import StreamingBatches
from cluster.loop.samples import sample_ids
from common.config import Config
from common.messages import RestartEvent, StepRecord, TrainerState
from common.seeds import warmup_seed
from learner.lr_schedule import lr_at
from reward.pool import summarize


def warm_up(roles: Roles, cfg: Config, train_set, end_ids: Optional[List[int]] = None) -> int:
    """Supervised warm-up on the learner, stopped early on purpose; returns the policy version.
    Targets end with `end_ids` (the chat format's end of turn; None: the tokenizer's EOS).

    Every `check_every` steps the weights go to the rollout workers, which measure greedy
    accuracy on a probe of training problems; the warm-up ends once it reaches
    `target_accuracy`, leaving GRPO an ability to sharpen rather than one to create.
    """
    w = cfg.warmup
    examples = [(p.warmup_prompt or p.prompt, p.solution) for p in train_set if p.solution]
    version = 0
    if w.steps and examples:
        roles.learner.load_warmup(ray.put(examples), end_ids)
        probe = train_set[: w.probe_size]
        done, accuracy = 0, None
        while done < w.steps and (accuracy is None or accuracy < w.target_accuracy):
            chunk = min(w.check_every if w.target_accuracy > 0 else w.steps, w.steps - done)
            losses = roles.learner.warmup(chunk, w.batch_size, w.lr, warmup_seed(cfg.trainer.seed, done))
            done += chunk
            version += 1
            roles.channel.push(version)
            if w.target_accuracy > 0:
                accuracy = evaluate(roles, probe)
        probe_note = f", probe accuracy {accuracy:.1%}" if accuracy is not None else ""
        say(f"warm-up: {done} supervised steps, loss {losses[-1]:.3f}{probe_note}")
    roles.learner.snapshot_reference()  # pi_ref is the model GRPO starts from
    roles.channel.refresh_spec()  # with LoRA the pushes send adapters from here on
    return version


def grpo_step(step: int, version: int, roles: Roles, batches, buffer, cfg: Config) -> StepRecord:
    """One GRPO iteration: take a scored batch (made now, or ahead in async mode), drop what is
    too stale, train, push the new weights."""
    started, timer = time.perf_counter(), Timer()
    lr = lr_at(step, cfg.trainer.max_steps, cfg.learner.lr, cfg.learner.lr_schedule, cfg.learner.min_lr_ratio)
    with timer("time_wait_rollout"):
        batch = batches.next(step)
        staleness = drop_stale(batch, version, cfg.algo.max_staleness, step, roles, batches.sampler, cfg)
        staleness["dropped_stale"] += batch.metrics.pop("dropped_stale", 0.0)  # streaming drops its own
    buffer.put(batch.refs, version)
    occupancy = {"buffer_groups": float(len(buffer)), "batches_ahead": float(batches.ahead)}
    samples = sample_ids(step, batch.items, batch.versions, cfg.algo.group_size)
    with roles.channel.lock:  # a restarted worker re-joining waits for this push, not half of it
        with timer("time_train"):
            learner_metrics = roles.learner.train_step(buffer.take(len(batch.refs)), cfg.rollout.temperature, lr)
        with timer("time_weight_sync"):
            sync_metrics = roles.channel.push(version + 1)
    rewards = summarize(batch.reward_stats, cfg.reward.verifiers)
    # Verifier and generation actors: restarted while generating, or found dead by the push.
    verifier_restarts = rewards["actor_restarts"]
    rewards["actor_restarts"] += batch.metrics["rollout_actor_restarts"] + sync_metrics.pop("sync_worker_restarts", 0.0)
    restarts = [*batch.restarts, *sync_metrics.pop("restart_events", [])]
    if verifier_restarts:
        restarts.append(RestartEvent("verifier", "restarted by Ray, its call re-run"))
    step_seconds = time.perf_counter() - started
    generate_seconds = batch.times.get("time_generate", 0.0)
    return StepRecord(metrics={
        "step": step,
        "policy_version": version + 1,
        **rewards,
        "accuracy": rewards.get("score/math", rewards[f"score/{cfg.reward.verifiers[0]}"]),
        **batch.metrics,
        "generate_tokens_per_s": batch.metrics["completion_tokens"] / max(generate_seconds, 1e-9),
        "tokens_per_s": batch.metrics["completion_tokens"] / step_seconds,
        **staleness,
        **occupancy,
        **learner_metrics,
        **sync_metrics,
        **batch.times,
        **timer.times,
        "time_step": step_seconds,
    }, events=tuple(restarts), samples=samples)


def make_batches(cfg: Config, roles: Roles, sampler, first_step: int, ready: Optional[List[tuple]] = None):
    """The batch source; `ready`: batches a checkpoint saved as made ahead (async mode)."""
    if cfg.trainer.mode == "async" and cfg.rollout.streaming:
        return StreamingBatches(roles, sampler, cfg, first_step, cfg.trainer.max_steps, cfg.trainer.async_lookahead,
                                ready)
    if cfg.trainer.mode == "async":
        return AsyncBatches(roles, sampler, cfg, first_step, cfg.trainer.max_steps, cfg.trainer.async_lookahead,
                            ready)
    return SyncBatches(roles, sampler, cfg)


def find_resume_point(cfg: Config) -> Optional[Path]:
    """The checkpoint `trainer.resume` names (None: start fresh)."""
    if cfg.trainer.resume is None:
        return None
    if cfg.trainer.resume != "auto":
        return Path(cfg.trainer.resume).expanduser()
    run_dir = Path(cfg.trainer.output_dir).expanduser() / cfg.trainer.run_name
    found = latest_checkpoint(run_dir)
    skipped = skipped_line(run_dir)
    if skipped:  # a kill or a full disk during its write: the one before it is taken
        say(f"trainer.resume=auto: {skipped}")
    if found is None:
        say(f"trainer.resume=auto: no complete checkpoint in {run_dir}; starting from the beginning")
    return found


def resume(roles: Roles, checkpoint: Path, sampler) -> Tuple[TrainerState, list]:
    """Learner state, prompt position and RNGs from `checkpoint`; the generation workers get
    the restored weights (and its policy version) before they generate anything. Returns the
    checkpoint's trainer state and, in async mode, the batches made ahead of the learner."""
    state = load_trainer_state(checkpoint)
    roles.learner.load_checkpoint(str(checkpoint))
    roles.channel.refresh_spec()  # a LoRA checkpoint's policy pushes its base, then adapters
    sampler.load_state_dict(state.sampler)
    restore_driver_rng(state.rng)
    roles.channel.push(state.policy_version)
    ahead = Path(checkpoint) / AHEAD_FILE
    return state, thaw(ahead.read_bytes()) if ahead.exists() else []


def resume_hint(cfg: Config, run_dir: Path) -> str:
    last = latest_checkpoint(run_dir)
    if last is None:
        return "No checkpoint was written (set trainer.save_every to have one next time)."
    return (f"Its last checkpoint is {last}: continue with the same overrides plus "
            f"trainer.run_name={cfg.trainer.run_name} trainer.resume=auto")


def algorithm(cfg: Config) -> str:
    return "PPO" if cfg.algo.adv_estimator == "gae" else "GRPO"
