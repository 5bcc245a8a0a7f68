"""The GRPO run: `run_job` reads as its table of contents; each phase is one named call on the
roles (cluster/loop/phases.py), and everything the run holds lives in one `Run`
(cluster/loop/run.py) that is closed however the run ends. The driver only ever holds ObjectRefs
to prompt groups, never their payloads. Its inputs were checked before (cluster/cli/train.py).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, Optional

from cluster.loop.batches import AHEAD_FILE
from cluster.loop.batches import freeze as freeze_batches
from cluster.loop.checkpoint import save_checkpoint
from cluster.loop.eval_job import evaluate_full, write_records
from cluster.loop.evaluation import format_table
from cluster.loop.phases import algorithm, find_resume_point, grpo_step, make_batches, resume, resume_hint, warm_up
from cluster.loop.recovery import recover_learner
from cluster.loop.report import write_report
from cluster.loop.roles import evaluate
from cluster.loop.run import Run
from cluster.loop.signals import Preempted, steps_running, stop_requested
from cluster.loop.sync_channel import WeightSyncError
from common.config import Config
from common.messages import ResolvedInputs, StepRecord, TrainerState
from data.datasets import PromptSampler
from learner.group import LearnerError


def run_job(cfg: Config, inputs: ResolvedInputs, train_set, heldout, started: float) -> Dict[str, object]:
    """The whole run of a checked job: warm-up (or the checkpoint resumed from), GRPO steps,
    held-out accuracy before and after. Returns the summary."""
    resume_from = find_resume_point(cfg)
    run = Run(cfg, inputs, started=started)
    try:
        run.start()
        first_step = begin(run, train_set, heldout, resume_from)
        run.open_logger(first_step)
        run_steps(run, first_step, heldout)
        summary = finish(run, heldout)
    finally:
        run.close()
    print_summary(Path(summary["run_dir"]), summary)
    return summary


def begin(run: Run, train_set, heldout, resume_from: Optional[Path]) -> int:
    """The warm-up and the accuracy GRPO starts from, or the state of the checkpoint resumed
    from; returns the first GRPO step."""
    cfg = run.cfg
    run.sampler = PromptSampler(train_set, cfg.trainer.seed)
    if resume_from is None:
        end_ids = run.inputs.prompts.turn_end_ids
        run.version = warm_up(run.roles, cfg, train_set, list(end_ids) if end_ids else None)
        run.accuracy_before = evaluate(run.roles, heldout)
        run.say(f"held-out greedy accuracy after warm-up: {run.accuracy_before:.1%}")
        if cfg.trainer.max_restarts:  # a learner lost before the first scheduled save comes back to here
            checkpoint(run, 0)
        return 1
    state, run.ahead = resume(run.roles, resume_from, run.sampler)
    run.version, run.accuracy_before = state.policy_version, state.accuracy_before
    run.say(f"resumed from {resume_from} (step {state.step}, policy version {run.version})")
    return state.step + 1


def run_steps(run: Run, first_step: int, heldout) -> None:
    """The GRPO steps: each one logged, evaluated and checkpointed as configured."""
    cfg = run.cfg
    run.batches = make_batches(cfg, run.roles, run.sampler, first_step, run.ahead)
    run.ahead = []
    step = first_step
    with steps_running():
        while step <= cfg.trainer.max_steps:
            try:
                record = grpo_step(step, run.version, run.roles, run.batches, run.buffer, cfg)
                end_step(run, step, record, heldout)  # its checkpoint needs every rank too
            except (LearnerError, WeightSyncError) as error:
                # A lost learner shard, or a push that could not be completed or retried (with NCCL
                # a receiver lost mid-broadcast leaves the sender's communicator unusable): a new
                # learner group from the last checkpoint, or (no restarts left) stop and say how
                # to go on.
                step = recover_learner(run, step, error)
                continue
            step += 1
    run.stop_batches()


def end_step(run: Run, step: int, record: StepRecord, heldout) -> None:
    """Log the step, evaluate and checkpoint on schedule; on SIGTERM, checkpoint it and stop."""
    cfg = run.cfg
    run.version = record.policy_version
    for event in record.events:
        run.say(event.line(step))
    row = dict(record.metrics)
    if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
        row.update(periodic_eval(run, heldout))
    row["wall_seconds"] = time.time() - run.started  # since the job started: the gaps between steps show
    run.logger.log(row)
    stopping = stop_requested() and step < cfg.trainer.max_steps
    if stopping or (cfg.trainer.save_every and (step % cfg.trainer.save_every == 0
                                                 or step == cfg.trainer.max_steps)):
        checkpoint(run, step)
    run.samples.append(record.samples)  # the step is committed: logged, and checkpointed when due
    if stopping:
        raise Preempted(f"stopped by SIGTERM after step {step}, checkpointed; everything the run started "
                        f"has been stopped. " + resume_hint(cfg, run.run_dir))


def periodic_eval(run: Run, heldout) -> Dict[str, float]:
    started = time.perf_counter()
    row = {"heldout_accuracy": evaluate(run.roles, heldout)}
    if run.cfg.eval.n:
        row.update(evaluate_full(run.roles.rollout, run.roles.verifiers, heldout, run.cfg)[0])
    row["time_eval"] = time.perf_counter() - started
    return row


def checkpoint(run: Run, step: int) -> None:
    """Checkpoint `step`; in async mode with the batches made ahead of the learner (made by
    older weights than the checkpoint's, so a resume trains on them instead of making them)."""
    cfg = run.cfg
    started = time.perf_counter()
    ahead, sampler = run.batches.ahead_state() if run.batches is not None else ([], run.sampler.state_dict())
    state = TrainerState(step=step, policy_version=run.version, sampler=sampler, accuracy_before=run.accuracy_before,
                         seed=cfg.trainer.seed)
    save_checkpoint(run.run_dir, step, run.roles.learner, state, cfg.trainer.keep_checkpoints,
                    extra={AHEAD_FILE: freeze_batches(ahead)} if ahead else None)
    run.checkpoint_seconds.append(time.perf_counter() - started)


def finish(run: Run, heldout) -> Dict[str, object]:
    """Held-out accuracy after GRPO, the final evaluation, the model, summary.json, report.png."""
    cfg, roles, accuracy_before = run.cfg, run.roles, run.accuracy_before
    accuracy_after = evaluate(roles, heldout)
    run.say(f"held-out greedy accuracy after {algorithm(cfg)}: {accuracy_after:.1%}")
    eval_metrics = {}
    if cfg.eval.n:  # pass@k / maj@k of the final policy, one record per prompt in eval.jsonl
        eval_metrics, records = evaluate_full(roles.rollout, roles.verifiers, heldout, cfg)
        write_records(run.run_dir, records)
        run.say(f"evaluation of the final policy ({cfg.eval.n} samples per prompt):\n{format_table(eval_metrics)}")
    summary = {
        "heldout_accuracy_before": accuracy_before,
        "heldout_accuracy_after": accuracy_after,
        "heldout_size": len(heldout),
        "grpo_steps": cfg.trainer.max_steps,
        "policy_version": run.version,
        "wall_minutes": (time.time() - run.started) / 60,
        "final_model": roles.learner.save_pretrained(str(run.run_dir / "final_model")),
        "checkpoints": len(run.checkpoint_seconds),
        "checkpoint_seconds": sum(run.checkpoint_seconds),
        "learner_restarts": run.learner_restarts,
        **eval_metrics,
    }
    run.logger.summary(summary)
    summary_file = run.run_dir / "summary.json"
    summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    write_report(run.run_dir, accuracy_before, accuracy_after)
    run.logger.artifacts([run.run_dir / name for name in ("config.yaml", "summary.json", "report.png")])
    summary["wandb_dir"] = run.close_logger()
    summary_file.write_text(json.dumps(summary, indent=2) + "\n")  # with the wandb run's folder, known now
    return {**summary, "run_dir": str(run.run_dir)}


def print_summary(run_dir: Path, summary: Dict[str, object]) -> None:
    print(
        f"\nheld-out greedy accuracy: {summary['heldout_accuracy_before']:.1%} after warm-up -> "
        f"{summary['heldout_accuracy_after']:.1%} after GRPO ({summary['grpo_steps']} steps, "
        f"{summary['wall_minutes']:.1f} min)\n"
        f"run files: {run_dir}/ (config.yaml, metrics.jsonl, summary.json, report.png, final_model/)"
        + (f"\nwandb run: {summary['wandb_dir']}" if summary.get("wandb_dir") else ""),
        flush=True,
    )
