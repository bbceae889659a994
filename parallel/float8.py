"""FP8 training (train.precision fp8): torchao's `Float8Linear` for the dense linears and its
rowwise-scaled grouped GEMM for the routed experts (kernels/fp8.py), applied to the model before
activation checkpointing, compile and data parallelism, as torchtitan's float8 converter is.

Which matmuls go to FP8: every nn.Linear whose in and out features are multiples of 16 (what the
scaled GEMM takes), except the router's gate, whose scores choose the experts, and the output head,
whose logits feed the loss (both stay in bf16, as in Megatron-Core's and torchtitan's FP8 recipes);
and the experts whose D and F are multiples of 16. Parameter names do not change, so checkpoints
move freely between fp8, bf16 and fp32 runs. Scaling is rowwise (torchao's "rowwise" recipe: a
scale per row of each operand, powers of two). Not under tensor parallelism (config.py refuses it):
Float8Linear needs torchao's own float8 TP styles there.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from moetron.kernels.fp8 import FP8_GROUP_ROWS
from moetron.model.experts import GroupedExperts

# Linears kept in bf16, by the last part of their name.
KEPT = ("gate", "head")


def apply_float8(model: nn.Module, *, emulate: bool = False) -> list[str]:
    """Swap `model`'s eligible linears (on any device, meta included) for Float8Linear and turn on
    its experts' FP8 grouped GEMMs; → the names of the linears swapped. `emulate`: torchao's
    emulation of the FP8 casts with high-precision matmuls (dense linears only: CPU tests)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("rowwise")
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    swapped: list[str] = []

    def eligible(module: nn.Module, name: str) -> bool:
        ok = (isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in KEPT
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        swapped.extend([name] if ok else [])
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    for experts in (m for m in model.modules() if isinstance(m, GroupedExperts)):
        d_model, d_ff = experts.w_gate_EDF.shape[1:]
        if not emulate and d_model % 16 == 0 and d_ff % 16 == 0:
            experts.fp8 = True
            experts.row_multiple = FP8_GROUP_ROWS
    return swapped
