"""Where a run's numbers go: metrics.jsonl (always), wandb (offline by default), the progress bar."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Dict, Optional

from tqdm import tqdm

from cluster.loop.samples import keep_steps

# Shown in the progress bar, in this order.
BAR_KEYS = {"reward_mean": "reward", "accuracy": "acc", "kl": "kl"}


class MetricsLogger:
    def __init__(self, run_dir: Path, config: dict, total_steps: int, logger_cfg, progress: bool,
                 resume_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        self.sent = 0  # the last step wandb has: it takes no step twice
        self._keep(resume_step)
        self.wandb_run = None
        if logger_cfg.backend == "wandb":
            import wandb  # only with logger=wandb: its import costs seconds

            os.environ.setdefault("WANDB_MODE", logger_cfg.mode)
            os.environ.setdefault("WANDB_SILENT", "true")
            # One wandb run per run folder: a resumed job continues it (its id is kept here).
            id_file = run_dir / "wandb_id"
            if not id_file.exists():
                id_file.write_text(uuid.uuid4().hex[:12])
            self.wandb_run = wandb.init(project=logger_cfg.project, name=run_dir.name, config=config,
                                        dir=str(run_dir), id=id_file.read_text().strip(), resume="allow")
        self.bar = None
        if progress:
            self.bar = tqdm(total=total_steps, initial=resume_step, desc="GRPO", unit="step", dynamic_ncols=True)

    def _keep(self, step: int) -> None:
        """A resumed run keeps the lines up to its checkpoint and writes the rest again."""
        keep_steps(self.path, step)

    def rewind(self, step: int) -> None:
        """Back to the end of `step` (a learner rebuilt from its checkpoint trains the later
        steps again): their lines are written again; wandb keeps the ones it has, which the
        steps trained again repeat."""
        self._keep(step)
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def log(self, row: Dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None and int(row["step"]) > self.sent:
            self.wandb_run.log(row, step=int(row["step"]))
            self.sent = int(row["step"])
        if self.bar is not None:
            self.bar.set_postfix({short: f"{row[key]:.3f}" for key, short in BAR_KEYS.items() if key in row})
            self.bar.update(1)

    def summary(self, values: Dict[str, float]) -> None:
        if self.wandb_run is not None:
            self.wandb_run.summary.update(values)

    def close(self) -> Optional[str]:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            folder = self.wandb_run.dir
            self.wandb_run.finish()
            return str(Path(folder).parent)
        return None
