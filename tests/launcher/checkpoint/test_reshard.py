"""Every layout's checkpoint resumes under every other layout with the uninterrupted run's losses
(tests/launcher/checkpoint/reshard_worker.py): one process saves after 2 AdamW steps; the 4-rank layouts load
it, save their own sharded copy, and load each other's (the matrix); one process loads each back.
The next 3 losses must be the uninterrupted run's within 1e-5 relative. Three launches, their ranks
forked from one process (tests/forked_ranks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("reshard_worker.py")
# The matrix: each resumes every other's checkpoint (and one process's, and one process theirs).
MATRIX = ["tp2_ep2", "pp2_dp2_1f1b", "pp2_vpp2_dp2", "dp4_fsdp", "dp4_ddp"]
# To and from one process only.
MORE = ["hsdp2x2_ep2", "zero1_dp4_ep2", "cp2_dp2", "tp2_etp2_ep2"]


@pytest.mark.distributed
@pytest.mark.slow
def test_every_layout_resumes_every_other_layouts_checkpoint(forked_script, tmp_path):
    results = []
    for ranks, args in ((1, ["reference"]), (4, ["layouts", *MATRIX, "+", *MORE]), (1, ["plain", *MATRIX, *MORE])):
        results += forked_script(WORKER, ranks, [str(tmp_path), *args], 900)
    pairs = {(r["from"], r["to"]) for r in results if not r.get("control")}
    layouts = ["plain", *MATRIX]
    want = {(a, b) for a in layouts for b in layouts if a != b}
    want |= {(a, b) for m in MORE for a, b in (("plain", m), (m, "plain"))}
    assert pairs == want, sorted(want - pairs)
    assert any(r.get("control") for r in results), "the control (optimizer state not loaded) did not run"
    bad = [r for r in results if not r["ok"]]
    assert not bad, json.dumps(bad, indent=1)
