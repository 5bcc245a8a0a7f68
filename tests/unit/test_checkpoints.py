"""Checkpoints that cannot be half-written: a kill, a full disk or a re-save at any moment
leaves a complete checkpoint that `trainer.resume=auto` takes (real files, real processes; the
learner is a stand-in that writes files as DeepSpeed's save does, since the subject here is
the folder protocol, not what is in the files)."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cluster.loop.checkpoint import (MANIFEST, STATE_FILE, CheckpointError, checkpoint_path, complete_checkpoints,
                                latest_checkpoint, save_checkpoint, skipped_line)
from common.messages import TrainerState

LEARNER = textwrap.dedent('''
    import os, time

    class FileLearner:
        """Writes `chunks` chunks of 1 MiB into learner/ds/shard.pt, and the model's config;
        with `marker`, touches it after the first chunk and then writes slowly."""
        def __init__(self, chunks=4, marker=None, fail_after=None):
            self.chunks, self.marker, self.fail_after = chunks, marker, fail_after

        def save_checkpoint(self, folder):
            os.makedirs(os.path.join(folder, "learner", "ds"))
            os.makedirs(os.path.join(folder, "model"))
            with open(os.path.join(folder, "model", "config.json"), "w") as f:
                f.write("{}")
            with open(os.path.join(folder, "learner", "ds", "shard.pt"), "wb") as f:
                for i in range(self.chunks):
                    if self.fail_after is not None and i == self.fail_after:
                        raise OSError(28, "No space left on device")
                    f.write(os.urandom(1 << 20))
                    f.flush()
                    if self.marker and i == 0:
                        open(self.marker, "w").close()
                    if self.marker:
                        time.sleep(0.5)
''')


@pytest.fixture
def learner_module(tmp_path, monkeypatch):
    (tmp_path / "file_learner.py").write_text(LEARNER)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import file_learner

    return importlib.reload(file_learner)


def _save(run_dir, step, learner, keep=0):
    return save_checkpoint(run_dir, step, learner, TrainerState(step), keep)


def _state_step(folder: Path) -> int:
    return json.loads((folder / STATE_FILE).read_text())["step"]


def test_a_checkpoint_has_a_manifest_of_every_file_written_last(tmp_path, learner_module):
    final = _save(tmp_path, 4, learner_module.FileLearner())
    manifest = json.loads((final / MANIFEST).read_text())
    assert manifest["files"] == {"learner/ds/shard.pt": 4 << 20, "model/config.json": 2,
                                 STATE_FILE: (final / STATE_FILE).stat().st_size}
    assert latest_checkpoint(tmp_path) == final and skipped_line(tmp_path) is None


def test_a_write_killed_midway_leaves_the_previous_checkpoint_the_one_resume_takes(tmp_path, learner_module):
    previous = _save(tmp_path, 4, learner_module.FileLearner())
    marker = tmp_path / "mid-write"
    script = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from file_learner import FileLearner; "
              f"from cluster.loop.checkpoint import save_checkpoint; from common.messages import TrainerState; "
              f"save_checkpoint({str(tmp_path)!r}, 6, FileLearner(chunks=20, marker={str(marker)!r}), TrainerState(6), 0)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writer = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and writer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists() and writer.poll() is None, "the writer never got mid-write"
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    assert (previous.parent / ".tmp-step-000006" / "learner" / "ds" / "shard.pt").is_file()  # really mid-write
    assert latest_checkpoint(tmp_path) == previous
    assert skipped_line(tmp_path) == (f"checkpoint .tmp-step-000006 is incomplete (its write did not finish); "
                                      f"the last complete one is {previous}")
    # the next save clears what the killed one left
    _save(tmp_path, 8, learner_module.FileLearner())
    assert not list(previous.parent.glob(".tmp-*"))
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000004", "step-000008"]


def test_a_full_disk_mid_write_raises_one_line_and_leaves_the_previous_checkpoint(tmp_path, learner_module):
    previous = _save(tmp_path, 4, learner_module.FileLearner())
    with pytest.raises(CheckpointError) as caught:
        _save(tmp_path, 6, learner_module.FileLearner(fail_after=2))
    assert str(caught.value) == (f"the checkpoint of step 6 could not be written ([Errno {errno.ENOSPC}] No space "
                                 f"left on device); the last complete one is {previous}")
    assert not list(previous.parent.glob(".tmp-*"))  # the partial write is gone: its space is back
    assert latest_checkpoint(tmp_path) == previous


def test_resaving_a_step_keeps_the_old_folder_until_the_new_one_is_in(tmp_path, learner_module, monkeypatch):
    first = _save(tmp_path, 4, learner_module.FileLearner())
    (first / STATE_FILE).write_text(json.dumps({"step": 4, "which": "old"}))  # tell the copies apart
    (first / MANIFEST).write_text(json.dumps({"files": {**json.loads((first / MANIFEST).read_text())["files"],
                                                        STATE_FILE: (first / STATE_FILE).stat().st_size}}))
    # a full disk while re-saving: the old one is untouched
    with pytest.raises(CheckpointError):
        _save(tmp_path, 4, learner_module.FileLearner(fail_after=1))
    assert json.loads((first / STATE_FILE).read_text())["which"] == "old"
    # the process dies after moving the old one aside, before renaming the new one in
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise SystemExit("killed between the two renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(SystemExit):
        _save(tmp_path, 4, learner_module.FileLearner())
    monkeypatch.setattr(os, "rename", real_rename)
    aside = first.parent / ".old-step-000004"
    assert not first.exists() and latest_checkpoint(tmp_path) == aside
    assert json.loads((aside / STATE_FILE).read_text())["which"] == "old"
    # the next save puts it back, then replaces it whole
    assert _save(tmp_path, 4, learner_module.FileLearner()) == first
    assert "which" not in json.loads((first / STATE_FILE).read_text()) and not aside.exists()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000004"]


def test_a_file_that_does_not_match_the_manifest_makes_the_checkpoint_incomplete(tmp_path, learner_module):
    previous = _save(tmp_path, 4, learner_module.FileLearner())
    damaged = _save(tmp_path, 6, learner_module.FileLearner())
    with (damaged / "learner" / "ds" / "shard.pt").open("r+b") as handle:
        handle.truncate(1000)
    assert latest_checkpoint(tmp_path) == previous
    assert skipped_line(tmp_path) == (f"checkpoint step-000006 is incomplete (learner/ds/shard.pt has 1000 bytes, "
                                      f"the manifest says {4 << 20}); the last complete one is {previous}")
    assert checkpoint_path(tmp_path, 6) == damaged


# --------------------------------------------------------------------------- SIGTERM

PREEMPTED = textwrap.dedent('''
    import sys, time
    run_dir, before_steps = sys.argv[1], sys.argv[2] == "before"
    sys.path.insert(0, run_dir)
    from cluster.cli import exits
    from cluster.loop import signals
    from cluster.loop.checkpoint import save_checkpoint
    from common.messages import TrainerState
    from file_learner import FileLearner

    def command():
        save_checkpoint(run_dir, 4, FileLearner(), TrainerState(4), 0)
        if before_steps:
            open(run_dir + "/ready", "w").close()
            time.sleep(60)  # the warm-up, say
        with signals.steps_running():
            open(run_dir + "/ready", "w").close()
            while not signals.stop_requested():  # a step that is running when SIGTERM comes
                time.sleep(0.01)
            save_checkpoint(run_dir, 6, FileLearner(chunks=20, marker=run_dir + "/mid-write"), TrainerState(6), 0)
        return 0

    sys.exit(exits.guarded(command))
''')


def _preempted(tmp_path, when: str):
    (tmp_path / "preempted.py").write_text(PREEMPTED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "preempted.py"), str(tmp_path), when], env=env,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGTERM)
    return proc


def _wait_for(path: Path, proc) -> None:
    deadline = time.monotonic() + 60
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.exists(), f"{path.name} never appeared"


def test_a_second_sigterm_mid_checkpoint_exits_143_and_leaves_the_last_complete_one(tmp_path, learner_module):
    proc = _preempted(tmp_path, "steps")
    _wait_for(tmp_path / "mid-write", proc)  # the first SIGTERM's checkpoint is being written
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert "stopping after this step, with a checkpoint of it" in err
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 4)
    assert skipped_line(tmp_path).startswith("checkpoint .tmp-step-000006 is incomplete")


def test_sigterm_before_the_steps_stops_at_once_with_143(tmp_path, learner_module):
    proc = _preempted(tmp_path, "before")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert err.strip().splitlines()[-1] == ("grpo: stopped by SIGTERM before the GRPO steps began; everything the "
                                            "run started has been stopped (nothing to save yet: run it again)")


def test_trainer_state_keeps_the_files_keys_and_their_order(tmp_path, learner_module):
    from cluster.loop.checkpoint import load_trainer_state

    state = TrainerState(step=3, policy_version=4, sampler={"order": [2, 0, 1], "position": 1},
                         accuracy_before=0.25, seed=7, rng={"python": [3, [1, 2], None]})
    text = state.to_json()
    assert text == json.dumps({"step": 3, "policy_version": 4, "sampler": {"order": [2, 0, 1], "position": 1},
                               "accuracy_before": 0.25, "seed": 7, "rng": {"python": [3, [1, 2], None]}})
    (tmp_path / STATE_FILE).write_text(text)
    assert load_trainer_state(tmp_path) == state
    saved = _save(tmp_path / "run", 5, learner_module.FileLearner(chunks=1))
    written = json.loads((saved / STATE_FILE).read_text())
    assert list(written) == ["step", "policy_version", "sampler", "accuracy_before", "seed", "rng"]
    assert set(written["rng"]) == {"python", "numpy", "torch"}
