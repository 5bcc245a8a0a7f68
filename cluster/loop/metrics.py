"""Where a run's numbers go: metrics.jsonl (always), the dashboards of `logger.backends` (wandb,
offline by default; TensorBoard; MLflow: cluster/loop/dashboards.py), the progress bar."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

from tqdm import tqdm

from cluster.loop.dashboards import open_feeds
from cluster.loop.samples import keep_steps

# Shown in the progress bar, in this order.
BAR_KEYS = {"reward_mean": "reward", "accuracy": "acc", "kl": "kl"}


class MetricsLogger:
    def __init__(self, run_dir: Path, config: dict, total_steps: int, logger_cfg, progress: bool,
                 resume_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        self.sent = resume_step  # the last step the dashboards have: they take no step twice
        self._keep(resume_step)
        # Each dashboard opens and is fed on a thread of its own (a slow or failing one holds up
        # no step); the rows are written to metrics.jsonl here first, whatever they do.
        self.feeds = open_feeds(logger_cfg.backends, run_dir, config, logger_cfg)
        self.bar = None
        if progress:
            self.bar = tqdm(total=total_steps, initial=resume_step, desc="GRPO", unit="step", dynamic_ncols=True)

    def _keep(self, step: int) -> None:
        """A resumed run keeps the lines up to its checkpoint and writes the rest again."""
        keep_steps(self.path, step)

    def rewind(self, step: int) -> None:
        """Back to the end of `step` (a learner rebuilt from its checkpoint trains the later
        steps again): their lines are written again; the dashboards keep the ones they have, which
        the steps trained again repeat."""
        self._keep(step)
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def log(self, row: Dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        step = int(row["step"])
        if step > self.sent:
            row = dict(row)  # the feeds read it later, on their threads
            for feed in self.feeds:
                feed.put("log", lambda board: board.log(row, step))
            self.sent = step
        if self.bar is not None:
            self.bar.set_postfix({short: f"{row[key]:.3f}" for key, short in BAR_KEYS.items() if key in row})
            self.bar.update(1)

    def summary(self, values: Dict[str, float]) -> None:
        """The run's final figures (held-out accuracy, the final evaluation), at its last step."""
        values, step = dict(values), self.sent
        for feed in self.feeds:
            feed.put("summary", lambda board: board.summary(values, step))

    def artifacts(self, paths: List[Path]) -> None:
        """Files of the run folder (summary.json, report.png) for the dashboards that keep files."""
        for feed in self.feeds:
            feed.put("artifacts", lambda board: board.artifacts(list(paths)))

    def close(self) -> Optional[str]:
        """Finish every dashboard (each within logger.timeout_s); returns the wandb run's folder
        (None without wandb)."""
        if self.bar is not None:
            self.bar.close()
        folders = {feed.name: feed.close() for feed in self.feeds}
        return folders.get("wandb")
