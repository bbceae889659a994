"""Compile the shipped kernel configurations for a GPU target on a machine without a GPU.

Each Triton module lists its configurations as `KernelSpec`s (kernels/kernel_spec.py) with
arguments shaped like a real call; here they are specialized exactly as Triton's launcher would
(ints equal to 1 become constants, pointers and multiples of 16 are marked 16-divisible) and
compiled with the bundled ptxas. A configuration that needs more shared memory than the target has
would fail to launch on the GPU; `python -m moetron.kernels.aot` prints one JSON line per
configuration with what it needs.

It must run in a process where TRITON_INTERPRET is unset: under the interpreter `triton.jit`
returns functions that cannot be compiled.
"""

from __future__ import annotations

import json
import sys

import torch

from moetron.kernels.kernel_spec import KernelSpec

# Shared memory one thread block may use on Hopper (H100/H200): 227 KiB.
SM90_MAX_SHARED_BYTES = 232448


def compile_spec(spec: KernelSpec, arch: int = 90):
    """Compile `spec` for CUDA compute capability `arch`; returns Triton's CompiledKernel."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(spec.kernel.arg_names):
        if name in spec.constexprs:
            signature[name] = "constexpr"
            constexprs[name] = spec.constexprs[name]
            continue
        value = spec.args[name]
        if isinstance(value, torch.dtype):
            value = torch.empty(16, dtype=value)  # torch allocations are 16-byte aligned
        kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = attr
        elif attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(spec.kernel, signature, constexprs, attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def shipped_specs():
    """Every configuration the kernels can launch with on a GPU."""
    from moetron.kernels import flash_attention_triton, grouped_mm_triton

    yield from grouped_mm_triton.compile_specs()
    yield from flash_attention_triton.compile_specs()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    arch = int(argv[0]) if argv else 90
    for spec in shipped_specs():
        try:
            shared = compile_spec(spec, arch).metadata.shared
            print(json.dumps({"name": spec.name, "shared": shared}), flush=True)
        except Exception as err:  # noqa: BLE001 - report every configuration, then fail
            print(json.dumps({"name": spec.name, "error": f"{type(err).__name__}: {err}"[:2000]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
