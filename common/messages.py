"""What crosses a boundary between the run's parts, as types rather than dicts of agreed keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class RestartEvent:
    """An actor that died during a step and came back (restarted by Ray, or rebuilt by the driver)."""
    role: str               # "generation worker", "verifier", "learner rank"
    cause: str              # what killed it, in a few words (common.ray_utils.death_cause)
    actor: int = -1         # its index in its pool; -1 when not known
    seconds: Optional[float] = None  # until it was back and ready; None when not timed
    during: Optional[str] = None     # what it was doing ("the weight push", "train_step")

    def line(self, step: int) -> str:
        """The driver's one line for it (printed, not logged)."""
        who = self.role + (f" {self.actor}" if self.actor >= 0 else "")
        during = f" during {self.during}" if self.during else ""
        back = f"; back in {self.seconds:.1f} s" if self.seconds is not None else ""
        return f"step {step}: {who} died{during}: {self.cause}{back}"


@dataclass(frozen=True)
class StepRecord:
    """One GRPO step as the loop commits it: the metrics row it logs, the restarts it prints and
    the identifiers of the samples it trained (cluster/samples.py)."""
    metrics: Dict[str, Any]
    events: Tuple[RestartEvent, ...] = ()
    samples: List[list] = field(default_factory=list)

    @property
    def policy_version(self) -> int:
        return self.metrics["policy_version"]
