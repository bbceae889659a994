"""The tree passes `ruff check` under the rules pyproject.toml's [tool.ruff.lint] names (pyflakes,
pycodestyle's errors, import order): an unused import or variable, an undefined name or an unsorted
import block fails here, not in a reader's editor."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
