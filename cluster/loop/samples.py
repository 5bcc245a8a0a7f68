"""`samples.jsonl`: which samples each step trained on, one line per sample, so that two runs
(a straight one and one killed and resumed) can be compared sample by sample.

A sample is identified by (step, prompt index into the training set, sample index within its
group, policy version that generated it). A step's lines are appended once the step is
committed (logged, and checkpointed when it is due); a resume, or a recovery from a lost
learner, first cuts the file back to the checkpoint's step, so no sample appears twice and the
steps trained again are written again.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence, Tuple

from common.messages import GenerationRequest

FILE = "samples.jsonl"


def sample_ids(step: int, items: Sequence[GenerationRequest], versions: Sequence[int],
               group_size: int) -> List[dict]:
    """One identifier per trained sample of a batch: its groups' requests and the versions that
    made them, in training order."""
    return [{"step": step, "prompt": int(item.index), "sample": j, "version": int(version)}
            for item, version in zip(items, versions) for j in range(group_size)]


def keep_steps(path: Path, step: int) -> None:
    """A JSONL file of one line per step (metrics.jsonl, samples.jsonl) cut back to the lines of
    steps up to `step` (0: none): a resumed run writes the rest again."""
    kept = []
    if step > 0 and path.exists():
        kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


class SampleLog:
    def __init__(self, run_dir: Path, resume_step: int = 0):
        self.path = Path(run_dir) / FILE
        self.rewind(resume_step)

    def rewind(self, step: int) -> None:
        """Keep the lines of steps up to `step` (0: none)."""
        keep_steps(self.path, step)

    def append(self, samples: Sequence[dict]) -> None:
        with self.path.open("a") as f:
            f.write("".join(json.dumps(s) + "\n" for s in samples))


def read(run_dir: Path) -> List[Tuple[int, int, int, int]]:
    """A run's trained samples as (step, prompt, sample, version) tuples, in file order."""
    path = Path(run_dir) / FILE
    return [(r["step"], r["prompt"], r["sample"], r["version"])
            for r in map(json.loads, path.read_text().splitlines()) if r]
