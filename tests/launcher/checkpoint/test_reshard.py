"""Every layout's checkpoint resumes under every other layout with the uninterrupted run's losses
(tests/launcher/checkpoint/reshard_worker.py): one process saves after 2 AdamW steps; the 4-rank layouts load
it, save their own sharded copy, and load each other's (the matrix); one process loads each back.
The next 3 losses must be the uninterrupted run's within 1e-5 relative. Three launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("reshard_worker.py")
ROOT = Path(__file__).resolve().parents[3]
# The matrix: each resumes every other's checkpoint (and one process's, and one process theirs).
MATRIX = ["tp2_ep2", "pp2_dp2_1f1b", "pp2_vpp2_dp2", "dp4_fsdp", "dp4_ddp"]
# To and from one process only.
MORE = ["hsdp2x2_ep2", "zero1_dp4_ep2", "cp2_dp2", "tp2_etp2_ep2"]


def launch(world: int, out: Path, *args: str) -> list[dict]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            str(WORKER), str(out), *args]
    proc = subprocess.run(argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 and not results:
        pytest.fail(f"{args[0]} launch on {world} ranks failed:\n{proc.stderr[-3000:]}")
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_every_layout_resumes_every_other_layouts_checkpoint(tmp_path):
    launch(1, tmp_path, "reference")
    results = launch(4, tmp_path, "layouts", *MATRIX, "+", *MORE)
    results += launch(1, tmp_path, "plain", *MATRIX, *MORE)
    pairs = {(r["from"], r["to"]) for r in results if not r.get("control")}
    layouts = ["plain", *MATRIX]
    want = {(a, b) for a in layouts for b in layouts if a != b}
    want |= {(a, b) for m in MORE for a, b in (("plain", m), (m, "plain"))}
    assert pairs == want, sorted(want - pairs)
    assert any(r.get("control") for r in results), "the control (optimizer state not loaded) did not run"
    bad = [r for r in results if not r["ok"]]
    assert not bad, json.dumps(bad, indent=1)
