"""`moetron convert` against transformers on the same Hugging Face folder: seconds and peak memory.

Writes a random Mixtral-family folder of --gb gigabytes (bf16, in --shards safetensors shards) into
a temporary folder, itself streamed tensor by tensor (model/hf.py `write_hf`), then times, each in
a fresh process as a user would run it (interpreter start and imports included):
  moetron convert --from-hf HF --out CKPT                 Hugging Face folder → moetron checkpoint
  moetron convert --to-hf CKPT --out HF2                  and back, in shards of the source's size
  transformers from_pretrained(HF) + save_pretrained(HF3) the same files through transformers
                                                          (load and save also timed on their own)
Peak RSS is each process's high-water resident set (VmHWM); CPU seconds (user + system) are each
child's, steadier than wall seconds on a shared machine. The round trip is checked byte for byte
against the source.
Prints a table and one JSON line.

    python bench/convert_speed.py                 # 2 GB in 4 shards
    python bench/convert_speed.py --gb 8 --shards 8 --dir /scratch/convert-bench
    python bench/convert_speed.py --gb 1 --shards 16 --experts 128 --d-ff 512   # a stack of experts
                                                  # (134 MB) larger than a shard (64 MB)
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from moetron.launcher.perf.flops import params_total
from moetron.model.config import ModelConfig, MoEConfig
from moetron.model.hf import Weights, plan_to_hf, write_hf
from moetron.model.transformer import Decoder

DTYPE = torch.bfloat16

# Each child prints its own peak RSS (and, for transformers, its load and save seconds) as JSON:
# the kernel's high-water mark of its resident set, VmHWM. Not ru_maxrss: a child's counts the
# pages of this process it shared between fork and exec.
PEAK = 'next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))'
MOETRON = f"""
import json, sys
from moetron.launcher.cli.main import main
code = main(sys.argv[1:])
print(json.dumps({{"rc": code, "peak_kib": {PEAK}}}))
"""
TRANSFORMERS = f"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
src, out, shard = sys.argv[1:]
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
t1 = time.perf_counter()
model.save_pretrained(out, max_shard_size=int(shard))
t2 = time.perf_counter()
print(json.dumps({{"rc": 0, "load_s": t1 - t0, "save_s": t2 - t1, "peak_kib": {PEAK}}}))
"""


def mixtral_of(gb: float, experts: int = 8, d_ff: int | None = None) -> ModelConfig:
    """A Mixtral-shaped config (GQA, top-2 of `experts`) of about `gb` GB in bf16: layers fill the
    size (at least one). A narrow `d_ff` with many experts makes a stack of experts larger than a
    shard while the model stays small."""
    wide = gb >= 0.25
    d, f, vocab = (1024, 2048, 32000) if wide else (128, 256, 1024)
    base = ModelConfig(vocab_size=vocab, d_model=d, n_layers=1, n_heads=16 if wide else 4, n_kv_heads=4,
                       d_ff=d_ff or f, max_seq_len=4096, rope_theta=1e6, moe=MoEConfig(num_experts=experts, top_k=2))
    one, per_layer = params_total(base), params_total(base.replace(n_layers=2)) - params_total(base)
    layers = max(1, 1 + round((gb * 1e9 / 2 - one) / per_layer))
    return base.replace(n_layers=layers)


class RandomTensors(Mapping):
    """A model's tensors, each drawn (N(0, 0.02), bf16) when it is looked up: nothing held."""

    def __init__(self, meta: dict[str, torch.Tensor], seed: int = 0):
        self.meta, self.gen = meta, torch.Generator().manual_seed(seed)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.meta[name]
        return (torch.randn(t.shape, generator=self.gen) * 0.02).to(t.dtype)

    def __iter__(self):
        return iter(self.meta)

    def __len__(self) -> int:
        return len(self.meta)


def write_source(cfg: ModelConfig, folder: Path, shards: int) -> int:
    """The random Hugging Face folder; → its shard size limit in bytes."""
    with torch.device("meta"):
        meta = {k: v.to(DTYPE) for k, v in Decoder(cfg).state_dict().items()}
    plan = plan_to_hf(cfg, meta)
    total = sum(t.numel() * t.element_size() for _, t in plan)
    max_shard = -(-total // shards)
    write_hf(Weights(cfg, RandomTensors(meta)), folder, DTYPE, plan, max_shard_bytes=max_shard)
    return max_shard


def timed(argv: list[str]) -> dict:
    """Run one child; → its JSON line plus the wall seconds it took and its CPU seconds (user +
    system: steadier than wall time on a shared machine)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}…: exit {out.returncode}\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {**result, "seconds": seconds, "cpu_s": cpu, "peak_rss_gb": result["peak_kib"] * 1024 / 1e9}


def run(gb: float, shards: int, base: Path, experts: int = 8, d_ff: int | None = None) -> dict:
    cfg = mixtral_of(gb, experts, d_ff)
    hf, ckpt, back, theirs = base / "hf", base / "ckpt", base / "hf-back", base / "hf-transformers"
    t0 = time.perf_counter()
    max_shard = write_source(cfg, hf, shards)
    files = sorted(hf.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    built = time.perf_counter() - t0
    moetron = [sys.executable, "-c", MOETRON, "convert"]
    from_hf = timed([*moetron, "--from-hf", str(hf), "--out", str(ckpt)])
    to_hf = timed([*moetron, "--to-hf", str(ckpt), "--out", str(back), "--max-shard-size", str(max_shard)])
    identical = all(filecmp.cmp(f, back / f.name, shallow=False) for f in files)
    shutil.rmtree(ckpt)
    shutil.rmtree(back)
    tf = timed([sys.executable, "-c", TRANSFORMERS, str(hf), str(theirs), str(max_shard)])
    return {"bench": "convert_speed", "bytes": size, "shards": len(files), "max_shard_bytes": max_shard,
            "layers": cfg.n_layers, "experts": cfg.moe.num_experts, "d_ff": cfg.d_ff,
            "expert_stack_bytes": cfg.moe.num_experts * cfg.d_model * cfg.d_ff * DTYPE.itemsize,
            "parameters": size // 2, "write_source_s": built, "round_trip_identical": identical,
            "from_hf": from_hf, "to_hf": to_hf, "transformers": tf, "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def print_table(r: dict) -> None:
    size = f"{r['bytes'] / 1e9:.2f} GB" if r["bytes"] >= 1e9 else f"{r['bytes'] / 1e6:.1f} MB"
    print(f"convert speed: a random Mixtral-family folder, {size} bf16 ({r['parameters'] / 1e6:,.0f}M "
          f"parameters, {r['layers']} layers, {r['experts']} experts: a stack of experts "
          f"{r['expert_stack_bytes'] / 1e6:,.0f} MB) in {r['shards']} shards of ≤ {r['max_shard_bytes'] / 1e6:,.0f} MB; "
          f"{os.cpu_count()} CPU cores; each row one fresh process (start and imports included)")
    f, t, tf = r["from_hf"], r["to_hf"], r["transformers"]
    rows = [("moetron convert --from-hf (HF → checkpoint)", f["seconds"], f["cpu_s"], f["peak_rss_gb"]),
            ("moetron convert --to-hf (checkpoint → HF)", t["seconds"], t["cpu_s"], t["peak_rss_gb"]),
            ("moetron, both ways", f["seconds"] + t["seconds"], f["cpu_s"] + t["cpu_s"],
             max(f["peak_rss_gb"], t["peak_rss_gb"])),
            ("transformers from_pretrained + save_pretrained", tf["seconds"], tf["cpu_s"], tf["peak_rss_gb"]),
            ("  of which from_pretrained", tf["load_s"], None, None),
            ("  of which save_pretrained", tf["save_s"], None, None)]
    print(f"| {'step':<48} | {'seconds':>8} | {'CPU s':>7} | {'peak RSS GB':>11} |")
    print(f"|{'-' * 50}|{'-' * 10}|{'-' * 9}|{'-' * 13}|")
    for name, seconds, cpu, rss in rows:
        print(f"| {name:<48} | {seconds:>8.1f} | {'' if cpu is None else f'{cpu:.1f}':>7} | "
              f"{'' if rss is None else f'{rss:.2f}':>11} |")
    print(f"round trip HF → moetron → HF byte-identical: {'yes' if r['round_trip_identical'] else 'NO'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="size of the random Hugging Face folder (bf16)")
    p.add_argument("--shards", type=int, default=4, help="safetensors files it is cut into")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--d-ff", type=int, default=None, help="expert hidden size (default 2048; 256 below 0.25 GB)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder; removed after)")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="moetron-convert-bench-", dir=args.dir))
    try:
        result = run(args.gb, args.shards, base, args.experts, args.d_ff)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
