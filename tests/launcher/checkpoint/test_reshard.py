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
ROOT = Path(__file__).resolve().parents[3]
# The matrix: each resumes every other's checkpoint (and one process's, and one process theirs).
MATRIX = ["tp2_ep2", "pp2_dp2_1f1b", "pp2_vpp2_dp2", "dp4_fsdp", "dp4_ddp"]
# To and from one process only.
MORE = ["hsdp2x2_ep2", "zero1_dp4_ep2", "cp2_dp2", "tp2_etp2_ep2"]


def launch(forked_ranks, out: Path, *launches: tuple[int, list[str]]) -> list[dict]:
    """Run the worker's launches one after another, each on its number of ranks forked from one
    process (torchrun would start an interpreter per rank and launch: ~25 s of CPU importing, of
    this test's ~120); → the JSON lines rank 0 printed."""
    results = []
    for world, args in launches:
        answer = forked_ranks({"ranks": world, "script": str(WORKER), "args": [str(out), *args], "cwd": str(ROOT),
                               "tail": 1 << 20, "timeout": 900})
        got = [json.loads(line) for line in answer["output"]["0"].splitlines() if line.startswith("{")]
        if answer["codes"] != [0] * world and not got:
            pytest.fail(f"{args[0]} launch on {world} ranks failed:\n{json.dumps(answer['output'], indent=1)}")
        results += got
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_every_layout_resumes_every_other_layouts_checkpoint(forked_ranks, tmp_path):
    results = launch(forked_ranks, tmp_path, (1, ["reference"]), (4, ["layouts", *MATRIX, "+", *MORE]),
                     (1, ["plain", *MATRIX, *MORE]))
    pairs = {(r["from"], r["to"]) for r in results if not r.get("control")}
    layouts = ["plain", *MATRIX]
    want = {(a, b) for a in layouts for b in layouts if a != b}
    want |= {(a, b) for m in MORE for a, b in (("plain", m), (m, "plain"))}
    assert pairs == want, sorted(want - pairs)
    assert any(r.get("control") for r in results), "the control (optimizer state not loaded) did not run"
    bad = [r for r in results if not r["ok"]]
    assert not bad, json.dumps(bad, indent=1)
