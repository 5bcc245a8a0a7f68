"""The lint floor holds: `ruff check` is clean under ruff.toml, and no product function is longer
than 50 lines (ruff has no rule for length, so the AST is read here)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "rollout", "learner", "reward", "cluster")
MAX_LINES = 50


def test_ruff_is_clean():
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def function_lengths(source: str):
    """(name, first line, length) of every function, its docstring not counted."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = node.lineno
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc_lines = body[0].end_lineno - body[0].lineno + 1
            else:
                doc_lines = 0
            yield node.name, start, node.end_lineno - start + 1 - doc_lines


def test_function_lengths_counts_code_not_docstrings():
    source = 'def f():\n    """One.\n\n    Three."""\n    x = 1\n    return x\n'
    assert list(function_lengths(source)) == [("f", 1, 3)]


@pytest.mark.parametrize("package", PRODUCT)
def test_no_product_function_is_longer_than_50_lines(package):
    long = [f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)"
            for path in sorted((ROOT / package).rglob("*.py"))
            for name, line, n in function_lengths(path.read_text()) if n > MAX_LINES]
    assert not long, "functions over 50 lines: " + "; ".join(long)
