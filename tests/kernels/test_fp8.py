"""Where train.precision fp8 cannot run (kernels/fp8.py), `moetron train` says so in one line and
writes nothing: here, on a CPU, always."""

import json
from pathlib import Path

import pytest
import torch

from moetron.kernels.fp8 import fp8_problem
from moetron.launcher.cli.main import main

TINY = "configs/tiny.yaml"


def test_on_a_cpu_fp8_is_refused_before_anything_is_written(tmp_path, capsys):
    runs = tmp_path / "runs"
    code = main(["train", TINY, "train.precision=fp8", "train.steps=2", f"train.run_dir={runs}", "train.device=cpu"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == ("moetron train: train.precision = 'fp8': FP8 GEMMs need a CUDA GPU of compute capability 8.9 or "
                   "newer (Ada, Hopper); this run is on cpu; use bf16 here\n")
    assert not runs.exists()


def test_the_reason_names_the_device():
    assert "this run is on cpu" in fp8_problem(torch.device("cpu"))
    assert fp8_problem(torch.device("meta")).endswith("this run is on meta")


def fp8_loss_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp8_loss", Path(__file__).parents[2] / "bench" / "fp8_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.moe.d_expert=32", "model.moe.num_experts=4", "train.seq_len=16", "train.batch_size=4",
         "train.log_every=1", "train.threads=1", "train.device=cpu"]


def test_the_loss_bench_compares_two_real_runs_step_by_step(tmp_path, capsys):
    """bench/fp8_loss.py's plumbing with two precisions a CPU has: its numbers are those the two
    runs logged, read here from their metrics.jsonl."""
    bench = fp8_loss_bench()
    bench.main([TINY, *SMALL, "--steps", "3", "--precisions", "fp32", "bf16", "--out", str(tmp_path),
                "--json", str(tmp_path / "r.json")])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "r.json").read_text())
    logged = {p: {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / p / "metrics.jsonl").read_text().splitlines())}
              for p in ("fp32", "bf16")}
    assert sorted(logged["fp32"]) == sorted(logged["bf16"]) == [1, 2, 3]
    assert (result["step"], result["loss_fp32"], result["loss_bf16"]) == (3, logged["fp32"][3], logged["bf16"][3])
    diffs = [abs(logged["bf16"][s] - logged["fp32"][s]) / logged["fp32"][s] for s in (1, 2, 3)]
    assert result["rel_diff_last"] == pytest.approx(diffs[-1]) and result["rel_diff_max"] == pytest.approx(max(diffs))
    assert result["met"] == (diffs[-1] <= 0.01)


def test_the_loss_bench_refuses_fp8_on_a_cpu_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^fp8_loss.py: train.precision = 'fp8': FP8 GEMMs need a CUDA GPU"):
        fp8_loss_bench().main([TINY, *SMALL, "--steps", "2", "--out", str(tmp_path)])


@pytest.mark.parametrize("counts", [[16, 32, 0, 16], [5, 0, 17, 3], [0, 0, 0, 0], [1, 15, 16, 33]])
def test_groups_of_any_size_go_through_a_multiply_that_takes_multiples_of_16(counts):
    """Expert parallelism's received groups are exact; the FP8 grouped GEMM takes multiples of 16
    rows per group. Through the padding, a multiply that checks its groups gives what the per-group
    reference gives, forward and backward, with the rows past the last group zero."""
    from moetron.kernels.fp8 import grouped_in_aligned_groups
    from moetron.kernels.grouped_mm import grouped_mm_reference

    seen = []

    def strict_mm(x_PK, offsets_P):
        sizes = torch.diff(offsets_P, prepend=offsets_P.new_zeros(1))
        assert offsets_P.dtype == torch.int32 and (sizes % 16 == 0).all() and x_PK.shape[0] == int(offsets_P[-1])
        seen.append(sizes.tolist())
        return grouped_mm_reference(x_PK, w_EKN, offsets_P)

    torch.manual_seed(0)
    rows = sum(counts) + 3  # and 3 rows past the last group
    x_TK = torch.randn(rows, 8, dtype=torch.float64, requires_grad=True)
    w_EKN = torch.randn(len(counts), 8, 4, dtype=torch.float64, requires_grad=True)
    offsets_E = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = grouped_in_aligned_groups(strict_mm, x_TK, offsets_E, 16)
    want = grouped_mm_reference(x_TK, w_EKN, offsets_E)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert seen == [[-(-c // 16) * 16 for c in counts]]
    dy = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (x_TK, w_EKN), dy)
    want_grads = torch.autograd.grad(want, (x_TK, w_EKN), dy)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
