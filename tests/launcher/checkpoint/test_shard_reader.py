"""Reading a DCP checkpoint's tensors straight from its shards (launcher/checkpoint/shard_reader.py)
and the conversion's view of them (`CheckpointTensors`): any rows of tensors saved in chunks cut
along any dim read back as `torch.load` of the whole gives them; stacks of experts come as `Rows`
converted an expert at a time; a storage DCP wrote strided falls back to `dcp.load`; a shard cut
short is refused; and `--to-hf` through the checkpoint writes the very files `save_hf` writes for
GPT-OSS (fused stacks built an expert at a time) and DeepSeek-V3."""

import dataclasses
import filecmp
import itertools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from moetron.launcher.checkpoint.hf_convert import CheckpointTensors, to_hf
from moetron.launcher.checkpoint.io import CheckpointDamaged, load_metadata
from moetron.launcher.checkpoint.shard_reader import ShardReader
from moetron.launcher.checkpoint.state import dcp_call
from moetron.launcher.checkpoint.weights import save_weights
from moetron.model.hf import config_from_hf, save_hf
from moetron.model.hf_files import Rows
from moetron.model.transformer import build_model


class ChunkedPlanner(DefaultSavePlanner):
    """DCP's planner, but each tensor named in `cuts` ({fqn: (dim, [boundaries])}) is written as
    chunks cut along `dim`, as ranks of a sharded model write it."""

    def __init__(self, cuts: dict[str, tuple[int, list[int]]]):
        super().__init__()
        self.cuts = cuts

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            t = self.state_dict[item.index.fqn]
            dim, bounds = self.cuts.get(item.index.fqn, (0, []))
            edges = [0, *bounds, t.shape[dim]] if t.dim() else [0, 0]
            for lo, hi in itertools.pairwise(edges):
                offsets, sizes = [0] * t.dim(), list(t.shape)
                if t.dim():
                    offsets[dim], sizes[dim] = lo, hi - lo
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                items.append(WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk, TensorProperties.create_from_tensor(t),
                                                                   t.size())))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        t, chunk = self.state_dict[write_item.index.fqn], write_item.tensor_data.chunk
        for d, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
            t = t.narrow(d, o, s)
        return t.clone()


def save_chunked(folder, tensors, cuts, files_per_item=False):
    writer = FileSystemWriter(str(folder), single_file_per_rank=not files_per_item)
    dcp_call(dcp.save, {"model": tensors}, storage_writer=writer, planner=ChunkedPlanner(cuts), no_dist=True)


def random_tensors():
    g = torch.Generator().manual_seed(0)
    return {"stack": torch.randn(7, 4, 5, generator=g), "wide": torch.randn(7, 6, 3, generator=g),
            "matrix": torch.randn(9, 4, generator=g).to(torch.bfloat16), "table": torch.randn(9, 4, generator=g),
            "vector": torch.randn(11, generator=g),
            "scalar": torch.tensor(3.5)}


@pytest.mark.parametrize("files_per_item", [False, True])
def test_every_row_range_reads_back_whatever_the_chunks(tmp_path, files_per_item):
    tensors = random_tensors()
    cuts = {"model.stack": (0, [2, 3]), "model.wide": (1, [1, 4]), "model.table": (1, [2]), "model.vector": (0, [5])}
    save_chunked(tmp_path, tensors, cuts, files_per_item)
    reader = ShardReader(tmp_path, load_metadata(tmp_path))
    try:
        assert len(reader.metadata.state_dict_metadata["model.stack"].chunks) == 3
        for name, t in tensors.items():
            assert reader.readable(f"model.{name}")
            if t.dim() == 0:
                assert torch.equal(reader.read_rows(f"model.{name}", 0, 0), t)
                continue
            for lo in range(len(t)):
                for hi in range(lo + 1, len(t) + 1):
                    got = reader.read_rows(f"model.{name}", lo, hi)
                    assert got.dtype == t.dtype and torch.equal(got, t[lo:hi]), (name, lo, hi)
    finally:
        reader.close()


def test_checkpoint_tensors_stream_stacks_and_convert_in_blocks(tmp_path):
    tensors = random_tensors()
    save_chunked(tmp_path, tensors, {"model.stack": (0, [3]), "model.table": (0, [5])})
    ckpt = CheckpointTensors(tmp_path, torch.bfloat16)
    ckpt.BLOCK_BYTES = 40  # "table" converted two rows at a time, across its chunks' edge
    try:
        for name, t in tensors.items():
            got = ckpt[name]
            want = t.to(torch.bfloat16)
            if t.dim() >= 3:
                assert isinstance(got, Rows) and got.shape == t.shape and got.dtype == torch.bfloat16
                assert torch.equal(torch.stack([got[e] for e in range(len(got))]), want)
            else:
                assert torch.equal(got, want), name
    finally:
        ckpt.close()


def test_a_strided_storage_falls_back_to_dcp_load(tmp_path):
    # DCP keeps a transposed tensor's strides when its storage is exactly its own.
    t = torch.randn(5, 4, 3).transpose(0, 2)
    dcp_call(dcp.save, {"model": {"stack": t}}, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    ckpt = CheckpointTensors(tmp_path, torch.float32)
    try:
        assert not ckpt.shards.readable("model.stack")
        got = ckpt["stack"]
        assert isinstance(got, torch.Tensor) and torch.equal(got, t)
    finally:
        ckpt.close()


def test_a_shard_cut_short_is_refused(tmp_path):
    save_chunked(tmp_path, random_tensors(), {})
    shard = next(tmp_path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-2000])
    reader = ShardReader(tmp_path, load_metadata(tmp_path))
    with pytest.raises(CheckpointDamaged):
        for name, md in reader.metadata.state_dict_metadata.items():
            if reader.readable(name):
                reader.read_rows(name, 0, md.size[0] if len(md.size) else 0)
    reader.close()


GPT_OSS = dict(model_type="gpt_oss", vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=2,
               sliding_window=4, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48,
                   moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                   num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                   topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                   v_head_dim=8, max_position_embeddings=64)


@pytest.mark.parametrize("hf_config", [GPT_OSS, DEEPSEEK_V3], ids=["gpt_oss", "deepseek_v3"])
def test_to_hf_through_a_checkpoint_writes_what_save_hf_writes(tmp_path, hf_config):
    torch.manual_seed(0)
    model = build_model(config_from_hf(hf_config))
    save_hf(model, tmp_path / "direct", max_shard_bytes=20_000)
    save_weights(model, tmp_path / "ckpt", source="test")
    to_hf(tmp_path / "ckpt", tmp_path / "streamed", max_shard_bytes=20_000)
    names = sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert len(names) > 3 and names == sorted(p.name for p in (tmp_path / "streamed").iterdir())
    for name in names:
        assert filecmp.cmp(tmp_path / "direct" / name, tmp_path / "streamed" / name, shallow=False), name
