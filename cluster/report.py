"""report.png: the run's curves, readable at a glance."""
from __future__ import annotations

import json
from pathlib import Path

PANELS = [
    ("reward_mean", "reward (mean)"),
    ("accuracy", "accuracy (train samples)"),
    ("heldout_accuracy", "held-out greedy accuracy"),
    ("kl", "KL to reference"),
    ("response_length_mean", "response length (tokens)"),
    ("time_step", "step time (s)"),
]


def write_report(run_dir: Path, heldout_before: float | None = None, heldout_after: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if key == "heldout_accuracy" and heldout_before is not None and heldout_after is not None:
            # Before GRPO is step 0; the final evaluation is the last step.
            last = rows[-1]["step"] if rows else 0
            points = [(0, heldout_before)] + [p for p in points if p[0] != last] + [(last, heldout_after)]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=2, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    if heldout_before is not None and heldout_after is not None:
        fig.suptitle(f"{run_dir.name}: held-out greedy accuracy {heldout_before:.1%} -> {heldout_after:.1%}")
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
