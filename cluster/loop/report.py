"""report.png: the run's curves, readable at a glance (one panel per question a user asks)."""
from __future__ import annotations

import json
from pathlib import Path

PANELS = [
    ("reward per verifier", ["reward_mean", "score/*"]),
    ("accuracy", ["accuracy", "heldout_accuracy"]),
    ("KL to reference", ["kl"]),
    ("policy entropy (nats/token)", ["entropy"]),
    ("clipping and ratio", ["clip_fraction", "ratio_mean", "ratio_max"]),
    ("advantage |A| mean", ["advantage_abs_mean"]),
    ("response length (tokens)", ["response_length_mean"]),
    ("truncated fraction", ["truncated_fraction"]),
    ("learning rate and grad norm", ["lr", "grad_norm"]),
    ("time per step by phase (s)", ["time_step", "time_generate", "time_reward", "time_train", "time_weight_sync"]),
    ("throughput (completion tokens/s)", ["tokens_per_s", "generate_tokens_per_s"]),
    ("weight sync (GB/s)", ["sync_gbps"]),
    ("buffer and staleness", ["buffer_groups", "batches_ahead", "staleness_max", "dropped_stale"]),
    ("sampler/learner mismatch", ["sampler_logprob_gap", "mismatch_k3", "mismatch_chi2"]),
    ("tokens each correction leaves out", ["masked_fraction_*", "is_capped_fraction"]),
    ("tokens per policy version (lag)", ["tokens_version_lag/*"]),
    ("learner padding (share of positions)", ["padded_fraction"]),
    ("faults", ["actor_restarts", "reward_timeouts", "reward_errors"]),
    ("tool use per episode", ["turns_mean", "tool_calls_mean", "observation_token_fraction"]),
    ("tool failures and time (s)", ["tool_errors", "tool_timeouts", "time_tools", "time_tools_blocking"]),
]
LOG_SCALE = {"learning rate and grad norm"}
COLS = 4


def _keys(pattern: str, rows) -> list:
    if pattern.endswith("*"):
        return sorted({k for r in rows for k in r if k.startswith(pattern[:-1])})
    return [pattern]


def panel_series(rows: list, heldout_before: float | None = None,
                 heldout_after: float | None = None) -> list[tuple[str, dict[str, list]]]:
    """Each panel's curves as (title, {metric: [(step, value), ...]}), in PANELS' order, leaving
    out the panels whose metrics this run never logged (a run without tools has no tool panels)."""
    panels = []
    for title, patterns in PANELS:
        series = {}
        for key in (k for p in patterns for k in _keys(p, rows)):
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if key == "heldout_accuracy" and heldout_before is not None and heldout_after is not None:
                # Before GRPO is step 0; the final evaluation is the last step.
                last = rows[-1]["step"] if rows else 0
                points = [(0, heldout_before)] + [p for p in points if p[0] != last] + [(last, heldout_after)]
            if points:
                series[key] = points
        if series:
            panels.append((title, series))
    return panels


def write_report(run_dir: Path, heldout_before: float | None = None, heldout_after: float | None = None) -> Path:
    import matplotlib  # the headless backend must be chosen before pyplot's import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    panels = panel_series(rows, heldout_before, heldout_after)
    nrows = max(1, (len(panels) + COLS - 1) // COLS)
    fig, axes = plt.subplots(nrows, COLS, figsize=(18, 3 * nrows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels):
        for key, points in series.items():
            ax.plot(*zip(*points), marker="o", markersize=2, linewidth=1.2, label=key)
        if title in LOG_SCALE:
            ax.set_yscale("log")
        if len(series) > 1:
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if heldout_before is not None and heldout_after is not None:
        fig.suptitle(f"{run_dir.name}: held-out greedy accuracy {heldout_before:.1%} -> {heldout_after:.1%}")
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
