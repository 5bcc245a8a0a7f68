"""The floors of the code base hold: the import contract in .importlinter (cluster/ above the
roles, the roles above common/, rollout, learner and reward independent, no cycles)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contract_is_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in proc.stdout


def test_a_role_importing_another_role_breaks_the_contract(tmp_path):
    """The contract is not vacuous: a copy of the tree where rollout imports learner fails it."""
    import shutil

    for package in ("common", "rollout", "learner", "reward", "cluster"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / "rollout" / "pool.py").open("a") as f:
        f.write("\nfrom learner.group import LearnerGroup  # noqa\n")
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "rollout.pool -> learner.group" in proc.stdout
