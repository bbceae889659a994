"""Where train.precision fp8 cannot run (kernels/fp8.py), `moetron train` says so in one line and
writes nothing: here, on a CPU, always."""

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
