"""The floors of the code base hold: the import contract in .importlinter (cluster/ above the
roles and data/, those above common/, rollout, learner, reward and data independent, no roles
importing data, no cycles; inside the driver the command line above the run)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contract_is_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in proc.stdout


def _lint_a_copy_with(tmp_path, module: str, line: str):
    """lint-imports on a copy of the tree where `module` has one more import line."""
    import shutil

    for package in ("common", "rollout", "learner", "reward", "data", "cluster"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / module).open("a") as f:
        f.write(f"\n{line}  # noqa\n")
    lint = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})


def test_a_role_importing_another_role_breaks_the_contract(tmp_path):
    """The contract is not vacuous: a copy of the tree where rollout imports learner fails it."""
    proc = _lint_a_copy_with(tmp_path, "rollout/pool.py", "from learner.group import LearnerGroup")
    assert proc.returncode != 0
    assert "rollout.pool -> learner.group" in proc.stdout


def test_a_role_importing_data_breaks_the_contract(tmp_path):
    """Only the driver prepares data: a copy where rollout imports data/ fails the contract."""
    proc = _lint_a_copy_with(tmp_path, "rollout/pool.py", "from data.datasets import PromptSampler")
    assert proc.returncode != 0
    assert "rollout.pool -> data.datasets" in proc.stdout


def test_the_run_importing_the_command_line_breaks_the_contract(tmp_path):
    """The command line answers bad input before the run's modules load: a copy where the run
    imports the command line fails the contract."""
    proc = _lint_a_copy_with(tmp_path, "cluster/loop/batches.py", "from cluster.cli.checks import resolve_model")
    assert proc.returncode != 0
    assert "cluster.loop.batches -> cluster.cli.checks" in proc.stdout
