"""The dashboards a run's numbers are copied to (`logger.backends`): wandb, TensorBoard, MLflow.

metrics.jsonl (cluster/loop/metrics.py) is the run's record; a dashboard only mirrors it. So each
dashboard is fed from a thread of its own: a call that hangs (a tracking server gone: MLflow's
client retries for minutes by default) holds up that dashboard alone, never a step, and one that
fails says so once and gets nothing more while the run goes on.
"""
from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from common.config import LoggerConfig

# Written by the run into its folder; MLflow gets them as artifacts when the run ends.
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"


def numbers(values: Dict[str, Any]) -> Dict[str, float]:
    """The entries a dashboard can plot: ints and floats (bools as 0/1), not text or None."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


class WandbBoard:
    """One wandb run per run folder, offline unless WANDB_MODE or logger.mode say otherwise."""
    name = "wandb"

    def __init__(self, run_dir: Path, config: dict, settings: LoggerConfig):
        import wandb  # only with wandb among logger.backends: its import costs seconds

        os.environ.setdefault("WANDB_MODE", settings.mode)
        os.environ.setdefault("WANDB_SILENT", "true")
        # A resumed job continues its wandb run (the id is kept in the run folder).
        id_file = run_dir / "wandb_id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:12])
        self.run = wandb.init(project=settings.project, name=run_dir.name, config=config, dir=str(run_dir),
                              id=id_file.read_text().strip(), resume="allow")

    def log(self, row: Dict[str, Any], step: int) -> None:
        self.run.log(row, step=step)

    def summary(self, values: Dict[str, Any], step: int) -> None:
        self.run.summary.update(values)

    def artifacts(self, paths: List[Path]) -> None:
        """wandb keeps its own copy of the run's files (the run folder holds both)."""

    def close(self) -> Optional[str]:
        folder = self.run.dir
        self.run.finish()
        return str(Path(folder).parent)


class TensorBoardBoard:
    """Event files in <run folder>/tensorboard: every metric a scalar by its own name, the final
    evaluation under `summary/`, the config as text."""
    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict, settings: LoggerConfig):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))
        # Markdown: indented by four spaces, the JSON shows as a code block.
        text = "\n".join("    " + line for line in json.dumps(config, indent=2, default=str).splitlines())
        self.writer.add_text("config", text, global_step=0)

    def log(self, row: Dict[str, Any], step: int) -> None:
        for key, value in numbers(row).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def summary(self, values: Dict[str, Any], step: int) -> None:
        for key, value in numbers(values).items():
            self.writer.add_scalar(f"summary/{key}", value, global_step=step)
        self.writer.flush()

    def artifacts(self, paths: List[Path]) -> None:
        """The event files are in the run folder beside report.png and summary.json."""

    def close(self) -> Optional[str]:
        self.writer.close()
        return None


_MLFLOW_KEY = re.compile(r"[^\w./\- :]")


def mlflow_key(key: str) -> str:
    """A metric's name as MLflow takes it: `eval/pass@4` -> `eval.pass_at_4`. MLflow allows
    letters, digits and `_ - . / : space`; its file store makes `/` a folder, where
    `reward_timeouts` (a file) and `reward_timeouts/math` (in a folder of that name) cannot both
    be, so `/` becomes `.` (on every store, so that names do not depend on it)."""
    return _MLFLOW_KEY.sub("_", key.replace("@", "_at_").replace("/", "."))


def mlflow_uri(settings: LoggerConfig, run_dir: Path) -> str:
    """logger.mlflow_tracking_uri, or a file store in the run folder."""
    return settings.mlflow_tracking_uri or (run_dir / MLFLOW_DIR).absolute().as_uri()


class MLflowBoard:
    """An MLflow run in experiment `logger.project` on the tracking server or store of
    `logger.mlflow_tracking_uri` (by default a file store in <run folder>/mlruns): the config as
    params, metrics per step, the final evaluation as metrics at the last step, and config.yaml,
    summary.json and report.png as artifacts."""
    name = "mlflow"

    def __init__(self, run_dir: Path, config: dict, settings: LoggerConfig):
        uri = mlflow_uri(settings, run_dir)
        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless told it is wanted
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # MLflow retries a failed request with backoff for minutes by default; a dashboard's call
        # may take logger.timeout_s at most (a user's MLFLOW_HTTP_* settings win).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(settings.timeout_s))))
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.project)
        # A resumed job continues its MLflow run (the id is kept in the run folder).
        id_file = run_dir / "mlflow_run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            id_file.write_text(self.run_id)
            params = [Param(mlflow_key(k), str(v)[:6000]) for k, v in flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes 100 params per batch at most
                self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.uri = uri

    def _metrics(self, values: Dict[str, Any], step: int, prefix: str = "") -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(prefix + k), v, stamp, step) for k, v in numbers(values).items()]
        for start in range(0, len(metrics), 1000):  # MLflow takes 1000 metrics per batch at most
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def log(self, row: Dict[str, Any], step: int) -> None:
        self._metrics(row, step)

    def summary(self, values: Dict[str, Any], step: int) -> None:
        self._metrics(values, step, prefix="summary/")

    def artifacts(self, paths: List[Path]) -> None:
        for path in paths:
            if path.exists():
                self.client.log_artifact(self.run_id, str(path))

    def close(self) -> Optional[str]:
        self.client.set_terminated(self.run_id)
        return None


BOARDS = {board.name: board for board in (WandbBoard, TensorBoardBoard, MLflowBoard)}


def flatten(config: Any, prefix: str = "") -> Dict[str, Any]:
    """A nested config as dotted keys: {"algo": {"beta": 0.04}} -> {"algo.beta": 0.04}."""
    if not isinstance(config, dict):
        return {prefix: config}
    flat: Dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


class Feed:
    """One dashboard behind a queue, opened and fed by a daemon thread. A call that raises ends
    the feed: a one-line warning, then every later call is dropped (metrics.jsonl has them all).
    `close` waits up to `timeout_s` for what was queued."""

    def __init__(self, name: str, open_board: Callable[[], Any], timeout_s: float):
        self.name, self.timeout_s = name, timeout_s
        self.calls: "queue.Queue[Optional[Tuple[str, Callable[[Any], Any]]]]" = queue.Queue()
        self.failed = False
        self.result: Optional[str] = None
        self.thread = threading.Thread(target=self._work, args=(open_board,), name=f"grpo-{name}", daemon=True)
        self.thread.start()

    def _work(self, open_board: Callable[[], Any]) -> None:
        doing = "open"
        try:
            board = open_board()
            while True:
                item = self.calls.get()
                if item is None:
                    doing = "close"
                    self.result = board.close()
                    return
                doing, call = item
                call(board)
        except Exception as error:  # a dashboard's failure must not end the run: said once, then dropped
            if self.failed:  # already left behind by `close` (and said so)
                return
            self.failed = True
            first = (str(error).strip().splitlines() or [""])[0][:300]
            warn(f"logger {self.name} failed ({doing}: {type(error).__name__}: {first}); it gets nothing more "
                 "from this run, metrics.jsonl has every step")

    def put(self, doing: str, call: Callable[[Any], Any]) -> None:
        """Queue `call(board)`; `doing` names it in a warning."""
        if not self.failed:
            self.calls.put((doing, call))

    def close(self) -> Optional[str]:
        self.calls.put(None)
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            self.failed = True
            warn(f"logger {self.name} did not finish within logger.timeout_s={self.timeout_s:g} s; "
                 "left behind, metrics.jsonl has every step")
            return None
        return self.result


def warn(message: str) -> None:
    print(f"grpo: warning: {message}", file=sys.stderr, flush=True)


def open_feeds(backends: Iterable[str], run_dir: Path, config: dict, settings: LoggerConfig) -> List[Feed]:
    """A feed for each of `backends`, opening in the background."""
    return [Feed(name, lambda board=BOARDS[name]: board(run_dir, config, settings), settings.timeout_s)
            for name in dict.fromkeys(backends)]
