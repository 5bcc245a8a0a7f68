"""The documentation site builds strictly (a broken link, anchor or a page left out of the nav
fails), and the configuration reference is what the schema generates today."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common import config_reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_config_reference_is_fresh():
    committed = config_reference.PAGE.read_text() if config_reference.PAGE.is_file() else ""
    assert committed == config_reference.render(), (
        f"docs/reference/config.md is stale: regenerate it with `{config_reference.REGENERATE}` and commit it")


def test_the_reference_lists_every_key_with_its_docstring():
    page = config_reference.render()
    for key, _, _, _, doc in config_reference.rows():
        assert f"| `{key}`<br>" in page, key
        assert doc, f"{key} has no docstring in common/config.py"
    for option in ("data=mul", "model=hf", "model=tiny", "logger=none"):
        assert f"| `{option}` |" in page
    assert "**Device-dependent:**" in page and "`rollout.dtype`" in page and "`learner.num_threads`" in page


def test_mkdocs_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    proc = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_the_readme_stays_short_and_undated():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "2026" not in readme and "bench/results/" not in readme
