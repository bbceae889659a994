"""Every kernel configuration that ships compiles for Hopper (sm_90) and fits its shared memory.

No GPU needed: Triton's bundled ptxas compiles for a named target. This catches what the
interpreter accepts but the compiler rejects, and tiles too large to launch (a launch on the GPU
would fail with "out of resource: shared memory"). Compilation runs in a child process without
TRITON_INTERPRET, under which kernels cannot be compiled. The first run takes ~40 s on 2 cores;
Triton caches the results (~/.triton/cache), so later runs take a few seconds.
"""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from moetron.kernels.aot import SM90_MAX_SHARED_BYTES


def _ptxas_available() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    bundled = pathlib.Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.exists() or shutil.which("ptxas") is not None or bool(os.environ.get("TRITON_PTXAS_PATH"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(not _ptxas_available(), reason="no ptxas (neither bundled with triton nor on PATH)")
@pytest.mark.timeout(600)
def test_shipped_configs_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "moetron.kernels.aot", "90"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    names = {r["name"] for r in results}
    assert any(n.startswith("grouped_mm[") for n in names) and any(n.startswith("grouped_mm_wgrad[") for n in names)
    for kind in ("fwd", "dkdv", "dq", "delta"):
        assert any(n.startswith(f"attention_{kind}[") for n in names), f"no attention_{kind} configuration compiled"
    failed = [f"{r['name']}: {r['error']}" for r in results if "error" in r]
    assert not failed, "configurations that do not compile for sm_90:\n" + "\n".join(failed)
    too_big = [f"{r['name']}: {r['shared']} B" for r in results if r["shared"] > SM90_MAX_SHARED_BYTES]
    assert not too_big, f"configurations over {SM90_MAX_SHARED_BYTES} B of shared memory:\n" + "\n".join(too_big)
