"""The communication predictor against sums worked out by hand for the bench's tiny model.

Model: D 64, 2 layers (both MoE), 4 query / 2 KV heads of 16, 8 experts top-2 of hidden 64, V 320,
SwiGLU, RMSNorm, no biases. One step: 8 sequences × 32 tokens = 256 tokens, fp32. Every number is
summed over both ranks; see launcher/perf/comm_volume.py for the byte convention.
"""

from dataclasses import replace

import pytest

from moetron.launcher.perf.comm_volume import by_kind, predict_step
from moetron.model.config import MLAConfig, ModelConfig, MoEConfig
from moetron.parallel.config import ParallelConfig

MODEL = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                    moe=MoEConfig(num_experts=8, top_k=2, d_expert=64))
CONTROL_CALLS, CONTROL_BYTES = 2 * 3, 2 * (8 + 8 + 4)  # grad norm (f64), losses (2 × f32), stop flag


def predict(**layout):
    return by_kind(predict_step(MODEL, ParallelConfig(**layout), batch=8, seq_len=32))


def test_tensor_parallel_all_reduces_activations_and_loss():
    got = predict(tp=2)
    # Both tp ranks see all 256 tokens: an activation all-reduce is 256 × 64 × 4 B on each.
    # Sites: attention out (fwd) and in (bwd) of 2 layers, embedding (fwd), head input (bwd).
    activations = 6 * 2 * (256 * 64 * 4)
    # loss_parallel: max, sum of exponentials and target logit, one fp32 per token each.
    loss = 3 * 2 * (256 * 4)
    assert got["all_reduce"] == {"calls": 12 + 6 + CONTROL_CALLS, "bytes": activations + loss + CONTROL_BYTES}
    assert got["all_to_all"]["calls"] == got["all_gather"]["calls"] == got["p2p"]["calls"] == 0


def test_tensor_parallel_mla_all_reduces_its_latents_gradients_instead_of_the_inputs():
    # MLA (q latent 24, kv latent 32, rope key 8): the down projections are whole on each tp rank,
    # so attention's input gradient needs no all-reduce; the three latents' gradients do, per layer.
    mla = MLAConfig(kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    got = by_kind(predict_step(replace(MODEL, n_kv_heads=None, mla=mla), ParallelConfig(tp=2), batch=8, seq_len=32))
    activations = 4 * 2 * (256 * 64 * 4)  # attention out (fwd) of 2 layers, embedding, head input
    latents = 2 * 2 * 256 * (24 + 32 + 8) * 4
    loss = 3 * 2 * (256 * 4)
    # bench/comm_volume.py --layouts tp2_mla measures 32 calls and these bytes (+8: its control count).
    assert got["all_reduce"] == {"calls": 8 + 12 + 6 + CONTROL_CALLS,
                                 "bytes": activations + latents + loss + CONTROL_BYTES}


def test_sequence_parallel_gathers_and_scatters_instead():
    got = predict(tp=2, sequence_parallel=True)
    full = 256 * 64 * 4  # a gathered (or to-be-scattered) residual of all 256 tokens
    # per layer: attention in (fwd) and out (bwd) gathers, the MoE input (fwd) and output grad
    # (bwd) gathers; plus the head input (fwd) and the embedding's output grad (bwd)
    assert got["all_gather"] == {"calls": 2 * (2 * 2 + 2 * 2 + 2), "bytes": 2 * 10 * full}
    # per layer: attention out (fwd) and in (bwd); the embedding (fwd) and head input (bwd)
    assert got["reduce_scatter"] == {"calls": 2 * 6, "bytes": 2 * 6 * full}
    # 5 norm gains (2 per layer + final) reduced on both ranks, plus the loss and control
    assert got["all_reduce"]["calls"] == 2 * 5 + 6 + CONTROL_CALLS
    assert got["all_reduce"]["bytes"] == 2 * 5 * 64 * 4 + 3 * 2 * 256 * 4 + CONTROL_BYTES


def test_expert_parallel_with_fsdp():
    got = predict(dp=2, ep=2)
    # Each rank routes its 128 tokens to 2 experts: 256 rows of 64 fp32 per exchange, four
    # exchanges per MoE layer (dispatch and combine, forward and backward), plus 8 int64 counts.
    assert got["all_to_all"] == {"calls": 2 * 2 * 5, "bytes": 2 * 2 * (4 * 256 * 64 * 4 + 8 * 8)}
    # FSDP over both ranks; the experts sit on 1-rank groups (dp / ep = 1) and move nothing.
    block = 2 * 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 8 * 64  # norms, q, k, v, o, router
    embed, tail = 320 * 64, 64 + 320 * 64
    elements = 2 * block + embed + tail
    assert got["all_gather"] == {"calls": 2 * 4 * 2, "bytes": 2 * 2 * elements * 4}
    assert got["reduce_scatter"] == {"calls": 2 * 4, "bytes": 2 * elements * 4}
    assert got["all_reduce"] == {"calls": CONTROL_CALLS, "bytes": CONTROL_BYTES}


def test_expert_tensor_parallel_all_reduces_the_expert_rows():
    plain, got = predict(tp=2), predict(tp=2, etp=2)
    # Both tp ranks route all 256 tokens to 2 experts: 512 rows of 64 fp32 each, all-reduced as the
    # experts' output (forward) and as their input's gradient (backward), in both MoE layers.
    rows = 256 * 2 * 64 * 4
    assert got["all_reduce"]["calls"] - plain["all_reduce"]["calls"] == 2 * 2 * 2
    assert got["all_reduce"]["bytes"] - plain["all_reduce"]["bytes"] == 2 * 2 * 2 * rows
    assert {k: v for k, v in got.items() if k != "all_reduce"} == {k: v for k, v in plain.items() if k != "all_reduce"}


def test_expert_tensor_parallel_halves_the_expert_weights_fsdp_moves():
    plain, got = predict(dp=4, ep=2, tp=2), predict(dp=4, ep=2, tp=2, etp=2)
    # Each of the 8 ranks sees 64 tokens, 128 routes: their rows, wherever the all-to-all takes
    # them, are all-reduced over tp once forward and once backward per MoE layer.
    assert got["all_reduce"]["bytes"] - plain["all_reduce"]["bytes"] == 2 * 2 * 8 * (128 * 64 * 4)
    assert got["all_to_all"] == plain["all_to_all"]
    # The experts' FSDP unit (4 experts of 3 × 64 × 64, on the 2 ranks holding them) loses half
    # its columns: 4 × 3 × 64 × 32 fewer elements, gathered twice and scattered once on 8 ranks.
    half = 4 * 3 * 64 * 32 * 4
    assert plain["all_gather"]["bytes"] - got["all_gather"]["bytes"] == 2 * 2 * 8 * half
    assert plain["reduce_scatter"]["bytes"] - got["reduce_scatter"]["bytes"] == 2 * 8 * half


def test_context_parallel_gathers_keys_values_and_router_statistics():
    got = predict(cp=2)
    # Each rank holds 16 of the 32 positions of all 8 sequences; per layer it gathers both ranks'
    # K and V (8 × 32 positions × K, V × 2 KV heads of 16 fp32) and scatters their gradient back.
    kv = 8 * 32 * 2 * 2 * 16 * 4
    # Per MoE layer the routers' counts (8 int64) and, for the Switch loss, 8 score sums and the
    # token count (fp32), from both ranks; the score sums' gradient is scattered back.
    counts, stats = 2 * 8 * 8, 2 * 9 * 4
    # FSDP shards every unit over the two cp ranks: 2 blocks (experts inside), embedding, tail.
    block = 2 * 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 8 * 64 + 3 * 8 * 64 * 64
    elements = 2 * block + 320 * 64 + 64 + 320 * 64
    # bench/comm_volume.py --layouts cp2 measures these calls and bytes on a real step.
    assert got["all_gather"] == {"calls": 2 * (2 + 2 + 2 + 4 * 2),
                                 "bytes": 2 * (2 * kv + 2 * counts + 2 * stats + 2 * elements * 4)}
    assert got["reduce_scatter"] == {"calls": 2 * (2 + 2 + 4), "bytes": 2 * (2 * kv + 2 * stats + elements * 4)}
    assert got["all_reduce"] == {"calls": CONTROL_CALLS, "bytes": CONTROL_BYTES}
    # The sequence loss gathers its statistics per sequence: 8 × (2 × 8 + 1) instead of 8 + 1.
    seq = by_kind(predict_step(replace(MODEL, moe=replace(MODEL.moe, aux_loss_type="sequence")),
                               ParallelConfig(cp=2), batch=8, seq_len=32))
    assert seq["all_gather"]["bytes"] - got["all_gather"]["bytes"] == 2 * 2 * 2 * (8 * 17 - 9) * 4


def test_ddp_all_reduces_every_gradient_once():
    got = predict(dp=2, dp_mode="ddp")
    total = 2 * (2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 8 * 64 + 3 * 8 * 64 * 64) + 320 * 64 + 64 + 320 * 64
    assert got["all_reduce"] == {"calls": 2 * 4 + CONTROL_CALLS, "bytes": 2 * total * 4 + CONTROL_BYTES}
    assert got["all_gather"]["calls"] == 0


def test_pipeline_sends_activations_and_gradients_per_microbatch():
    got = predict(pp=2, microbatches=2)
    # One boundary; 2 micro-batches of 4 × 32 tokens; activation forward, gradient backward.
    assert got["p2p"] == {"calls": 2 * 2, "bytes": 2 * 2 * (4 * 32 * 64 * 4)}
    assert got["all_reduce"] == {"calls": CONTROL_CALLS, "bytes": CONTROL_BYTES}


@pytest.mark.parametrize("accum", [1, 2])
def test_fsdp_under_pipeline_gathers_once_per_microbatch_and_once_for_backward(accum):
    """pp 2 × dp 2: each unit lives on one stage's 2 ranks. The schedule leaves a stage gathered
    after a backward, so 2 micro-batches cost 3 gathers per unit, not 4, and it reduces at the end
    of each of its steps: once per accumulation step. bench/plan_check.py --layouts pp2_dp2_1f1b
    measures the accum=1 case."""
    got = by_kind(predict_step(MODEL, ParallelConfig(pp=2, dp=2, microbatches=2), batch=8, seq_len=32,
                               grad_accum=accum))
    block = 2 * 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 8 * 64 + 3 * 8 * 64 * 64
    elements = 2 * block + 320 * 64 + 64 + 320 * 64  # 2 blocks, embedding (stage 0), tail (stage 1)
    assert got["all_gather"] == {"calls": accum * 4 * 2 * 3, "bytes": accum * 2 * 3 * elements * 4}
    assert got["reduce_scatter"] == {"calls": accum * 4 * 2, "bytes": accum * 2 * elements * 4}
    ddp = by_kind(predict_step(MODEL, ParallelConfig(pp=2, dp=2, microbatches=2, dp_mode="ddp"), batch=8,
                               seq_len=32, grad_accum=accum))
    control_calls, control_bytes = 4 * 3, 4 * (8 + 8 + 4)
    assert ddp["all_reduce"] == {"calls": accum * 4 * 2 + control_calls,
                                 "bytes": accum * 2 * elements * 4 + control_bytes}


@pytest.mark.parametrize("accum", [1, 2])
def test_grad_accumulation_repeats_fsdp_gathers_and_scatters_not_ddp_all_reduces(accum):
    """FSDP reduce-scatters every micro-batch's gradients, keeping them sharded; DDP all-reduces once."""
    one = by_kind(predict_step(MODEL, ParallelConfig(dp=2), batch=8, seq_len=32, grad_accum=1))
    got = by_kind(predict_step(MODEL, ParallelConfig(dp=2), batch=8, seq_len=32, grad_accum=accum))
    assert got["all_gather"]["bytes"] == accum * one["all_gather"]["bytes"]
    assert got["reduce_scatter"] == {k: accum * v for k, v in one["reduce_scatter"].items()}
    ddp = ParallelConfig(dp=2, dp_mode="ddp")
    one, got = (by_kind(predict_step(MODEL, ddp, batch=8, seq_len=32, grad_accum=a)) for a in (1, accum))
    assert got["all_reduce"] == one["all_reduce"]


def test_one_process_communicates_nothing():
    assert all(v == {"calls": 0, "bytes": 0} for v in predict().values())
    assert predict_step(replace(MODEL, moe=MoEConfig()), ParallelConfig(), batch=8, seq_len=32) == []


def test_hsdp_shards_inside_a_group_and_all_reduces_shards_across_groups():
    """HSDP 2 × 2 on 4 ranks: FSDP's traffic inside each pair, then each rank's half of every
    gradient all-reduced with the other pair's."""
    fsdp2 = by_kind(predict_step(MODEL, ParallelConfig(dp=2), batch=4, seq_len=32))
    hsdp = by_kind(predict_step(MODEL, ParallelConfig(dp=4, dp_mode="hsdp", dp_shard=2), batch=8, seq_len=32))
    # Per shard group the gathers and scatters equal FSDP on 2 ranks with the same tokens per rank.
    assert hsdp["all_gather"] == {k: 2 * v for k, v in fsdp2["all_gather"].items()}
    assert hsdp["reduce_scatter"] == {k: 2 * v for k, v in fsdp2["reduce_scatter"].items()}
    # One all-reduce per unit and rank, of that rank's shard: half of the unit, summed over 4 ranks.
    units = fsdp2["reduce_scatter"]["calls"] // 2
    shard_bytes = fsdp2["reduce_scatter"]["bytes"] // 2 // 2
    control_calls, control_bytes = 4 * 3, 4 * (8 + 8 + 4)
    assert hsdp["all_reduce"] == {"calls": 4 * units + control_calls, "bytes": 4 * shard_bytes + control_bytes}


def test_zero1_all_reduces_like_ddp_then_broadcasts_every_parameter():
    ddp = predict(dp=2, dp_mode="ddp")
    zero1 = predict(dp=2, dp_mode="zero1")
    assert zero1["all_reduce"] == ddp["all_reduce"]
    # 2 blocks of 2 norms, q, k, v, o, router and 3 expert tensors; the embedding; final norm and head.
    tensors = 2 * (2 + 4 + 1 + 3) + 1 + 2
    grads = ddp["all_reduce"]["bytes"] - CONTROL_BYTES
    assert zero1["broadcast"] == {"calls": 2 * tensors, "bytes": grads}


def test_the_global_batch_loss_all_reduces_route_counts_per_moe_layer_and_micro_batch():
    """bench/comm_volume.py --layouts dp2_accum2_global_loss measures these on a real step."""
    model = replace(MODEL, moe=replace(MODEL.moe, aux_loss_type="global_batch"))
    got = by_kind(predict_step(model, ParallelConfig(dp=2), batch=8, seq_len=32, grad_accum=2))
    base = by_kind(predict_step(MODEL, ParallelConfig(dp=2), batch=8, seq_len=32, grad_accum=2))
    calls = 2 * 2 * 2  # MoE layers × micro-batches × ranks
    assert got["all_reduce"]["calls"] - base["all_reduce"]["calls"] == calls
    assert got["all_reduce"]["bytes"] - base["all_reduce"]["bytes"] == calls * 8 * 8  # E float64 counts
    one = by_kind(predict_step(model, ParallelConfig(), batch=8, seq_len=32, grad_accum=2))
    assert one == by_kind(predict_step(MODEL, ParallelConfig(), batch=8, seq_len=32, grad_accum=2))


# Multi-token prediction, depth 1: one more block (layer 2, MoE like the others), eh_proj (64 × 128)
# and three norms, the embedding and the head once more, a loss over the 31 positions with a target.
MTP = replace(MODEL, mtp_depth=1)
BLOCK = 2 * 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 8 * 64  # norms, q, k, v, o, router
EXPERTS = 3 * 8 * 64 * 64
MTP_ROOT = 3 * 64 + 64 * 128  # enorm, hnorm, norm, eh_proj: what no child unit holds


def predict_mtp(**layout):
    return by_kind(predict_step(MTP, ParallelConfig(**layout), batch=8, seq_len=32))


def test_tensor_parallel_with_mtp_adds_a_block_an_embedding_and_a_head_site_and_a_shorter_loss():
    """bench/comm_volume.py --layouts tp2_mtp measures 38 calls and these bytes (+8: its control count)."""
    got = predict_mtp(tp=2)
    # Attention in and out of 3 blocks, 2 lookups of the embedding (fwd), 2 head inputs (bwd).
    activations = 10 * 2 * (256 * 64 * 4)
    # The main loss over 8 × 32 positions, depth 1's over the 8 × 31 that have a target.
    loss = 3 * 2 * (8 * 32 * 4) + 3 * 2 * (8 * 31 * 4)
    assert got["all_reduce"] == {"calls": 20 + 6 + 6 + CONTROL_CALLS, "bytes": activations + loss + CONTROL_BYTES}


def test_sequence_parallel_with_mtp_reduces_its_replicated_parts_gradients():
    """bench/comm_volume.py --layouts tp2_sp_mtp measures these calls and bytes."""
    got = predict_mtp(tp=2, sequence_parallel=True)
    full = 256 * 64 * 4
    # per block (3): attention in (fwd) and out (bwd), the MoE input and output grad; 2 head inputs
    # (fwd) and 2 embedding output grads (bwd)
    assert got["all_gather"] == {"calls": 2 * (3 * 4 + 4), "bytes": 2 * 16 * full}
    # per block: attention out (fwd) and in (bwd); 2 embeddings (fwd), 2 head inputs (bwd)
    assert got["reduce_scatter"] == {"calls": 2 * 10, "bytes": 2 * 10 * full}
    # 6 block norms + final + enorm, hnorm, norm = 10 gains, eh_proj; both losses; control
    loss = 3 * 2 * (8 * 32 * 4) + 3 * 2 * (8 * 31 * 4)
    assert got["all_reduce"] == {"calls": 2 * 10 + 2 + 12 + CONTROL_CALLS,
                                 "bytes": 2 * 10 * 64 * 4 + 2 * 64 * 128 * 4 + loss + CONTROL_BYTES}


def test_ddp_with_mtp_all_reduces_its_block_and_the_root():
    """bench/comm_volume.py --layouts dp2_ddp_mtp measures these calls and bytes (+8: control)."""
    got = predict_mtp(dp=2, dp_mode="ddp")
    total = 3 * (BLOCK + EXPERTS) + 320 * 64 + 64 + 320 * 64 + MTP_ROOT
    assert got["all_reduce"] == {"calls": 2 * 6 + CONTROL_CALLS, "bytes": 2 * total * 4 + CONTROL_BYTES}


def test_fsdp_with_mtp_gathers_the_embedding_and_the_head_again():
    """bench/comm_volume.py --layouts ep2_mtp measures these calls and bytes (the experts sit on
    1-rank groups; the all-to-alls count the MTP block as a third MoE layer)."""
    got = predict_mtp(dp=2, ep=2)
    embed, tail = 320 * 64, 64 + 320 * 64
    # Per rank: 3 blocks twice, the root once (kept for backward), the embedding for the main
    # lookup, depth 1's and backward, the head group twice in forward (main, depth 1) and three
    # times in backward (the first output's gradient, the main logits', the decoder's router losses').
    gathered = 3 * 2 * BLOCK + MTP_ROOT + 3 * embed + 5 * tail
    assert got["all_gather"] == {"calls": 2 * (6 + 1 + 3 + 5), "bytes": 2 * gathered * 4}
    assert got["reduce_scatter"] == {"calls": 2 * 6, "bytes": 2 * (3 * BLOCK + MTP_ROOT + embed + tail) * 4}
    assert got["all_to_all"] == {"calls": 2 * 3 * 5, "bytes": 2 * 3 * (4 * 256 * 64 * 4 + 8 * 8)}


def test_pipeline_with_mtp_sends_the_token_ids_and_sums_the_embedding_copies():
    """bench/comm_volume.py --layouts pp2_mtp measures these calls and bytes (+8: control)."""
    got = predict_mtp(pp=2, microbatches=2)
    # Per micro-batch of 4 × 32 tokens: activations forward, their gradient back, the ids forward.
    assert got["p2p"] == {"calls": 2 * 3, "bytes": 2 * (2 * 4 * 32 * 64 * 4 + 4 * 32 * 8)}
    # The first stage's embedding gradient and the last stage's copy's, all-reduced by the pair.
    assert got["all_reduce"] == {"calls": 2 + CONTROL_CALLS, "bytes": 2 * 320 * 64 * 4 + CONTROL_BYTES}
