"""A lost learner rank, recovered by the driver itself (up to `trainer.max_restarts` times).

Generation workers and verifiers are restarted by Ray and re-run their call; a learner rank
cannot be: the ranks hold shards of one optimizer state and meet in every collective, so one
lost rank leaves the others unable to go on. The driver then tears the whole learner group
down (its placement group too), starts a new one, points the weight-sync channel at its rank
0, loads the newest complete checkpoint into it and pushes those weights to every engine (the
resume path of `cluster/loop/phases.py`), cuts `metrics.jsonl` and `samples.jsonl` back to the
checkpoint's step and continues from there: the steps after the checkpoint are trained again,
on the same samples, so the final model is the straight run's.
"""
from __future__ import annotations

import time

from cluster.loop.buffer import RolloutBuffer
from cluster.loop.checkpoint import latest_checkpoint
from cluster.loop.phases import make_batches, resume, resume_hint
from common.messages import RestartEvent
from common.ray_utils import death_cause


def recover_learner(run, step: int, error: Exception) -> int:
    """Rebuild the learner after `error` (a LearnerError or WeightSyncError) in `step`; returns
    the step to go on from. Raises `error`'s type with the resume line when the restarts are
    spent or there is no checkpoint to go back to."""
    cfg = run.cfg
    last = latest_checkpoint(run.run_dir)
    if run.learner_restarts >= cfg.trainer.max_restarts or last is None:
        spent = (f" (after {run.learner_restarts} recoveries, trainer.max_restarts={cfg.trainer.max_restarts})"
                 if cfg.trainer.max_restarts else "")
        raise type(error)(f"{error} at step {step}; the run stopped{spent}. "
                          + resume_hint(cfg, run.run_dir)) from error
    started = time.monotonic()
    rank = run.roles.learner.rank_index(error.__cause__)
    run.stop_batches()  # an async batch thread finishes its batch with the generation workers
    run.roles.restart_learner(cfg)
    run.buffer = RolloutBuffer()  # what the failed step had put there is trained again, from the batch
    state, ahead = resume(run.roles, last, run.sampler)
    back = state.step
    run.version = state.policy_version
    run.logger.rewind(back)
    run.samples.rewind(back)
    run.batches = make_batches(cfg, run.roles, run.sampler, back + 1, ahead)
    run.learner_restarts += 1
    during = str(error).split(" during ")[1].split(" ")[0] if " during " in str(error) else None
    cause = death_cause(error.__cause__) if error.__cause__ is not None else str(error)
    run.say(RestartEvent(
        "learner rank", f"{cause}; learner rebuilt from {last.name}, going on from step {back + 1} "
                        f"(recovery {run.learner_restarts} of {cfg.trainer.max_restarts})",
        rank, time.monotonic() - started, during).line(step))
    return back + 1

