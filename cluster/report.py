"""report.png: the run's curves, readable at a glance."""
from __future__ import annotations

import json
from pathlib import Path

PANELS = [
    ("reward_mean", "reward (mean)"),
    ("accuracy", "accuracy (train samples)"),
    ("kl", "KL to reference"),
    ("clip_fraction", "clip fraction"),
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
