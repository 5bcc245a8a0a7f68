"""The GRPO driver: `grpo train [overrides...]` or `python -m cluster.train [overrides...]`.

The loop in `train` reads as the table of contents of a run; each phase is one named call on a
role (rollout, verifiers, learner) or on the weight-sync channel. The driver only ever holds
ObjectRefs to prompt groups, never their payloads.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

from cluster.compose import ConfigError
from cluster.config import Config

# Quiet, reproducible actors: the progress bar is the run's voice, errors still propagate.
ACTOR_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
}


@dataclass
class Roles:
    rollout: object
    verifiers: object
    learner: object
    channel: object
    placement: object = None

    def shutdown(self) -> None:
        """Every role's actors and the placement groups, whichever of them still answer."""
        for part in (self.rollout, self.verifiers, self.learner):
            try:
                part.shutdown()
            except Exception:  # a dead actor or a lost node: the others still go
                pass
        if self.placement is not None:
            try:
                self.placement.remove()
            except Exception:
                pass


@dataclass
class Held:
    """What a run holds while it runs; `close` lets all of it go, on every way out (the last
    step, an error, Ctrl-C): the async batch thread, the actors and placement groups, Ray."""

    roles: Optional[Roles] = None
    batches: object = None

    def close(self) -> None:
        import ray

        if self.batches is not None:
            self.batches.close()
        if self.roles is not None:
            self.roles.shutdown()
        if ray.is_initialized():
            ray.shutdown()


def train(cfg: Config) -> Dict[str, object]:
    """The whole job: warm-up, GRPO steps, held-out accuracy before and after. Returns the summary."""
    from rollout.datasets import load_problems

    started = time.time()
    heldout, train_set = load_problems(cfg.data, cfg.trainer.seed)  # bad data fails before Ray
    check_inputs(cfg, train_set)
    cfg.model.path = resolve_model(cfg)
    heldout, train_set, prompts = prepare_prompts(cfg, heldout, train_set)  # bad templates fail before Ray
    resume_from = find_resume_point(cfg)
    held = Held()
    try:
        summary = _run(cfg, heldout, train_set, prompts, resume_from, started, held)
    finally:
        held.close()
    print_summary(Path(summary["run_dir"]), summary)
    return summary


def _run(cfg: Config, heldout, train_set, prompts, resume_from, started: float, held: Held) -> Dict[str, object]:
    """The run once its inputs are checked: Ray, the roles, warm-up, the GRPO steps, the files.
    Whatever it starts is recorded in `held`, which the caller closes however this ends."""
    from cluster.buffer import RolloutBuffer
    from cluster.checkpoint import save_checkpoint
    from cluster.eval_job import evaluate_full, write_records
    from cluster.evaluation import format_table
    from cluster.metrics import MetricsLogger
    from cluster.ray_utils import init_ray
    from cluster.sync_channel import WeightSyncError
    from learner.group import LearnerError
    from rollout.datasets import PromptSampler

    dashboard = init_ray(cfg.ray.address, cfg.ray.num_cpus, env_vars=ACTOR_ENV, num_gpus=cfg.ray.num_gpus)
    say(f"Ray dashboard: {dashboard}" if dashboard else "Ray: a local instance (no dashboard; join a cluster "
        "with RAY_ADDRESS or ray.address to get one)", started)
    check_resources(cfg)  # a request the cluster cannot hold would otherwise wait forever
    run_dir = make_run_dir(cfg)
    show_prompt(run_dir, prompts, started)
    roles = held.roles = start_roles(cfg)
    say(f"actors ready: {cfg.rollout.num_workers} vLLM workers, {cfg.reward.num_workers} verifiers, "
        f"{cfg.learner.num_ranks} DeepSpeed ZeRO-{cfg.learner.zero_stage} learner ranks", started)

    sampler, buffer = PromptSampler(train_set, cfg.trainer.seed), RolloutBuffer()
    if resume_from is None:
        first_step, version = 1, warm_up(roles, cfg, train_set, prompts["turn_end_ids"])
        accuracy_before = evaluate(roles, heldout)
        say(f"held-out greedy accuracy after warm-up: {accuracy_before:.1%}", started)
    else:
        state = resume(roles, resume_from, sampler)
        first_step, version, accuracy_before = state["step"] + 1, state["policy_version"], state["accuracy_before"]
        say(f"resumed from {resume_from} (step {state['step']}, policy version {version})", started)
    logger = MetricsLogger(run_dir, asdict(cfg), cfg.trainer.max_steps, cfg.logger, cfg.trainer.progress,
                           resume_step=first_step - 1)
    batches = held.batches = make_batches(cfg, roles, sampler, first_step)
    for step in range(first_step, cfg.trainer.max_steps + 1):
        try:
            row = grpo_step(step, version, roles, batches, buffer, cfg)
        except (LearnerError, WeightSyncError) as error:
            # A lost learner shard, or a push that could not be completed or retried (with NCCL a
            # receiver lost mid-broadcast leaves the sender's communicator unusable): stop, say how
            # to go on.
            raise type(error)(f"{error} at step {step}; the run stopped. " + resume_hint(cfg, run_dir)) from error
        version = row["policy_version"]
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
            eval_started = time.perf_counter()
            row["heldout_accuracy"] = evaluate(roles, heldout)
            if cfg.eval.n:
                row.update(evaluate_full(roles.rollout, roles.verifiers, heldout, cfg)[0])
            row["time_eval"] = time.perf_counter() - eval_started
        row["wall_seconds"] = time.time() - started  # since the job started: the gaps between steps show
        logger.log(row)
        if cfg.trainer.save_every and (step % cfg.trainer.save_every == 0 or step == cfg.trainer.max_steps):
            save_checkpoint(run_dir, step, roles.learner, {
                "step": step, "policy_version": version, "sampler": batches.resume_state(),
                "accuracy_before": accuracy_before, "seed": cfg.trainer.seed,
            }, cfg.trainer.keep_checkpoints)
        _injected_fault(step, roles)
    batches.close()
    held.batches = None

    accuracy_after = evaluate(roles, heldout)
    say(f"held-out greedy accuracy after {algorithm(cfg)}: {accuracy_after:.1%}", started)
    eval_metrics = {}
    if cfg.eval.n:  # pass@k / maj@k of the final policy, one record per prompt in eval.jsonl
        eval_metrics, records = evaluate_full(roles.rollout, roles.verifiers, heldout, cfg)
        write_records(run_dir, records)
        say(f"evaluation of the final policy ({cfg.eval.n} samples per prompt):\n{format_table(eval_metrics)}", started)
    final_model = roles.learner.save_pretrained(str(run_dir / "final_model"))
    summary = {
        "heldout_accuracy_before": accuracy_before,
        "heldout_accuracy_after": accuracy_after,
        "heldout_size": len(heldout),
        "grpo_steps": cfg.trainer.max_steps,
        "policy_version": version,
        "wall_minutes": (time.time() - started) / 60,
        "final_model": final_model,
        **eval_metrics,
    }
    logger.summary(summary)
    summary["wandb_dir"] = logger.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from cluster.report import write_report

    write_report(run_dir, accuracy_before, accuracy_after)
    return {**summary, "run_dir": str(run_dir)}


def grpo_step(step: int, version: int, roles: Roles, batches, buffer, cfg: Config) -> Dict[str, float]:
    """One GRPO iteration: take a scored batch (made now, or ahead in async mode), drop what is
    too stale, train, push the new weights."""
    from cluster.batches import Timer, drop_stale
    from learner.lr_schedule import lr_at
    from reward.pool import summarize

    started, timer = time.perf_counter(), Timer()
    lr = lr_at(step, cfg.trainer.max_steps, cfg.learner.lr, cfg.learner.lr_schedule, cfg.learner.min_lr_ratio)
    with timer("time_wait_rollout"):
        batch = batches.next(step)
        staleness = drop_stale(batch, version, cfg.algo.max_staleness, step, roles, batches.sampler, cfg)
    buffer.put(batch.refs, version)
    occupancy = {"buffer_groups": float(len(buffer)), "batches_ahead": float(batches.ahead)}
    with roles.channel.lock:  # a restarted worker re-joining waits for this push, not half of it
        with timer("time_train"):
            learner_metrics = roles.learner.train_step(buffer.take(len(batch.refs)), cfg.rollout.temperature, lr)
        with timer("time_weight_sync"):
            sync_metrics = roles.channel.push(version + 1)
    rewards = summarize(batch.reward_stats, cfg.reward.verifiers)
    rewards["actor_restarts"] += batch.metrics["rollout_actor_restarts"]  # verifier and generation actors
    step_seconds = time.perf_counter() - started
    generate_seconds = batch.times.get("time_generate", 0.0)
    return {
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
    }


def make_batches(cfg: Config, roles: Roles, sampler, first_step: int):
    from cluster.batches import AsyncBatches, SyncBatches

    if cfg.trainer.mode == "async":
        return AsyncBatches(roles, sampler, cfg, first_step, cfg.trainer.max_steps, cfg.trainer.async_lookahead)
    return SyncBatches(roles, sampler, cfg)


def start_roles(cfg: Config) -> Roles:
    from cluster.placement import Placement
    from cluster.sync_channel import WeightSyncChannel
    from learner.group import LearnerGroup
    from cluster.compose import verifier_settings
    from reward.pool import VerifierPool
    from rollout.pool import RolloutPool

    # Each role in its own placement group, on the nodes cluster.nodes names.
    placement = Placement(cfg, cfg.cluster.placement_timeout_s)
    # The learner starts first: its DeepSpeed set-up overlaps the (slower) vLLM engine start-up.
    algo = {**asdict(cfg.algo), "max_length": cfg.rollout.max_new_tokens}
    learner = LearnerGroup(cfg.model.path, asdict(cfg.learner), algo, cfg.trainer.seed,
                           placement=lambda i: placement.options("learner", i))
    verifiers = VerifierPool(verifier_settings(cfg.reward), cfg.reward.num_workers,
                             cfg.reward.num_cpus_per_worker, placement=lambda i: placement.options("reward", i))
    rollout = RolloutPool(cfg.model.path, asdict(cfg.rollout), cfg.rollout.num_workers, cfg.trainer.seed,
                          cfg.rollout.num_cpus_per_worker, cfg.rollout.num_gpus_per_worker,
                          placement=lambda i: placement.options("rollout", i))
    channel = WeightSyncChannel(learner, rollout, cfg.rollout.dtype, cfg.sync.bucket_mb, cfg.sync.timeout_s)
    rollout.recover = channel.recover
    return Roles(rollout=rollout, verifiers=verifiers, learner=learner, channel=channel, placement=placement)


def warm_up(roles: Roles, cfg: Config, train_set, end_ids: Optional[List[int]] = None) -> int:
    """Supervised warm-up on the learner, stopped early on purpose; returns the policy version.
    Targets end with `end_ids` (the chat format's end of turn; None: the tokenizer's EOS).

    Every `check_every` steps the weights go to the rollout workers, which measure greedy
    accuracy on a probe of training problems; the warm-up ends once it reaches
    `target_accuracy`, leaving GRPO an ability to sharpen rather than one to create.
    """
    import ray

    w = cfg.warmup
    examples = [(p.prompt, p.solution) for p in train_set if p.solution]
    version = 0
    if w.steps and examples:
        roles.learner.call("load_warmup", ray.put(examples), end_ids)
        probe = train_set[: w.probe_size]
        done, accuracy = 0, None
        while done < w.steps and (accuracy is None or accuracy < w.target_accuracy):
            chunk = min(w.check_every if w.target_accuracy > 0 else w.steps, w.steps - done)
            losses = roles.learner.warmup(chunk, w.batch_size, w.lr, cfg.trainer.seed + done)
            done += chunk
            version += 1
            roles.channel.push(version)
            if w.target_accuracy > 0:
                accuracy = evaluate(roles, probe)
        probe_note = f", probe accuracy {accuracy:.1%}" if accuracy is not None else ""
        say(f"warm-up: {done} supervised steps, loss {losses[-1]:.3f}{probe_note}")
    roles.learner.call("snapshot_reference")  # pi_ref is the model GRPO starts from
    return version


def find_resume_point(cfg: Config) -> Optional[Path]:
    """The checkpoint `trainer.resume` names (None: start fresh)."""
    from cluster.checkpoint import latest_checkpoint

    if cfg.trainer.resume is None:
        return None
    if cfg.trainer.resume != "auto":
        return Path(cfg.trainer.resume).expanduser()
    run_dir = Path(cfg.trainer.output_dir).expanduser() / cfg.trainer.run_name
    found = latest_checkpoint(run_dir)
    if found is None:
        say(f"trainer.resume=auto: no complete checkpoint in {run_dir}; starting from the beginning")
    return found


def resume(roles: Roles, checkpoint: Path, sampler) -> Dict[str, object]:
    """Learner state, prompt position and RNGs from `checkpoint`; the generation workers get
    the restored weights (and its policy version) before they generate anything."""
    from cluster.checkpoint import load_trainer_state, restore_driver_rng

    state = load_trainer_state(checkpoint)
    roles.learner.call("load_checkpoint", str(checkpoint))
    sampler.load_state_dict(state["sampler"])
    restore_driver_rng(state["rng"])
    roles.channel.push(state["policy_version"])
    return state


def resume_hint(cfg: Config, run_dir: Path) -> str:
    from cluster.checkpoint import latest_checkpoint

    last = latest_checkpoint(run_dir)
    if last is None:
        return "No checkpoint was written (set trainer.save_every to have one next time)."
    return (f"Its last checkpoint is {last}: continue with the same overrides plus "
            f"trainer.run_name={cfg.trainer.run_name} trainer.resume=auto")


def _injected_fault(step: int, roles: Roles) -> None:
    """Fault injection for the recovery tests, once step k is logged and checkpointed:
    GRPO_FAULT=driver@k kills this process (SIGKILL, as a lost head node would);
    GRPO_FAULT=learner@k kills learner rank 1 (the next update then fails)."""
    fault = os.environ.get("GRPO_FAULT", "")
    if not fault.endswith(f"@{step}"):
        return
    if fault.startswith("driver@"):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.startswith("learner@"):
        import ray

        ray.kill(roles.learner.ranks[-1])


def evaluate(roles: Roles, problems) -> float:
    """Greedy accuracy on `problems` through the vLLM actors and the verifier pool."""
    from rollout.pool import as_batch

    refs, _ = roles.rollout.generate(as_batch(problems), 1, greedy=True, seed=0)
    _, stats = roles.verifiers.score(refs)
    key = "score_sum/math" if "score_sum/math" in stats else next(k for k in stats if k.startswith("score_sum/"))
    return stats[key] / max(stats["completions"], 1)


def algorithm(cfg: Config) -> str:
    return "PPO" if cfg.algo.adv_estimator == "gae" else "GRPO"


def say(message: str, since: Optional[float] = None) -> None:
    stamp = f"[{time.time() - since:6.1f}s] " if since is not None else ""
    print(f"{stamp}{message}", flush=True)


# ---- set-up outside the loop ------------------------------------------------------------------
def resolve_model(cfg: Config) -> str:
    """The model folder (or hub id) that learner and rollout load; builds the tiny model once."""
    path = cfg.model.path
    if path:
        local = os.path.expanduser(path)
        looks_local = local.startswith((".", "/", "~")) or os.path.exists(local)
        if looks_local and not os.path.isdir(local):
            raise ConfigError(f"model.path: no such folder '{path}'")
        if looks_local:
            check_model_length(cfg, local)
        return local if looks_local else path
    from learner.tiny_model import build_tiny_model

    folder = build_tiny_model(cfg.model, cfg.trainer.seed)
    check_model_length(cfg, folder)
    return folder


def prepare_prompts(cfg: Config, heldout, train_set):
    """Every row rendered into the text the model sees (prompt template, system prompt, chat
    template); the stops that end a turn join rollout.stop_token_ids."""
    from rollout.prompts import prepare

    name = cfg.model.path if cfg.model.name == "hf" else cfg.model.name
    rendered, info = prepare(cfg.data, cfg.model.path, name, {"train": train_set, "eval": heldout})
    cfg.rollout.stop_token_ids = sorted(set(cfg.rollout.stop_token_ids) | set(info["stop_token_ids"]))
    tokens, where = info["longest_prompt"]
    if tokens + cfg.rollout.max_new_tokens > cfg.rollout.max_model_len:
        raise ConfigError(f"the longest prompt ({where}, {tokens} tokens as rendered) plus rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens} exceeds rollout.max_model_len={cfg.rollout.max_model_len}")
    return rendered["eval"], rendered["train"], info


def show_prompt(run_dir: Path, prompts: Dict[str, object], started: float) -> None:
    """What the model sees for the first training row, printed and saved as prompt_example.txt."""
    how = "chat template applied" if prompts["chat_template"] else "no chat template"
    stops = ", ".join(prompts["stop_tokens"])
    (run_dir / "prompt_example.txt").write_text(prompts["first_prompt"])
    text = prompts["first_prompt"]
    shown = text if len(text) <= 600 else text[:600] + f"... ({len(text)} characters)"
    say(f"the first training prompt as the model sees it ({how}; a completion stops at {stops}):\n"
        f"{shown}\n---", started)


def check_inputs(cfg: Config, train_set) -> None:
    """What the schema cannot know: the size of the data."""
    if len(train_set) < cfg.trainer.prompts_per_step:
        raise ConfigError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} exceeds the "
                          f"{len(train_set)} training prompts")
    with_solution = sum(1 for p in train_set if p.solution)
    if cfg.warmup.steps and with_solution and with_solution < cfg.warmup.batch_size:
        raise ConfigError(f"warmup.batch_size={cfg.warmup.batch_size} exceeds the {with_solution} "
                          "training rows with a solution")


def check_resources(cfg: Config, roles=("rollout", "learner", "reward")) -> None:
    """Every role's CPUs and GPUs, on the nodes cluster.nodes names, against what the
    connected cluster has (a placement group it cannot hold would wait forever)."""
    import ray

    from cluster.compose import check_gpu_layout
    from cluster.placement import check

    check_gpu_layout(cfg, ray.cluster_resources().get("GPU", 0.0))
    missing = check(cfg, ray.nodes(), roles)
    if missing:
        raise ConfigError(
            f"the actors need {'; '.join(missing)}: lower rollout/learner/reward num_workers, num_ranks "
            "or their num_cpus_*/num_gpus_*, add nodes (or raise ray.num_cpus locally)")


def check_model_length(cfg: Config, folder: str) -> None:
    config_file = Path(folder) / "config.json"
    if not config_file.exists():
        raise ConfigError(f"model.path: '{folder}' has no config.json (not a Hugging Face model folder)")
    limit = json.loads(config_file.read_text()).get("max_position_embeddings")
    if limit and cfg.rollout.max_model_len > limit:
        raise ConfigError(f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds the model's "
                          f"max_position_embeddings={limit}")


def make_run_dir(cfg: Config) -> Path:
    if not cfg.trainer.run_name:
        cfg.trainer.run_name = time.strftime("grpo-%Y%m%d-%H%M%S")
    run_dir = Path(cfg.trainer.output_dir).expanduser() / cfg.trainer.run_name
    if (run_dir / "metrics.jsonl").exists() and cfg.trainer.resume is None:
        # Never overwrite what a finished or running job produced.
        raise ConfigError(f"trainer.run_name: '{run_dir}' already holds a run; pick another name")
    run_dir.mkdir(parents=True, exist_ok=True)
    from omegaconf import OmegaConf

    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return run_dir


def print_summary(run_dir: Path, summary: Dict[str, object]) -> None:
    print(
        f"\nheld-out greedy accuracy: {summary['heldout_accuracy_before']:.1%} after warm-up -> "
        f"{summary['heldout_accuracy_after']:.1%} after GRPO ({summary['grpo_steps']} steps, "
        f"{summary['wall_minutes']:.1f} min)\n"
        f"run files: {run_dir}/ (config.yaml, metrics.jsonl, summary.json, report.png, final_model/)"
        + (f"\nwandb run: {summary['wandb_dir']}" if summary.get("wandb_dir") else ""),
        flush=True,
    )


def main(argv: Optional[List[str]] = None) -> int:
    from cluster.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
