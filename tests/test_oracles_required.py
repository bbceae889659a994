"""Under CI an oracle test may not skip: tests/conftest.py turns pytest.importorskip's skip for a
package of the [oracles] extra into a failure naming it when CI=true, and leaves it a skip on a
developer's machine. Checked on a tiny suite run by a real pytest in a subprocess, with the oracle
packages made unimportable there (None in sys.modules is what Python does for a missing module)."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

IN_A_TEST = """
import sys
import pytest
sys.modules["deepspeed"] = None  # as if the [oracles] extra were not installed

def test_needs_deepspeed():
    pytest.importorskip("deepspeed.moe.sharded_moe")

def test_skips_for_another_reason():
    pytest.skip("needs a GPU")

def test_not_an_oracle():
    pytest.importorskip("surely_not_an_installed_module")

def test_runs():
    pass
"""

AT_MODULE_LEVEL = """
import sys
import pytest
sys.modules["megatron"] = None
moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

def test_needs_megatron():
    pass
"""


def run_tiny_suite(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_a.py").write_text(IN_A_TEST)
    (tmp_path / "test_b.py").write_text(AT_MODULE_LEVEL)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    # The project's conftest as a plugin: the tiny suite lives outside tests/. A failed collection
    # stops a real run at once (status 2); here the run goes on, to see both kinds of skip in one.
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "conftest", "-p", "no:cacheprovider",
                           "--continue-on-collection-errors", "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_missing_oracle_fails_under_ci_naming_the_package(tmp_path):
    run = run_tiny_suite(tmp_path, "true")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 1 passed, 2 skipped, 1 error" in out, out
    assert "FAILED test_a.py::test_needs_deepspeed - oracle package 'deepspeed' is missing under CI=true" in out, out
    # A file that skips itself at import: its collection fails.
    assert "ERROR test_b.py - oracle package 'megatron' is missing under CI=true" in out, out
    # Skips for anything else stay skips.
    assert "SKIPPED [1] test_a.py:10: needs a GPU" in out, out
    assert "could not import 'surely_not_an_installed_module'" in out, out


def test_without_ci_a_missing_oracle_only_skips(tmp_path):
    run = run_tiny_suite(tmp_path, None)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "1 passed, 4 skipped" in out, out
    assert "could not import 'deepspeed.moe.sharded_moe'" in out, out
