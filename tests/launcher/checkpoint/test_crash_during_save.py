"""SIGKILL during checkpoint saves, then resume: nothing lost but the save being written, and the
losses of an uninterrupted run (tests/launcher/checkpoint/crash_harness.py does the killing; it forks every
run from one process, so 30+ trials cost minutes, not an import each).

Covered: synchronous and asynchronous saves, on 1 rank and on 4 (dp 4 × ep 2, gloo); kills at
random moments (almost all land in the shard writes, the longest phase) and, in every mode, one
kill inside each phase of a save: shard writes, merged manifest, COMPLETE before the rename, and
renamed before the `latest` pointer moved.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("crash_harness.py")


@pytest.mark.slow
@pytest.mark.distributed
def test_kills_at_any_point_of_a_save_lose_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(HARNESS), str(tmp_path), "--trials-per-mode", "6"],
                          capture_output=True, text=True, timeout=1500)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines and "summary" in lines[-1], proc.stderr[-3000:]
    trials, summary = lines[:-1], lines[-1]["summary"]
    assert proc.returncode == 0, json.dumps([t for t in trials if t["checkpoints_lost"] or not t["losses_equal"]])
    assert summary["trials"] == len(trials) >= 30
    assert summary["lost"] == 0 and summary["mismatched"] == 0
    assert all(t["resume_exit"] == [0] * len(t["resume_exit"]) for t in trials)
    for mode in ("sync-1", "async-1", "sync-4", "async-4"):
        planned = [t for t in trials if t["mode"] == mode and t["planned"]]
        # Every phase of a save was hit where it was aimed at, in every mode.
        assert sorted(t["kill_point"] for t in planned) == sorted(t["planned"][1] for t in planned)
        assert {t["kill_point"] for t in planned} == {"shards", "manifest", "rename", "latest"}
