"""The linter: ruff (pinned in pyproject.toml's test dependencies) with the rules of its [tool.ruff] over the project's
Python. It fails with ruff's own lines, file:line:column, rule and message; `ruff check --fix` mends the import order
and unused imports, the rest is by hand."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["scaletrain", "tests", "benchmarks", "launch", "train.py"]


def test_ruff_finds_nothing():
    # --no-cache: nothing written into the tree, nothing shared between the suite's two workers.
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *PATHS],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in done.stderr, "ruff is not installed: `make venv` installs the test extras"
    if done.returncode:
        pytest.fail(f"ruff check {' '.join(PATHS)}:\n{done.stdout}{done.stderr}", pytrace=False)
