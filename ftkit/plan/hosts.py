"""The host's cost per micro-batch (issue 30): the ops it dispatches, counted, times a cost per op calibrated on the
committed H100 runs (h100-vm) or H200 runs (h200-vm, issue 43); and the GPU kernels' fraction of the dense bf16 peak,
calibrated on the H100 profile."""

from __future__ import annotations

from ftkit.plan.settings import Setting

# Issue 30: on an H100 the eager step was bound by its host, not its GPU (devlogs/single-gpu-ft.md, "Second GPU
# session"). The host term is the ops it dispatches per micro-batch (counted) times a cost per op (calibrated on the
# committed H100 profile); the GPU term the FLOPs the kernels compute at a fraction of the peak (calibrated on the
# same profile). tests/test_plan.py re-derives every constant below from the committed files it names.
#
# Ops per micro-batch, counted by assets/host_ops.py (devlogs/runs/plan-host/host-ops.json): the aten ops that
# single-gpu-ft's step dispatches as CUDA dispatches them (eager; checked op by op against the H100 profiles'
# counts), or, with the decoder layers compiled, the compiled graphs' kernels and extern ops plus the eager ops
# around them (inductor's C++ kernels on a CPU standing in for its Triton ones on CUDA: a prediction). Counted at 2
# and 3 decoder layers: (ops outside the layers, ops per layer) for (layout, quant, grad_checkpointing, compiled);
# `host_ops_per_micro` interpolates --checkpointing every-K between the checkpointed and plain rows.
# "padded" is this code's padded call (no mask: the rows are right-padded and attention causal), "packed" its packed
# call (position_ids, no mask); full-length rows dispatch what "padded" does.
HOST_OPS: dict[tuple[str, str, bool, bool], tuple[int, int]] = {
    ("padded", "none", True, False): (191, 1430),
    ("padded", "none", False, False): (113, 1002),
    ("padded", "nf4", True, False): (191, 1542),
    ("padded", "nf4", False, False): (110, 1058),
    ("packed", "none", True, False): (280, 1498),
    ("packed", "none", False, False): (202, 1045),
    ("packed", "nf4", True, False): (280, 1610),
    ("packed", "nf4", False, False): (199, 1101),
    ("packed", "none", True, True): (280, 166),  # compiled: a prediction
    ("packed", "nf4", True, True): (280, 180),  # compiled: a prediction
}
# ... and per optimizer step (gradient clipping, AdamW's foreach step, zero_grad), of which some ops are per adapter
# weight: (ops, ops per layer), with PROFILE_RESIDUAL_PER_STEP added.
HOST_OPS_PER_STEP = (24, 98)
# The code the committed H100 runs ran, 36 layers, counted the same way: the first session's (commit 3564941, the
# adapters computing in fp32) and the second's (commit 3d2ae74, in bf16), both passing the padding mask; per
# micro-batch by quant, and per step. The per-step count adds what the profiles show beyond the CPU's count of the ops
# they list, 512 add_ and 161 copy_ (AdamW's step counters live on the host, where foreach runs per tensor).
PROFILE_RESIDUAL_PER_STEP = 512 + 161
H100_OPS_PER_MICRO = {
    ("h100-session1", "none"): 53484,
    ("h100-session1", "nf4"): 56508,
    ("h100-session2", "none"): 54096,
    ("h100-session2", "nf4"): 58128,
}
H100_OPS_PER_STEP = {
    "h100-session1": 3552 + PROFILE_RESIDUAL_PER_STEP,
    "h100-session2": 3552 + PROFILE_RESIDUAL_PER_STEP,
}
# The calibration, from the committed H100 files (tests/test_plan.py reads each number back from them):
# - seconds per op: step 2 of gpu-4b-shape-lora-bf16 (8 micro-batches of 2 rows, 28,298 real tokens, 28,584 positions
#   computed, widest 2,004), unprofiled (its metrics.jsonl), over the ops it dispatched (8 micro-batches and the
#   step's own, second session's code): the step was host-bound (the profile of the same batch has the GPU computing
#   3.386 s of it, `Self CUDA time total`), so its time is the host's;
# - the kernels' fraction of the dense bf16 peak while the GPU computes: the FLOPs that step's kernels computed
#   (`micro_flops` over its 8 micro-batches at their padded widths; the test recounts them) over the profile's Self
#   CUDA time total x the H100's 989 TFLOP/s;
# - NF4_PASS_S, what a 4-bit linear pass costs beyond its counted aten ops: bitsandbytes' matmuls dispatch their
#   dequantization as custom ops (2 per forward matmul and 1 per backward one), Python kernels calling CUDA through
#   ctypes, which the aten count leaves out. The first session's QLoRA and LoRA runs (the same batches,
#   gpu-4b-shape-*-fp32-adapters, median step time over steps 2-10, both host-bound) differ by more than the ops
#   counted for that code explain: the rest, per 4-bit linear pass (7 projections x 36 layers x 3 passes: forward,
#   recompute, backward, x 8 micro-batches), is NF4_PASS_S. Not attributed (no QLoRA profile is committed); the
#   second session's QLoRA run checks it.
H100_STEP2 = dict(run="gpu-4b-shape-lora-bf16", step=2, seconds=5.768654296875, gpu_busy_s=3.386, micro_batches=8)
H100_STEP2_FLOPS = 694431274500096.0
H100_PEAK_FLOPS = 989e12
H100_SESSION1_MEDIANS = {
    "gpu-4b-shape-lora-bf16-fp32-adapters": 6.1237900390625,
    "gpu-4b-shape-qlora-nf4-fp32-adapters": 7.60574658203125,
}
_STEP2_OPS = (
    H100_STEP2["micro_batches"] * H100_OPS_PER_MICRO["h100-session2", "none"] + H100_OPS_PER_STEP["h100-session2"]
)
_H100_OP_S = H100_STEP2["seconds"] / _STEP2_OPS
_SESSION1_EXTRA_OPS = 8 * (H100_OPS_PER_MICRO["h100-session1", "nf4"] - H100_OPS_PER_MICRO["h100-session1", "none"])
NF4_PASS_S = (
    H100_SESSION1_MEDIANS["gpu-4b-shape-qlora-nf4-fp32-adapters"]
    - H100_SESSION1_MEDIANS["gpu-4b-shape-lora-bf16-fp32-adapters"]
    - _SESSION1_EXTRA_OPS * _H100_OP_S
) / (8 * 7 * 36 * 3)
# The second host (issue 43): the committed H200 runs' (devlogs/runs/gpu-session-2026-11-26-gpu, b1-lora-h200-2:
# bf16 LoRA, single-gpu-ft, eager, 6 steps, torch 2.11, transformers 5.23 as the lock's). They ran 953b11d (and its
# model-building fixes), whose step passes no padding mask (`git show 953b11d:experiments/single-gpu-ft/train.py`:
# input_ids, position_ids where packed, logits_to_keep): this tree's step, so this tree's counts (HOST_OPS, the
# padded checkpointed row at 36 layers: 191 + 36 x 1,430 = 51,671 per micro-batch; per step HOST_OPS_PER_STEP at 36
# layers with PROFILE_RESIDUAL_PER_STEP, 4,225).
# - seconds per op: the padded run (`--no-packing`: 8 micro-batches of 2 rows every step, 417,593 ops a step), its
#   two steps of fewest tokens (4 and 6: 13,112 and 13,143 real tokens, the GPU busy about 1.5 s of their 4 at the
#   H100's kernel fraction, so host-bound with the widest margin; the steps of 28-33 k tokens took 4.5 s, more than
#   the host's 3.9), their mean step time over those ops: 9.44 us, against the H100 host's 13.2. The packed run
#   (`--no-compile`), not used for it, checks it (tests/test_plan.py);
# - the kernels' fraction of the dense bf16 peak: no H200 profile is committed, so the H100 profile's (above; the
#   H200's dense bf16 peak is the H100's, 989 TFLOP/s): an assumption, not a measurement.
H200_RUN = "gpu-session-2026-11-26-gpu/b1-lora-h200-2/lora-padded-eager"
H200_HOST_STEPS = {4: 4.084021240234375, 6: 3.79883251953125}  # step: step_time_s, its metrics.jsonl
_H200_STEP_OPS = (
    8 * (HOST_OPS["padded", "none", True, False][0] + 36 * HOST_OPS["padded", "none", True, False][1])
    + HOST_OPS_PER_STEP[0]
    + 36 * HOST_OPS_PER_STEP[1]
    + PROFILE_RESIDUAL_PER_STEP
)
_H100_KERNEL_MFU = H100_STEP2_FLOPS / (H100_STEP2["gpu_busy_s"] * H100_PEAK_FLOPS)
HOSTS = {
    "h100-vm": dict(
        op_s=_H100_OP_S,
        kernel_mfu=_H100_KERNEL_MFU,
        kernels="calibrated on the same profile, eager kernels",
        source="the committed H100 runs' host (a Firecracker VM, 16 cores of an unnamed Intel Xeon; torch 2.11): "
        "devlogs/runs/single-gpu-ft-gpu/profile-lora-bf16-step2-ops.txt, devlogs/runs/single-gpu-ft/"
        "gpu-4b-shape-lora-bf16/metrics.jsonl (step 2)",
    ),
    "h200-vm": dict(
        op_s=sum(H200_HOST_STEPS.values()) / len(H200_HOST_STEPS) / _H200_STEP_OPS,
        kernel_mfu=_H100_KERNEL_MFU,  # no H200 profile: the H100's, assumed
        kernels="the H100 profile's eager kernels, assumed: no H200 profile is committed",
        source="the committed H200 runs' host (a Firecracker VM, 16 cores of an unnamed Intel Xeon; torch 2.11): "
        f"devlogs/runs/{H200_RUN}/metrics.jsonl (steps 4 and 6); kernels: the H100 profile's fraction, assumed",
    ),
}


def ops_source(s: Setting) -> str:
    """Whose op counts price the host: s.ops_source, and for the "masked" layout the H100 runs' code (the second
    session's) where it is "tree" (this code no longer passes the mask)."""
    return "h100-session2" if s.layout == "masked" and s.ops_source == "tree" else s.ops_source


def host_ops_per_micro(s: Setting, quant: str, layers: int) -> int:
    """Ops the host dispatches (eager) or launches (compiled) per micro-batch, on a rank that holds `layers`."""
    source = ops_source(s)
    if source != "tree":
        if s.compile or s.layout not in ("masked", "full") or layers != 36:
            raise ValueError(f"{source}'s op count is of its eager 36-layer step with the padding mask, on one rank")
        return H100_OPS_PER_MICRO[(source, quant)]
    layout = "packed" if s.compile or s.layout == "packed" else "padded"  # full-length rows: padded's path
    base, checkpointed = HOST_OPS[layout, quant, True, False]
    plain_base, plain = HOST_OPS[layout, quant, False, False]
    if s.compile:
        # Compiled without checkpointing is not counted: a prediction. Outside the layers nothing is compiled, so the
        # eager base of the layout (the compiled row's base is the eager checkpointed one's). In the layers, no
        # checkpoint machinery and no recompute forward graph call: the compiled per-layer count scaled as the eager
        # one drops them (a LoRA layer's backward dispatches more matmuls than its forward, so the forward is about
        # 30% of a checkpointed layer's ops, not a third; the same share of its kernels and extern ops compiled).
        plain *= HOST_OPS[layout, quant, True, True][1] / checkpointed
        base, checkpointed = HOST_OPS[layout, quant, True, True]
    # --checkpointing every-K: the checkpointed fraction of the layers at the checkpointed count, the rest at the
    # plain one; ops outside the layers as with checkpointing wherever a layer is (layer 0 is then among them).
    per_layer = plain + s.recomputed * (checkpointed - plain)
    return round((base if s.recomputed else plain_base) + per_layer * layers)


ASSUMED_MFU = 0.4  # without a calibrated host: well-tuned dense training (PaLM reports 46.2%)


def host_calibration(s: Setting) -> tuple[float, float]:
    """(seconds per host op, the kernels' fraction of the dense bf16 peak while the GPU computes): --host's
    calibration, with --host-op-us and --mfu over it; without --host, no host cost and ASSUMED_MFU."""
    host = HOSTS[s.host] if s.host else {"op_s": 0.0, "kernel_mfu": ASSUMED_MFU}
    return (host["op_s"] if s.host_op_s is None else s.host_op_s), (host["kernel_mfu"] if s.mfu is None else s.mfu)
