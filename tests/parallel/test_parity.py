"""Every parallel layout trains like one process: one launch per world size runs many layouts
inside (tests/parallel/parity_worker.py holds the checks and their tolerances), its ranks forked
from one process that imported torch and moetron once (tests/forked_ranks.py), as torchrun would start
them but without an interpreter and its imports per rank.

Tolerances: loss and aux loss within 1e-5 relative on each of three SGD steps; every
parameter's step-1 gradient within 1e-5 of its largest reference entry; expert token counts
equal; under aux-loss-free routing the expert biases after the last step equal one process's. Cost on 2 CPU cores: ~12 s (2 ranks), ~25 s (4 ranks), ~25 s (8 ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("parity_worker.py")

LAUNCHES = {
    2: ["tp2", "tp2_sp", "tp2_sp_learned", "dp2_fsdp", "dp2_ddp", "ep2_fsdp", "ep2_ddp_capacity",
        "pp2_gpipe", "pp2_1f1b", "pp2_interleaved", "pp2_zero_bubble",
        "tp2_sp_bias", "dp2_ddp_bias", "ep2_fsdp_bias", "pp2_gpipe_bias", "pp2_1f1b_bias", "pp2_interleaved_bias",
        "pp2_zero_bubble_bias", "tp2_etp2", "tp2_sp_etp2", "tp2_sp_etp2_bias",
        "cp2", "cp2_alibi", "cp2_bias_sequence", "tp2_t5", "tp2_sp_t5", "cp2_t5",
        "tp2_sp_ac_selective", "cp2_ac_selective", "ep2_fsdp_ac_full", "ep2_fsdp_ac_selective", "ep2_ddp_ac_selective",
        "pp2_1f1b_ac_selective", "pp2_1f1b_bias_ac_full",
        "dp2_ddp_global", "ep2_fsdp_global_bias", "pp2_1f1b_global", "ep2_fsdp_global_ac_selective",
        "tp2_sp_packed", "cp2_packed", "pp2_1f1b_packed",
        "tp2_mla", "tp2_sp_mla", "cp2_mla", "pp2_1f1b_mla", "tp2_mla_mtp",
        "tp2_gptoss", "tp2_sp_gptoss", "cp2_gptoss",
        "tp2_mtp", "tp2_sp_mtp", "pp2_1f1b_mtp", "pp2_zero_bubble_mtp", "pp2_1f1b_packed_mtp",
        "dp2_ddp_mlm", "tp2_sp_mlm", "cp2_mlm", "pp2_1f1b_mlm"],
    4: ["dp4_ep2", "dp4_ep2_ddp", "tp2_ep2", "tp2_sp_ep2", "pp2_ep2", "pp2_tp2", "pp2_tp2_sp", "pp2_tp2_sp_sinusoidal", "pp2_dp2_interleaved",
        "tp2_sp_ep2_bias", "pp2_dp2_bias", "hsdp2x2", "hsdp2x2_ep2", "zero1_dp4", "zero1_dp4_ep2",
        "tp2_etp2_ep2", "tp2_etp2_ddp", "pp2_tp2_etp2",
        "cp2_tp2_sp", "cp2_ep2", "pp2_cp2", "cp2_dp2_hsdp", "tp2_sp_ep2_ac_selective", "pp2_dp2_ac_full",
        "zero1_dp2_tp2_etp2", "hsdp_dp2_tp2_etp2_ep2",
        "tp2_sp_ep2_global", "cp2_dp2_global", "pp2_dp2_interleaved_global", "pp2_dp2_global_ac_full",
        "pp2_cp2_packed", "tp2_ep2_mla", "cp2_tp2_sp_mla", "tp2_ep2_qwen2",
        "tp2_ep2_gptoss", "tp2_etp2_ep2_gptoss", "tp2_ep2_mtp", "pp2_tp2_sp_mtp", "pp2_dp2_interleaved_mtp",
        "pp4_gpipe_mtp", "cp2_ep2_mlm"],
    8: ["pp2_dp2_tp2_ep2", "pp2_dp2_tp2_ep2_etp2"],
}
# train.compile=true under TP, EP + FSDP with the bias, PP 1F1B and DDP with the global-batch
# loss, on 2 ranks (each rank compiles its blocks on CPU). Slow on a cold compile cache (~300 s of
# CPU for the first launch), ~70 s of CPU for it on a warm one.
COMPILED = ["tp2_compiled", "ep2_fsdp_compiled", "pp2_1f1b_compiled", "dp2_ddp_compiled"]
WARM = ["tp2_compiled", "dp2_ddp_compiled"]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_layouts_match_one_process(forked_script, world):
    results = {r["case"]: r for r in forked_script(WORKER, world, LAUNCHES[world], 600)}
    assert set(results) == set(LAUNCHES[world]), f"missing: {set(LAUNCHES[world]) - set(results)}"
    bad = [r for r in results.values() if not r["ok"]]
    assert not bad, json.dumps(bad, indent=1)


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_blocks_train_like_one_eager_process(forked_script):
    """Compiled blocks on a cold and on a warm compile cache: a compiled loss under loss_parallel
    once came out right on a cold cache and wrong on a warm one. The first launch checks all four
    cases; a second launch (WARM: tp2_compiled, the case that went wrong, and dp2_ddp_compiled,
    whose loss is compiled, tp = 1) reads what the first left in torch's compile caches.

    tp2's graphs take its DeviceMesh as an input, and torch 2.13 keys them by the mesh's pickled
    state, which holds a Python hash that differs between processes (parity_worker.keyed_per_process):
    no other process finds them, a warm tp2 compiles everything again, which is the cold tp2 the
    first launch checked. It runs warm only where the first launch reports its mesh keyed by value.
    Where the first launch compiled nothing the warm cases need (every graph of them read from the
    caches, none missed, as on every run after the first on a machine), it was that warm launch
    already, and a second one is not run."""
    first = checked_launch(forked_script, 1, COMPILED)
    warm_cases = [c for c in WARM if not first[c]["keyed_per_process"]]
    assert "dp2_ddp_compiled" in warm_cases, "dp2_ddp_compiled (tp = 1) has no mesh in its graphs' keys"
    warm = all(first[c]["cache_hits"] > 0 and not first[c]["cache_misses"] for c in warm_cases)
    if not warm:
        second = checked_launch(forked_script, 2, warm_cases)
        assert all(second[c]["cache_hits"] > 0 for c in warm_cases), f"launch 2 read nothing from the caches: {second}"


def checked_launch(forked_script, launch_no: int, cases: list[str]) -> dict[str, dict]:
    """Run `cases` on 2 ranks and assert that each passed; → the results by case."""
    results = {r["case"]: r for r in forked_script(WORKER, 2, cases, 600)}
    assert set(results) == set(cases), f"launch {launch_no}, missing: {set(cases) - set(results)}"
    bad = [r for r in results.values() if not r["ok"]]
    assert not bad, f"launch {launch_no}: " + json.dumps(bad, indent=1)
    return results
