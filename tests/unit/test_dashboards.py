"""logger.backends: TensorBoard and MLflow get every metric, the summary and the run's files, read
back with their own readers (TensorBoard's event reader, MLflow's client on its file store); a
dashboard that fails or hangs is warned about once and the rows still reach metrics.jsonl."""
from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from cluster.loop.dashboards import Feed, flatten, mlflow_key, mlflow_uri
from cluster.loop.metrics import MetricsLogger
from common.config import LoggerConfig

# `reward_timeouts` beside `reward_timeouts/math`, as a run logs them: a file and a folder of the
# same name in MLflow's file store, were `/` kept.
ROWS = [{"step": 1, "reward_mean": 0.25, "kl": 0.0, "eval/pass@4": 0.5, "score/math": 0.2, "reward_timeouts": 0,
         "reward_timeouts/math": 0, "note": "text"},
        {"step": 2, "reward_mean": 0.75, "kl": 0.01, "eval/pass@4": 0.625, "score/math": 0.7, "reward_timeouts": 1,
         "reward_timeouts/math": 1, "note": "text"}]
SUMMARY = {"heldout_accuracy_before": 0.5, "heldout_accuracy_after": 0.875, "final_model": "/somewhere"}
CONFIG = {"algo": {"beta": 0.04, "group_size": 8}, "logger": {"backends": ["tensorboard", "mlflow"]}}


def _run(run_dir: Path, settings: LoggerConfig) -> MetricsLogger:
    """The logger as the run drives it: rows, the summary, the run's files, close."""
    (run_dir / "summary.json").write_text(json.dumps(SUMMARY))
    (run_dir / "report.png").write_bytes(b"\x89PNG not really")
    logger = MetricsLogger(run_dir, CONFIG, total_steps=2, logger_cfg=settings, progress=False)
    for row in ROWS:
        logger.log(row)
    logger.summary(SUMMARY)
    logger.artifacts([run_dir / "summary.json", run_dir / "report.png"])
    return logger


def test_tensorboard_and_mlflow_get_every_metric(tmp_path, capfd):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = LoggerConfig(backends=["tensorboard", "mlflow"])
    _run(tmp_path, settings).close()
    assert "warning" not in capfd.readouterr().err
    metrics = [k for k in ROWS[0] if k not in ("step", "note")]

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    for key in metrics:
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(r["step"], pytest.approx(r[key])) for r in ROWS]
    assert [(e.step, e.value) for e in events.Scalars("summary/heldout_accuracy_after")] == [(2, 0.875)]
    assert "note" not in scalars and "summary/final_model" not in scalars
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"beta": 0.04' in config_text

    client = MlflowClient(tracking_uri=mlflow_uri(settings, tmp_path))
    run_id = (tmp_path / "mlflow_run_id").read_text()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert client.get_experiment(run.info.experiment_id).name == settings.project
    for key in metrics:
        history = client.get_metric_history(run_id, mlflow_key(key))
        assert sorted((m.step, m.value) for m in history) == [(r["step"], pytest.approx(r[key])) for r in ROWS]
    assert run.data.metrics["summary.heldout_accuracy_after"] == 0.875
    assert run.data.params["algo.beta"] == "0.04" and run.data.params["algo.group_size"] == "8"
    assert {a.path for a in client.list_artifacts(run_id)} == {"summary.json", "report.png"}
    assert json.loads(Path(client.download_artifacts(run_id, "summary.json", str(tmp_path / "got"))).read_text()) \
        == SUMMARY


def test_mlflow_keys_and_params():
    assert mlflow_key("eval/pass@4") == "eval.pass_at_4" and mlflow_key("score/math") == "score.math"
    assert flatten({"a": {"b": 1, "c": {}}, "d": [1]}) == {"a.b": 1, "a.c": {}, "d": [1]}


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    settings = LoggerConfig(backends=["mlflow"])
    logger = MetricsLogger(tmp_path, CONFIG, 4, settings, progress=False)
    logger.log(ROWS[0])
    logger.close()
    resumed = MetricsLogger(tmp_path, CONFIG, 4, settings, progress=False, resume_step=1)
    resumed.log(ROWS[0])  # a step the dashboards have is not sent twice
    resumed.log({**ROWS[1], "step": 2})
    resumed.close()
    client = MlflowClient(tracking_uri=mlflow_uri(settings, tmp_path))
    runs = client.search_runs([client.get_experiment_by_name(settings.project).experiment_id])
    assert len(runs) == 1
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "reward_mean")] == [1, 2]


def test_a_server_that_refuses_is_warned_about_once(tmp_path, capfd):
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = LoggerConfig(backends=["mlflow", "tensorboard"], mlflow_tracking_uri=f"http://127.0.0.1:{port}",
                            timeout_s=2)
    logger = _run(tmp_path, settings)
    assert logger.close() is None
    err = capfd.readouterr().err
    assert err.count("grpo: warning: logger mlflow failed") == 1, err
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == ROWS
    assert (tmp_path / "tensorboard").is_dir()  # the other dashboard went on


def test_a_store_lost_mid_run_is_warned_about_once(tmp_path, capfd):
    settings = LoggerConfig(backends=["mlflow"])
    logger = MetricsLogger(tmp_path, CONFIG, 3, settings, progress=False)
    logger.log(ROWS[0])
    _drain(logger.feeds[0])
    store = tmp_path / "mlruns"
    store.rename(tmp_path / "mlruns-gone")
    store.write_text("not a folder any more")  # the store's folder is gone: every later call fails
    for step in (2, 3):
        logger.log({**ROWS[1], "step": step})
    logger.close()
    err = capfd.readouterr().err
    assert err.count("grpo: warning: logger mlflow failed (log:") == 1, err
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def _drain(feed: Feed) -> None:
    """Until the feed has made every call queued so far."""
    done = threading.Event()
    feed.put("wait", lambda board: done.set())
    assert done.wait(60)


def test_a_hanging_server_holds_up_no_step(tmp_path, capfd):
    """A server that accepts and never answers: logging returns at once, the run's end waits
    logger.timeout_s for the dashboard and leaves it behind with a warning."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        settings = LoggerConfig(backends=["mlflow"], timeout_s=1,
                                mlflow_tracking_uri=f"http://127.0.0.1:{server.getsockname()[1]}")
        logger = _run(tmp_path, settings)
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(ROWS)
        assert logger.close() is None
    err = capfd.readouterr().err
    assert err.count("grpo: warning: logger mlflow") == 1, err


def test_feed_drops_what_follows_a_failure(capfd):
    """The feed's own logic: the call that raised is the last one made."""
    made = []

    class Board:
        def log(self, step):
            if step == 2:
                raise OSError("disk full\nsecond line")
            made.append(step)

        def close(self):
            made.append("closed")

    feed = Feed("fake", Board, timeout_s=10)
    for step in (1, 2, 3):
        feed.put("log", lambda board, step=step: board.log(step))
    assert feed.close() is None
    assert made == [1]
    assert capfd.readouterr().err.strip() == ("grpo: warning: logger fake failed (log: OSError: disk full); it gets "
                                              "nothing more from this run, metrics.jsonl has every step")
