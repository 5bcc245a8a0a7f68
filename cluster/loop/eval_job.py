"""Evaluation through the rollout and verifier pools: during training, and as its own job.

`grpo eval MODEL_DIR [overrides]` evaluates a saved model (a run's `final_model/`, an exported
checkpoint or any Hugging Face folder) on the configured evaluation set without training:
greedy accuracy and, with eval.n > 0, pass@k and maj@k over eval.n samples per prompt at
eval.temperature. It writes `eval.jsonl` (one row per prompt: its samples, their extracted
answers and correctness, its pass@k/maj@k) and `eval_summary.json` into the run folder and
prints the table. With rollout.agent (e.g. `data=mul_agent`) each sample is an episode of the
agent through the generation workers' endpoint, scored on the answer it returns, and the
summary counts the agent's requests, failures and tool calls.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import ray

from cluster.layout import EVAL_ROLES
from cluster.loop.batches import generation_requests
from cluster.loop.evaluation import default_ks, format_table, mean_metrics, prompt_metrics
from cluster.loop.launch import ACTOR_ENV, check_resources, make_run_dir, run_config, run_name, say, show_prompt
from cluster.loop.placement import Placement
from cluster.loop.roles import start_rollout, start_verifiers
from common.config import Config
from common.messages import ResolvedInputs
from common.ray_utils import init_ray
from reward.verifiers import extract_answer

EVAL_SEED = 1  # the same samples' random streams at every evaluation: the steps compare


def score_key(verifiers: Sequence[str]) -> str:
    """The verifier whose score says a completion is right: math if used, else the first."""
    return "math" if "math" in verifiers else verifiers[0]


AGENT_COUNTS = ("agent_requests", "agent_errors", "agent_timeouts", "tool_calls", "template_drift")
"""What an evaluation with an agent (rollout.agent) counts, as `eval/<name>`: a failed episode
scores 0, and these say how many there were."""


def _scored_groups(rollout, verifiers, problems, n: int, greedy: bool, counts: Dict[str, float],
                   temperature=None) -> list:
    requests = generation_requests(list(enumerate(problems)), EVAL_SEED)
    generated = rollout.generate(requests, n, greedy=greedy, temperature=temperature)
    for name in counts:
        counts[name] += generated.stats.get(name, 0.0)
    scored, _ = verifiers.score(generated.refs)
    return ray.get(scored)


def evaluate_full(rollout, verifiers, problems, cfg: Config) -> Tuple[Dict[str, float], List[dict]]:
    """Metrics over `problems` (keys `eval/...`) and one record per prompt. With rollout.agent
    every sample is an episode of the agent through the workers' endpoint, scored on its answer."""
    key = score_key(cfg.reward.verifiers)
    counts = {name: 0.0 for name in (AGENT_COUNTS if cfg.rollout.agent is not None else ())}
    greedy = _scored_groups(rollout, verifiers, problems, 1, greedy=True, counts=counts)
    records = [{"index": g.index, "prompt": g.prompt, "answer": g.answer, "greedy": g.completions[0],
                "greedy_score": g.scores[key][0]} for g in greedy]
    metrics = {"eval/greedy": sum(r["greedy_score"] for r in records) / max(len(records), 1)}
    if cfg.eval.n:
        ks = default_ks(cfg.eval.n, cfg.eval.k)
        sampled = _scored_groups(rollout, verifiers, problems, cfg.eval.n, greedy=False, counts=counts,
                                 temperature=cfg.eval.temperature)
        per_prompt = []
        for record, group in zip(records, sampled):
            correct = [score >= 1.0 - 1e-9 for score in group.scores[key]]
            answers = [extract_answer(c) for c in group.completions]
            lengths = [len(ids) for ids in group.completion_ids]
            truncated = [reason == "length" for reason in group.finish_reasons]
            stats = prompt_metrics(answers, correct, ks)
            record["samples"] = [{"completion": c, "answer": a, "correct": ok, "tokens": len(ids), "finish": reason,
                                  "last_token_id": ids[-1] if ids else None}
                                 for c, a, ok, ids, reason in zip(group.completions, answers, correct,
                                                                  group.completion_ids, group.finish_reasons)]
            record.update(stats)
            per_prompt.append({**stats, "mean_length": sum(lengths) / len(lengths),
                               "truncated_fraction": sum(truncated) / len(truncated)})
        metrics.update({f"eval/{k}": v for k, v in mean_metrics(per_prompt).items()})
    metrics.update({f"eval/{name}": value for name, value in counts.items()})
    return metrics, records


def write_records(run_dir: Path, records: List[dict]) -> Path:
    path = run_dir / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def evaluate_model(cfg: Config, inputs: ResolvedInputs, problems, started: float) -> Dict[str, float]:
    """The `grpo eval` job, its inputs checked (cluster/cli/evaluate.py): start the rollout and
    verifier pools, evaluate, write, print."""
    init_ray(cfg.ray.address, cfg.ray.num_cpus, env_vars=ACTOR_ENV, num_gpus=cfg.ray.num_gpus)
    check_resources(cfg, EVAL_ROLES)
    cfg = run_config(cfg, inputs, run_name(cfg))  # the validated config is left as it is
    run_dir = make_run_dir(cfg)
    show_prompt(run_dir, inputs.prompts, started)
    placement = Placement(cfg, cfg.cluster.placement_timeout_s, EVAL_ROLES)
    rollout = verifiers = None
    try:
        verifiers = start_verifiers(cfg, placement)
        rollout = start_rollout(cfg, placement)
        say(f"evaluating {cfg.model.path} on {len(problems)} prompts"
            + (f", {cfg.eval.n} samples each at temperature {cfg.eval.temperature}" if cfg.eval.n else ""), started)
        metrics, records = evaluate_full(rollout, verifiers, problems, cfg)
    finally:
        for role in (rollout, verifiers):
            if role is not None:
                role.shutdown()
        placement.remove()
        ray.shutdown()
    write_records(run_dir, records)
    summary = {**metrics, "prompts": len(problems), "model": cfg.model.path,
               "wall_minutes": (time.time() - started) / 60}
    (run_dir / "eval_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{format_table(metrics)}\nrun files: {run_dir}/ (eval.jsonl, eval_summary.json, prompt_example.txt)",
          flush=True)
    return summary
