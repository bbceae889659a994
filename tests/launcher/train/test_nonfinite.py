"""The non-finite guard on a real 2-rank run (dp 2 × ep 2, gloo): NaN injected on one rank only.

- A poisoned gradient on rank 1 at steps 3 and 6: both ranks skip those steps (the norm is
  global), the loss of step 3 is the clean run's (the forward was clean), and the step-6
  checkpoint equals step 5's, weights and optimizer state alike: a skipped step changes nothing.
- A poisoned batch on rank 0 from step 2 on: steps 2, 3 and 4 are skipped, and with
  max_skipped_steps 3 both ranks stop with the same line naming step 4 and the step-1 checkpoint,
  which is the newest one; metrics.jsonl is strict JSON throughout.
"""

import json
from pathlib import Path

import pytest

from moetron.launcher.checkpoint.store import consolidated_model_state

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("nonfinite_worker.py")


def strict_records(run: Path) -> dict[int, dict]:
    bare = lambda c: pytest.fail(f"bare {c} in {run / 'metrics.jsonl'}")  # noqa: E731
    return {r["step"]: r for r in (json.loads(line, parse_constant=bare)
                                   for line in (run / "metrics.jsonl").read_text().splitlines())}


def outcomes(root: Path, name: str) -> list[dict]:
    return [json.loads((root / f"{name}.rank{r}.outcome.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, forked_ranks):
    """The worker's three runs, on 2 ranks forked as torchrun would start them (tests/forked_ranks.py)."""
    root = tmp_path_factory.mktemp("nonfinite")
    answer = forked_ranks({"ranks": 2, "script": str(WORKER), "args": [str(root)], "timeout": 600})
    assert answer["codes"] == [0, 0], json.dumps(answer["output"], indent=1)[-3000:]
    return root


def test_a_poisoned_gradient_on_one_rank_is_skipped_everywhere_and_changes_nothing(runs):
    assert all(o["finished"] for o in outcomes(runs, "grad"))
    clean, grad = strict_records(runs / "clean"), strict_records(runs / "grad")
    assert [grad[s]["loss"] for s in (1, 2, 3)] == [clean[s]["loss"] for s in (1, 2, 3)]
    assert grad[3]["grad_norm"] is None and grad[3]["skipped_steps"] == 1
    assert grad[4]["loss"] != clean[4]["loss"]  # step 3's update never happened
    assert grad[6]["grad_norm"] is None and grad[6]["skipped_steps"] == 2
    assert clean[6]["skipped_steps"] == 0
    ckpts = runs / "grad" / "checkpoints"
    assert not (ckpts / "step-00000003").exists()  # no periodic checkpoint of a skipped step
    for part in ("model", "optim"):
        five = consolidated_model_state(ckpts / "step-00000005", part)
        six = consolidated_model_state(ckpts / "step-00000006", part)
        assert five.keys() == six.keys() and len(five) > 10
        assert all(five[k].equal(six[k]) for k in five), part


def test_a_poisoned_batch_on_one_rank_stops_every_rank_at_the_limit(runs):
    out = outcomes(runs, "batch")
    assert not any(o["finished"] for o in out)
    for error in (o["error"] for o in out):  # the same verdict; the details are what each rank saw
        assert error.startswith("step 4: 3 steps in a row were non-finite (loss nan; grad norm nan")
        assert error.endswith("the last good checkpoint is "
                              f"{runs / 'batch' / 'checkpoints' / 'step-00000001'} (lower train.lr, or raise "
                              "train.max_skipped_steps)")
    assert "router of layer 0, 1" in out[0]["error"]  # rank 0 sees its routers go NaN
    recs = strict_records(runs / "batch")
    assert recs[1]["loss"] is not None and [recs[s]["loss"] for s in (2, 3, 4)] == [None] * 3
    assert max(recs) == 4
    ckpts = sorted(p.name for p in (runs / "batch" / "checkpoints").glob("step-*"))
    assert ckpts == ["step-00000001"]
    state = consolidated_model_state(runs / "batch" / "checkpoints" / "step-00000001")
    assert all(t.isfinite().all() for t in state.values())
