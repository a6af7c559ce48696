"""ftkit.realscale: a training step at Qwen3-4B's widths on fake tensors, through the FSDP script's own sharding;
its tracked peak memory against the memory model, its counted FLOPs against the MFU convention.

One run, shared by the assertions: fsdp at world 2 (this process plays rank 0 of a fake group), the scripts' default
configuration (micro-batch 2 x 2048 tokens, global batch 16, so 4 accumulation micro-steps per optimizer step,
LoRA r=16 with dropout 0.05, checkpointing on), but 2 of Qwen3-4B's 36 decoder layers (`--layers 2`): every width
is Qwen3-4B's (hidden 2560, intermediate 9728, 32/8 heads, the 151,936-word tied embedding), and on fake tensors
the time goes by the number of ops, so 36 layers would take minutes. The full-depth runs are recorded in
devlogs/runs/realscale/."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, run_script
from torch.utils.flop_counter import FlopCounterMode

from ftkit import activations, memory, models, realscale
from ftkit.realscale import command, flops, report

RUN = ("--technique", "fsdp", "--world", "2", "--layers", "2", "--json")
# The count's attention against the convention's at the default 2048 tokens (test_flops_counted_against_the_convention).
CAUSAL_WITH_RECOMPUTE = 7 * 2049 / (6 * 2048)


def sdpa_args(op, causal: bool, b: int, h: int, s: int, d: int) -> list:
    """Arguments for an SDPA op by its schema: [b, h, s, d] meta tensors for the query, key, value, output and its
    gradient, is_causal as asked, the other arguments their defaults (or None)."""
    args = []
    for a in op.default._schema.arguments:
        if a.name.rstrip("_") in ("query", "key", "value", "out", "grad_out"):
            args.append(torch.empty(b, h, s, d, device="meta"))
        elif a.name == "is_causal":
            args.append(causal)
        else:
            args.append(a.default_value if a.has_default_value() else None)
    return args


def test_causal_attention_is_counted_for_the_pairs_its_mask_keeps():
    """SDPA as the causal kernels compute it: of s x s query-key pairs, the s (s + 1) / 2 the mask keeps, each
    2 d FLOPs per matmul: forward QK^T and PV, backward the scores recomputed, dV, dP, dQ and dK. FlopCounterMode's
    own formulas count all s x s; is_causal=False keeps them all. Run on the CPU's SDPA (forward and backward),
    and for every backend's op (flash, memory-efficient, cuDNN) through its formula."""
    b, h, s, d = 1, 2, 8, 4
    formulas = flops.causal_sdpa_formulas()
    for causal, pairs in ((True, s * (s + 1) // 2), (False, s * s)):
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
        with FlopCounterMode(display=False, custom_mapping=formulas) as counter:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
        assert counter.get_total_flops() == (2 + 5) * 2 * b * h * d * pairs
    assert len(formulas) == 8
    for op, formula in formulas.items():
        matmuls = 5 if op.__name__.endswith("_backward") else 2
        for causal, pairs in ((True, s * (s + 1) // 2), (False, s * s)):
            assert formula(*sdpa_args(op, causal, b, h, s, d)) == matmuls * 2 * b * h * d * pairs, op


@pytest.fixture(scope="module")
def fsdp_world2() -> dict:
    proc = run_script("-m", "ftkit.realscale", *RUN, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_run_is_the_scripts_configuration(fsdp_world2):
    result = fsdp_world2
    assert result["technique"] == "fsdp" and result["world_size"] == 2
    assert result["script"] == "experiments/fsdp-ft/train.py"
    cfg = result["config"]
    assert (cfg["layers"], cfg["micro_batch_size"], cfg["max_length"], cfg["accumulation_steps"]) == (2, 2, 2048, 4)
    assert cfg["grad_checkpointing"] and cfg["lora_rank"] == 16 and cfg["lora_dropout"] == 0.05
    assert result["label"] == realscale.LABEL
    # Nothing measured another way than the stated stand-ins: the CPU device, the synthetic batch, the restated loop,
    # and two CPU behaviours replaced by CUDA's (no mask for an unpadded batch; dropout's 1-byte mask).
    assert len(result["stand_ins"]) == 5, result["stand_ins"]
    assert any(s.startswith("no attention mask") for s in result["stand_ins"])
    assert any(s.startswith("LoRA dropout runs as torch.native_dropout") for s in result["stand_ins"])


def test_fewer_micro_steps_reach_the_same_peak(fsdp_world2):
    """--micro-steps runs 2 of the 4 accumulation micro-steps: after the first, each accumulates into the same
    gradients, so the peak is the whole step's, to the byte (it was not while the tracker's module hooks kept every
    micro-step's embedding output alive: `realscale.trackers.no_tracker_graph_leak`)."""
    proc = run_script("-m", "ftkit.realscale", *RUN, "--micro-steps", "2", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fewer = json.loads(proc.stdout)
    assert fewer["config"]["micro_steps_run"] == 2 and fsdp_world2["config"]["micro_steps_run"] == 4
    assert fewer["tracked_peak_bytes"] == fsdp_world2["tracked_peak_bytes"]
    assert fewer["flops_counted"] == pytest.approx(fsdp_world2["flops_counted"], rel=1e-9)


def test_one_decoder_layer_saves_what_the_model_derives_to_the_byte():
    """Without checkpointing every layer keeps its activations, so one more layer adds exactly one layer's worth
    to the tracked peak: at Qwen3-4B's widths, 2 x 2048 tokens, LoRA r=16 with dropout 0.05, the memory model's
    200,200 bytes per token (FSDP2 gathers the adapters in bf16, so autocast makes no copies of them). This
    holds only with the two CUDA stand-ins: on the CPU, a fake mask adds a saved 2 x 2048 x 2048 mask and 32-head
    k and v per layer (16,384 B per token), and dropout's noise tensors 26,624 B per token."""
    runs = {}
    for layers in (1, 2):
        # Global batch 4: one micro-step per optimizer step (the activations per layer are the same; quicker).
        argv = ("--technique", "fsdp", "--world", "2", "--layers", str(layers), "--batch-size", "4")
        argv += ("--no-grad-checkpointing", "--json")
        proc = run_script("-m", "ftkit.realscale", *argv, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[layers] = json.loads(proc.stdout)
    one_layer = runs[2]["categories"]["Activation"] - runs[1]["categories"]["Activation"]
    shape = memory.QWEN3_4B
    tokens = 2 * 2048
    assert one_layer == tokens * sum(activations.layer_activation_bytes(shape, act_bytes=2, lora_dropout=0.05))
    assert runs[2]["predicted"]["activations"] - runs[1]["predicted"]["activations"] == one_layer


def test_tracked_peak_within_10_percent_of_the_memory_model(fsdp_world2):
    tracked, predicted = fsdp_world2["tracked_peak_bytes"], fsdp_world2["predicted_bytes"]
    assert 0.9 <= tracked / predicted <= 1.1, (tracked, predicted, fsdp_world2["categories"])
    # Parameter shards (frozen base and adapters): the model's arithmetic, byte for byte up to the 512-byte-aligned
    # padding FSDP2 gives each shard.
    shards = fsdp_world2["categories"]["Sharded Param"]
    model = fsdp_world2["predicted"]["weights"] + fsdp_world2["predicted"]["lora"]
    assert abs(shards - model) / model < 0.01


def test_flops_counted_against_the_convention(fsdp_world2):
    """The convention (ftkit/metrics.py) and the count agree to the FLOP on the projections and the adapters
    (4 N_frozen + 6 N_lora per token). They count two things differently, each pinned here to its reason:
    - attention: the convention counts causal attention, 6 L d s per token (half of the s x s: QK^T and PV
      forward, twice that backward); the count takes the pairs the causal mask keeps, s (s + 1) / 2 of them, and
      in backward the recompute of the scores too (5 matmuls against the forward's 2): 7 L d (s + 1) per token,
      7 (s + 1) / 6 s of the convention;
    - lm_head: the convention counts it at every token; the scripts run it on the answer positions only
      (`logits_to_keep`), which is what is counted: answer / length of the convention.
    The convention with the lm_head at the logits computed is within 5% of the count, the attention's recompute
    the difference; the MFU convention itself is not, in general: at this depth the lm_head dominates."""
    counted, convention = fsdp_world2["flops_counted_by_component"], fsdp_world2["flops_convention_by_component"]
    cfg = fsdp_world2["config"]
    s = cfg["max_length"]
    assert counted["projections_and_adapters"] == pytest.approx(convention["projections_and_adapters"], rel=0.05)
    assert counted["attention"] == pytest.approx(convention["attention"] * 7 * (s + 1) / (6 * s), rel=1e-6)
    assert counted["lm_head"] == pytest.approx(convention["lm_head"] * cfg["answer_tokens"] / s, rel=1e-6)
    assert fsdp_world2["flops_counted"] == pytest.approx(sum(counted.values()), rel=1e-9)
    at_logits = fsdp_world2["flops_convention"] - convention["lm_head"] * (1 - cfg["answer_tokens"] / s)
    assert fsdp_world2["flops_convention_at_logits"] == pytest.approx(at_logits, rel=1e-9)
    assert fsdp_world2["flops_counted_over_convention_at_logits"] == pytest.approx(1, abs=0.05)
    # less the attention backward's recompute of the scores, 1/7 of the counted attention: the convention's
    assert report.model_flops_over_convention(fsdp_world2) == pytest.approx(1, abs=0.01)
    assert not any("unexplained" in s for s in fsdp_world2["stand_ins"]), fsdp_world2["stand_ins"]
    # Checkpointing recomputes each layer's forward in backward: a third of a frozen layer's 4N, more with LoRA.
    assert 1.3 < fsdp_world2["flops_counted_with_recompute"] / fsdp_world2["flops_counted"] < 1.5


COMMITTED = sorted((Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "realscale").glob("*.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.stem)
def test_every_committed_run_counts_the_mfu_convention_within_5_percent(path):
    """Every committed full-depth run, every technique: the counted FLOPs less the work the convention leaves out
    as repeated (`report.flops_repeated`: the attention backward's recompute of the scores; TP's lm_head and whole
    adapter halves, computed on every rank) are the MFU convention's share of the rank within 5% (0.992-1.000
    today). Without that accounting TP at world 8 (1.125) and cp-ft's 32,768-token sequences (1.11) were not."""
    result = json.loads(path.read_text())
    assert report.model_flops_over_convention(result) == pytest.approx(1, abs=0.05), path.stem
    repeated = report.flops_repeated(result)
    assert repeated["attention_scores"] > 0
    assert (repeated["tp_replicated"] > 0) == (
        result["technique"] in realscale.TENSOR_PARALLEL and result["world_size"] > 1
    )


def test_matmuls_run_in_bf16(fsdp_world2):
    assert fsdp_world2["bf16_matmul_fraction"] >= 0.98, fsdp_world2["matmul_flops_by_dtype"]


# tp-ft's plan (DTensor) and tp-sp-ft's hand-rolled linears at world 2 on one decoder layer, 2 micro-steps per
# optimizer step (global batch 4): every rank runs every sequence, each holding half of each projection.
TP_RUN = ("--world", "2", "--layers", "1", "--batch-size", "4", "--json")
PP_RUN = ("--technique", "pp", "--world", "2", "--layers", "2", "--batch-size", "4", "--json")


@pytest.fixture(scope="module", params=["tp", "tp-sp"])
def tp_world2(request) -> dict:
    proc = run_script("-m", "ftkit.realscale", "--technique", request.param, *TP_RUN, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_tp_parameters_are_the_memory_models_to_the_byte(tp_world2):
    """Both TP scripts shard each decoder layer's projections (and their adapters, as Megatron splits them) and
    keep the embedding / tied lm_head and the norms whole on every rank: the memory model's TP weights, byte for
    byte."""
    script = {"tp": "experiments/tp-ft/train.py", "tp-sp": "experiments/tp-sp-ft/train.py"}[tp_world2["technique"]]
    assert tp_world2["script"] == script and tp_world2["config"]["accumulation_steps"] == 2
    predicted = tp_world2["predicted"]
    assert tp_world2["categories"]["Parameter"] == predicted["weights"] + predicted["lora"]


def test_tp_flops_are_each_ranks_share(tp_world2):
    """Counted on each rank's local shards: the projections are rank 0's 1/2 of the convention, attention its
    heads' share (causal, with the backward's recompute: 7 (s + 1) / 6 s, as for FSDP); the lm_head is not
    sharded, so every rank computes all of it (at the answer positions). FlopCounterMode alone counts tp-ft's
    DTensor ops at their logical shape, more; tp-sp-ft's linears hold plain tensors, which it counts as they
    are."""
    counted, convention = tp_world2["flops_counted_by_component"], tp_world2["flops_convention_by_component"]
    cfg, world = tp_world2["config"], tp_world2["world_size"]
    assert counted["projections_and_adapters"] == pytest.approx(convention["projections_and_adapters"], rel=0.05)
    assert counted["attention"] == pytest.approx(convention["attention"] * CAUSAL_WITH_RECOMPUTE, rel=1e-6)
    assert counted["lm_head"] == pytest.approx(
        convention["lm_head"] * world * cfg["answer_tokens"] / cfg["max_length"], rel=1e-6
    )
    # less the work every rank repeats (the lm_head, the whole adapter halves) and the attention backward's recompute
    # of the scores: rank 0's share of the convention
    assert report.model_flops_over_convention(tp_world2) == pytest.approx(1, abs=0.01)
    if tp_world2["technique"] == "tp":
        assert tp_world2["flops_logical_with_recompute"] > 1.3 * tp_world2["flops_counted_with_recompute"]
    else:
        assert not any("unexplained" in s for s in tp_world2["stand_ins"]), tp_world2["stand_ins"]
    assert tp_world2["bf16_matmul_fraction"] >= 0.98


def test_fsdp_collectives_are_the_scripts_theory_to_the_byte(fsdp_world2):
    """FSDP2's all-gathers and reduce-scatters in the counted optimizer step (4 micro-steps), recorded as fsdp-ft
    records them, are what fsdp-ft's summary states as theory (`comm.fsdp_theory`): every unit gathered in bf16
    once per forward and the layers again per backward, the LoRA gradients reduce-scattered once in fp32."""
    recorded, theory = fsdp_world2["collective_bytes"], fsdp_world2["collective_bytes_theory"]
    assert set(recorded) == {"all_gather", "reduce_scatter"} and all(recorded.values())
    assert recorded == theory
    assert fsdp_world2["collective_counts"]["reduce_scatter"] == 2  # one per layer unit; the root has no LoRA


def test_fsdp_on_one_rank_gathers_nothing():
    """fsdp-ft on one rank: FSDP2 calls no collective (it copies each unit's shards into its unsharded parameters
    as the unit runs), so nothing waits prefetched beside the current layer; fsdp-ft's theory says no bytes, and
    the memory model holds one layer unsharded, not two (2 decoder layers, 2 of 8 micro-steps)."""
    argv = ("--technique", "fsdp", "--world", "1", "--layers", "2", "--micro-steps", "2", "--json")
    proc = run_script("-m", "ftkit.realscale", *argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["collective_bytes"] == result["collective_bytes_theory"] == {}
    assert result["categories"]["All Gather"] == 0
    unsharded, gathered = result["categories"]["Unsharded Param"], result["predicted"]["gathered"]
    assert gathered == pytest.approx(unsharded, rel=0.005), (gathered, unsharded)
    assert result["tracked_over_predicted"] == pytest.approx(1, abs=0.002), result["categories"]


def test_tp_on_one_rank_all_reduces_nothing():
    """tp-ft at TP degree 1: DTensor on a mesh of one redistributes nothing, and tp-ft's theory says so (it once
    stated the all-reduces of a TP group of two and more)."""
    argv = ("--technique", "tp", "--world", "1", "--layers", "1", "--batch-size", "4", "--json")
    proc = run_script("-m", "ftkit.realscale", *argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["collective_bytes"] == result["collective_bytes_theory"] == {}


def test_tp_collectives_are_the_scripts_theory_to_the_byte(tp_world2):
    """tp-ft's all-reduces (DTensor's, recorded as functional collectives) and tp-sp-ft's all-gathers,
    reduce-scatters and LoRA-gradient all-reduce, in the counted step at Qwen3-4B's widths, are what each script's
    summary states as theory (`comm.tp_all_reduce_theory`, `comm.tp_sp_collective_theory`, Korthikanti et al.
    2022). tp-sp-ft's clip adds the gradient norm's all-reduce: one fp32 scalar."""
    recorded, theory = tp_world2["collective_bytes"], tp_world2["collective_bytes_theory"]
    if tp_world2["technique"] == "tp":
        assert set(recorded) == {"all_reduce"} and recorded == theory
    else:
        assert set(recorded) == {"all_gather", "reduce_scatter", "all_reduce"}
        assert recorded["all_gather"] == theory["all_gather"] > 0
        assert recorded["reduce_scatter"] == theory["reduce_scatter"] > 0
        assert recorded["all_reduce"] == theory["all_reduce"] + 4


def test_cp_runs_the_scripts_chunks_and_gathers_at_the_models_peak():
    """cp-ft at world 2 (2 decoder layers, 1,024-token sequences, 2 micro-steps): rank 0 holds chunks 0 and 3, and
    so every answer position; its peak is the memory model's "cp" (the repeated K and V of the whole sequence
    included) within 0.5%; its collectives are cp-ft's `comm_theory` to the byte; its attention is the causal pairs
    of its two query chunks over the keys up to each one's end (aligned at the bottom right, as CUDA's flash kernel
    computes `causal_lower_right`), as many as rank 1's; its lm_head runs at every answer position."""
    argv = ("--technique", "cp", "--world", "2", "--layers", "2", "--max-length", "1024", "--batch-size", "2")
    proc = run_script("-m", "ftkit.realscale", *argv, "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["script"] == "experiments/cp-ft/train.py" and r["config"]["accumulation_steps"] == 2
    assert r["tracked_over_predicted"] == pytest.approx(1, abs=0.005), r["categories"]
    assert r["collective_bytes"] == r["collective_bytes_theory"] and set(r["collective_bytes"]) == {
        "all_gather",
        "reduce_scatter",
        "all_reduce",
    }
    shape, n = memory.QWEN3_4B, 1024 // 4

    def pairs(rank: int) -> int:  # rank r holds chunks r and 3 - r; chunk c's queries see keys 0 .. (c + 1) n
        return sum(flops.causal_pairs(n, (c + 1) * n, lower_right=True) for c in (rank, 3 - rank))

    assert pairs(0) == pairs(1)
    # forward 2 matmuls, backward 5 (the scores recomputed), 2 FLOPs per multiply-add; 2 layers, 2 micro-steps
    assert r["flops_counted_by_component"]["attention"] == 2 * 2 * 7 * 2 * shape.q_dim * pairs(0)
    answer = r["config"]["answer_tokens"] - 1  # the last token predicts nothing
    assert r["flops_counted_by_component"]["lm_head"] == 2 * 4 * shape.vocab * shape.hidden * answer


def test_ddp_runs_wrapped_and_all_reduces_the_lora_gradients_once():
    """ddp-ft's DDP wrapper on fake tensors (world 2, one decoder layer, one micro-step per rank): the reducer's fp32
    buckets, allocated before the tracker starts, are in the tracked peak once (the tracker registers them when the
    first backward writes them: they were also added by hand once, and counted twice); the peak within 2% of the
    memory model; one all-reduce of the trainable gradients per optimizer step, as ddp-ft's summary states."""
    proc = run_script("-m", "ftkit.realscale", "--technique", "ddp", "--quant", "none", *TP_RUN, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    buckets = result["parameters"]["trainable"] * 4
    # The peak is at the loss, whose backward's temporaries are 8 bytes per logit (2 sequences x 256 answer
    # positions x the vocabulary); beside them, the buckets and nothing else.
    logits = 2 * realscale.ANSWER_TOKENS * models.QWEN3_4B_CONFIG["vocab_size"]
    assert result["categories"]["Temp"] == 8 * logits + buckets
    # Once: the single-GPU step on one rank (the same micro-batch) holds everything else, to the byte.
    argv = ("--technique", "single", "--quant", "none", "--layers", "1", "--batch-size", "2", "--json")
    proc = run_script("-m", "ftkit.realscale", *argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["tracked_peak_bytes"] == json.loads(proc.stdout)["tracked_peak_bytes"] + buckets
    # With one micro-step no LoRA gradient is allocated yet at the peak; the model counts them (one copy over).
    assert result["categories"]["Gradient"] == 0
    assert result["tracked_over_predicted"] == pytest.approx(1, abs=0.02)
    assert result["collective_bytes"] == result["collective_bytes_theory"] == {"all_reduce": buckets}
    assert result["collective_counts"] == {"all_reduce": 1}
    assert any("init_sync=False" in s for s in result["stand_ins"])


def test_qlora_runs_on_a_4bit_base_stored_as_bitsandbytes_stores_it():
    """single-gpu-ft's QLoRA (--quant nf4) at Qwen3-4B's widths, one decoder layer: the projections are
    bitsandbytes Linear4bit layers quantized by bitsandbytes itself, two codes per byte plus their constants, the
    memory model's NF4 bytes per weight to 0.1%; the tracked peak within 1% of the model; each 4-bit matmul
    dequantizes to bf16 and is counted once (its checkpointing recompute apart), so the projections' FLOPs are the
    convention's to the FLOP and every matmul FLOP is bf16."""
    argv = ("--technique", "single", "--quant", "nf4", "--layers", "1", "--micro-steps", "2", "--json")
    proc = run_script("-m", "ftkit.realscale", *argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["config"]["quant"] == "nf4"
    quantized = result["quantized"]
    assert quantized["packed_bytes"] * 2 == quantized["linear_params"]
    assert quantized["bytes_per_param"] == pytest.approx(memory.NF4_BYTES_PER_PARAM, rel=1e-3)
    assert result["tracked_over_predicted"] == pytest.approx(1, abs=0.01), (result["categories"], result["predicted"])
    counted, convention = result["flops_counted_by_component"], result["flops_convention_by_component"]
    assert counted["projections_and_adapters"] == pytest.approx(convention["projections_and_adapters"], rel=1e-9)
    assert result["flops_counted_with_recompute"] > result["flops_counted"]
    assert result["bf16_matmul_fraction"] == 1.0
    assert any("quantize_4bit" in s for s in result["stand_ins"]), result["stand_ins"]


def test_a_bf16_base_needs_no_bitsandbytes(monkeypatch):
    """Without bitsandbytes (the lent GPU machines have none) no layer is a Linear4bit, and looking for them does
    not import it: a --quant none measurement needs no bitsandbytes."""
    import bitsandbytes as bnb

    from ftkit.realscale import nf4

    layer = bnb.nn.Linear4bit(8, 8)
    model = torch.nn.Sequential(layer, torch.nn.Linear(8, 8))
    assert nf4.linear4bit_layers(model) == [layer]
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: importing it raises
    assert nf4.linear4bit_layers(model) == []
    assert nf4.quantize_fake(torch.nn.Linear(8, 8)) == []


def test_fsdp_shards_a_4bit_base_as_bytes_and_keeps_its_constants_whole():
    """fsdp-ft --quant nf4 at world 2, two decoder layers, one micro-step per optimizer step (global batch 4): the
    projections are bitsandbytes Linear4bit layers whose packed codes (uint8, two per byte) the script's own
    shard_model shards; their quantization constants (each module's quant_state) stay whole on this rank. The
    parameter shards are the memory model's, its replicated constants taken out, to the byte; FSDP2 gathers the
    codes as bytes (0.5 B per weight, beside the bf16 norms and adapters), as fsdp-ft's theory says; the tracked peak
    is within 1% of the model (0.997)."""
    argv = ("--technique", "fsdp", "--quant", "nf4", "--world", "2", "--layers", "2", "--batch-size", "4", "--json")
    proc = run_script("-m", "ftkit.realscale", *argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["config"]["quant"] == "nf4" and result["config"]["accumulation_steps"] == 1
    quantized, predicted = result["quantized"], result["predicted"]
    assert quantized["packed_bytes"] * 2 == quantized["linear_params"]  # the whole layers', on this rank's modules
    assert quantized["bytes_per_param"] == pytest.approx(memory.NF4_BYTES_PER_PARAM, rel=1e-3)
    constants = quantized["linear_params"] * (memory.NF4_BYTES_PER_PARAM - 0.5)
    assert result["categories"]["Sharded Param"] == predicted["weights"] + predicted["lora"] - constants
    # Per micro-step: the root (the bf16 embedding and final norm) gathered once, each layer twice (forward and
    # backward): its codes, its bf16 norms and its adapters in bf16.
    shape = memory.QWEN3_4B
    layer = shape.linear_params() // 2 + 2 * shape.norm_params() + 2 * memory.lora_params(shape, 16) // shape.layers
    root = 2 * (shape.embedding_params() + shape.hidden)
    assert result["collective_bytes"] == result["collective_bytes_theory"]
    assert result["collective_bytes"]["all_gather"] == root + 2 * 2 * layer
    assert result["categories"]["All Gather"] == layer  # the next layer's, prefetched
    assert result["tracked_over_predicted"] == pytest.approx(1, abs=0.01), (result["categories"], predicted)
    assert result["bf16_matmul_fraction"] == 1.0
    assert any("shard_model shards" in s for s in result["stand_ins"]), result["stand_ins"]


def pp_run(stage: str) -> dict:
    """pp-ft's stage `stage` at world 2 through the harness, with what every stage must show: its share of the
    parameters to the byte, its layers' share of the convention (attention at 7 (s + 1) / 6 s of it, as for
    FSDP), bf16 matmuls, one [2, 2048, 2560] bf16 send per micro-batch (activations forward from the first stage,
    their gradients back from the last: pp-ft's activation bytes per micro-batch), no unexplained stand-in, and its
    count within 5% of its share of the convention at the logits the step computes."""
    proc = run_script("-m", "ftkit.realscale", *PP_RUN, "--pp-stage", stage, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["categories"]["Parameter"] == result["predicted"]["weights"] + result["predicted"]["lora"]
    counted, convention = result["flops_counted_by_component"], result["flops_convention_by_component"]
    assert counted["projections_and_adapters"] == pytest.approx(convention["projections_and_adapters"], rel=0.05)
    assert counted["attention"] == pytest.approx(convention["attention"] * CAUSAL_WITH_RECOMPUTE, rel=1e-6)
    # The stage's share of the convention with the lm_head where the step computes logits (the last stage's).
    assert result["flops_counted_over_convention_at_logits"] == pytest.approx(1, abs=0.05)
    assert result["bf16_matmul_fraction"] >= 0.98
    sends = 2 * 2 * 2048 * 2560 * 2  # two micro-batches' [2, 2048, 2560] bf16 tensors
    assert result["collective_bytes"] == result["collective_bytes_theory"] == {"send": sends}
    assert result["collective_counts"] == {"send": 2}
    assert not any("unexplained" in s for s in result["stand_ins"]), result["stand_ins"]
    return result


def test_pp_stage_0_runs_the_scripts_1f1b_schedule():
    """pp-ft's stage 0 at world 2 (the embedding and one of two decoder layers), its own Stage, PipelineStage and
    1F1B schedule over a global batch of 4: two micro-batches of 2 x 2048, both in flight on stage 0 (min(m, p)).
    The tracked peak is the memory model's stage 0 to within 1% (the residual: RoPE's cos and sin of the second
    micro-batch in flight, 1 MiB, which the model counts once); a stage that kept its sent outputs until their
    backward, as torch does for a FakeTensor, would add one [2, 2048, 2560] tensor per micro-batch (2% here).
    Rank 0 runs half the layers and no lm_head: its share of the convention, counted as for FSDP (attention at
    7 (s + 1) / 6 s of the convention); it sends each micro-batch's output once, pp-ft's activation bytes per
    micro-batch."""
    result = pp_run("first")
    cfg = result["config"]
    assert result["script"] == "experiments/pp-ft/train.py" and cfg["schedule"] == "1f1b" and cfg["stage"] == 0
    assert cfg["pipeline_microbatches"] == 2 and cfg["grad_checkpointing"]
    assert result["predicted_bytes"] == result["predicted_bytes_by_stage"]["first"]
    assert result["tracked_over_predicted"] == pytest.approx(1, abs=0.01), (result["categories"], result["predicted"])
    counted, convention = result["flops_counted_by_component"], result["flops_convention_by_component"]
    assert "lm_head" not in counted and convention["lm_head"] == 0
    stand_ins = result["stand_ins"]
    assert any("input_args, output_args" in s for s in stand_ins), stand_ins
    assert any("released as torch releases a plain tensor's" in s for s in stand_ins), stand_ins


def test_pp_last_stage_runs_the_scripts_1f1b_schedule_and_loss():
    """pp-ft's last stage at world 2, rank 1: one decoder layer, the final norm, the lm_head (the tied embedding)
    and pp-ft's loss on the answer positions, under 1F1B (one micro-batch in flight). The memory model is a floor
    within 1.5%: it counts the stage output of the micro-batch in flight (pp-ft asks for no merged output, which
    would keep every micro-batch's: 1.020 if the step kept it), the first micro-batch's received activation
    (torch's schedule keeps each loss with its graph to the step's end, and the graph holds it) and no bf16 logits
    (pp-ft's loss frees them); the peak is in the layer's backward, where one [2, 2048, 2560] bf16 tensor more is
    held, not yet identified (1.010 measured; see devlogs/runs/realscale/README.md). The lm_head runs on the answer
    positions only: 256/2048 of the convention's."""
    result = pp_run("last")
    cfg = result["config"]
    assert result["rank"] == 1 and cfg["stage"] == 1 and cfg["schedule"] == "1f1b"
    assert result["predicted_bytes"] == result["predicted_bytes_by_stage"]["last"]
    assert 1.0 <= result["tracked_over_predicted"] <= 1.015, (result["categories"], result["predicted"])
    counted, convention = result["flops_counted_by_component"], result["flops_convention_by_component"]
    assert counted["lm_head"] == pytest.approx(
        convention["lm_head"] * cfg["answer_tokens"] / cfg["max_length"], rel=1e-6
    )
    stand_ins = result["stand_ins"]
    assert any("pp-ft's loss_fn" in s for s in stand_ins), stand_ins
    assert any("the activations the last stage receives" in s and "requiring grad" in s for s in stand_ins), stand_ins


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--technique", "tp-sp", "--world", "4", "--quant", "nf4"], "tp-sp-ft/train.py trains LoRA on a bf16 base"),
        (["--technique", "tp", "--world", "3"], "does not divide the model's 8 key/value heads"),
        (["--technique", "tp", "--world", "2", "--quant", "nf4"], "trains LoRA on a bf16 base"),
        (["--technique", "pp", "--world", "2", "--schedule", "zbv"], "the memory model predicts gpipe and 1f1b only"),
        (["--technique", "pp", "--world", "1"], "a pipeline needs at least 2 ranks"),
        (["--technique", "pp", "--world", "2", "--layers", "3"], "do not divide the model's 3 layers evenly"),
        (["--technique", "fsdp", "--world", "2", "--pp-stage", "last"], "--pp-stage are pipeline flags"),
        (["--technique", "single", "--world", "2"], "single runs on one device"),
        (["--technique", "cp", "--world", "2", "--quant", "nf4"], "cp-ft/train.py trains LoRA on a bf16 base"),
        (["--technique", "cp", "--world", "3", "--max-length", "4096"], "pass --max-length 4098"),
    ],
)
def test_refusals_say_why(argv, message, capsys):
    assert command.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("world, per_token", [(2, "20,497"), (4, "23,057")])
def test_tp_sp_holds_more_than_the_model_at_long_sequences_as_the_devlog_says(world, per_token):
    """At 2 x 8,192 tokens with checkpointing, tp-sp-ft's first layer's backward holds contiguous full-sequence
    copies the memory model does not count (devlogs/runs/realscale/README.md, quoted by the CP and TP+SP posts):
    the tracked peak less the predicted, per token, is the figure the devlog states."""
    argv = ("--technique", "tp-sp", "--world", str(world), "--layers", "1", "--batch-size", "4")
    proc = run_script("-m", "ftkit.realscale", *argv, "--max-length", "8192", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    excess = (result["tracked_peak_bytes"] - result["predicted_bytes"]) / (2 * 8192)
    assert f"{excess:,.0f}" == per_token
    devlog = " ".join((ROOT / "devlogs" / "runs" / "realscale" / "README.md").read_text().split())
    assert "20,497 / 23,057 / 19,657 B at world 2 / 4 / 8 for tp-sp" in devlog
