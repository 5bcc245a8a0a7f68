"""Where a run's numbers go: metrics.jsonl (always), wandb (offline by default), the progress bar."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional

# Shown in the progress bar, in this order.
BAR_KEYS = {"reward_mean": "reward", "accuracy": "acc", "kl": "kl"}


class MetricsLogger:
    def __init__(self, run_dir: Path, config: dict, total_steps: int, logger_cfg, progress: bool):
        self.path = run_dir / "metrics.jsonl"
        self.path.write_text("")
        self.rows: List[Dict[str, float]] = []
        self.wandb_run = None
        if logger_cfg.backend == "wandb":
            import wandb

            os.environ.setdefault("WANDB_MODE", logger_cfg.mode)
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = wandb.init(project=logger_cfg.project, name=run_dir.name, config=config,
                                        dir=str(run_dir))
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc="GRPO", unit="step", dynamic_ncols=True)

    def log(self, row: Dict[str, float]) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=int(row["step"]))
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
