"""One optimizer step's time on rank 0: its micro-batches' GPU and host time through the queue (the host running
ahead of the GPU), plus the communication the technique cannot hide (ring collectives, alpha-beta) and the pipeline's
bubble."""

from __future__ import annotations

from ftkit import comm, hardware, metrics
from ftkit.lora import ROW_PARALLEL
from ftkit.memory import NF4_BYTES_PER_PARAM, NF4_PACKED_BYTES, ModelShape, lora_params
from ftkit.plan.hosts import (
    H100_OPS_PER_STEP,
    HOST_OPS_PER_STEP,
    NF4_PASS_S,
    PROFILE_RESIDUAL_PER_STEP,
    host_calibration,
    host_ops_per_micro,
    ops_source,
)
from ftkit.plan.layouts import Micro, Step
from ftkit.plan.settings import Setting

BF16, FP32 = 2, 4


def queue(host: list[float], gpu: list[float], host_after: float = 0.0) -> float:
    """Seconds from the first op to the step's end, the host running ahead of the GPU: micro-batch i's kernels run
    once the GPU is free and cannot end before the host has issued them (its ops interleave with its kernels), and
    the step ends when the GPU is done and the host has issued the step's own ops (`host_after`). With a host of cost
    0 this is the GPU's time; with a slow one, the host's."""
    host_t = gpu_t = 0.0
    for h, g in zip(host, gpu):
        host_t += h
        gpu_t = max(gpu_t + g, host_t)
    return max(gpu_t, host_t + host_after)


def collective_s(kind: str, size: float, n: int, link: hardware.Link, efficiency: float) -> float:
    """Seconds for one ring collective on a `size`-byte buffer over n GPUs: wire bytes at the achievable
    bandwidth, plus one latency per ring step (2(n-1) for an all-reduce, n-1 for either half)."""
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return comm.ring_wire_bytes(kind, size, n) / (link.bytes_per_s * efficiency) + steps * link.latency_s


def micro_flops(s: Setting, m: Micro) -> float:
    """FLOPs the kernels compute for one micro-batch: the MFU convention's (`metrics.step_flops`) over every position
    of its rows, padding included (attention over each row's whole width), the lm_head at its answer positions (at
    every position with the "full" layout, as the planner counted before issue 30), and the layers' forward again
    where checkpointing recomputes it (the fraction of the layers it checkpoints: `Setting.recomputed`)."""
    shape, cfg = s.shape, s.config
    n_lora = lora_params(shape, s.lora_rank)
    flops = metrics.step_flops([m.width] * m.rows, cfg, n_lora, None if s.layout == "full" else m.answers)
    d = shape.heads * shape.head_dim
    # Attention's positions squared: each row's width, or with a token budget each example's (the varlen kernel
    # attends within an example; a row of 16,384 positions counted whole would be 8x the attention of its examples).
    squares = sum(n * n for n in m.segments) if m.segments else m.rows * m.width**2
    flops += 6 * shape.layers * d * (squares - m.rows * m.width**2)
    if s.recomputed:  # the layers' forward again: 2 FLOPs per layer weight and adapter weight, attention
        layer_matmul = metrics.matmul_params(cfg) - shape.vocab * shape.hidden
        again = m.rows * m.width * (2 * layer_matmul + 2 * n_lora) + 2 * shape.layers * d * squares
        flops += s.recomputed * again  # of the checkpointed layers only
    return flops


def gpu_times(s: Setting, quant: str, step: Step, tp: int, pp: int, passes: int, cp: int = 1) -> list[float]:
    """Each micro-batch's GPU time on this rank: the FLOPs its kernels compute split over TP, PP and CP (cp-ft's
    chunks give every rank as much causal attention), at mfu of the dense bf16 peak, and NF4's dequantization of
    every layer's weights on every pass, at the HBM's datasheet bandwidth."""
    shape = s.shape
    mfu = host_calibration(s)[1]
    gpu = []
    for m in step.micros:
        g = micro_flops(s, m) / (tp * pp * cp * s.gpu.bf16_flops * mfu)
        if quant == "nf4":
            weights = shape.layers * shape.linear_params() / tp / pp
            g += passes * weights * (NF4_BYTES_PER_PARAM + BF16) / s.gpu.hbm_bytes_per_s
        gpu.append(g)
    return gpu


def host_costs(s: Setting, quant: str, layers: int, passes: int) -> tuple[int, float, int]:
    """The host, on a rank that holds `layers`: (ops per micro-batch, seconds per micro-batch, the step's own ops).
    Ops per micro-batch (of the layers this rank holds) x seconds per op, plus bitsandbytes' calls."""
    op_s = host_calibration(s)[0]
    ops = host_ops_per_micro(s, quant, layers) if op_s else 0
    host_micro = ops * op_s
    if quant == "nf4" and op_s:
        host_micro += NF4_PASS_S * passes * 7 * layers
    if not op_s:
        step_ops = 0
    elif ops_source(s) == "tree":
        step_ops = HOST_OPS_PER_STEP[0] + HOST_OPS_PER_STEP[1] * layers + PROFILE_RESIDUAL_PER_STEP
    else:
        step_ops = H100_OPS_PER_STEP[ops_source(s)]
    return ops, host_micro, step_ops


def fsdp_gather_bytes(shape: ModelShape, rank: int, quant: str, tp: int = 1) -> float:
    """What FSDP all-gathers per micro-batch (whole buffers): every layer twice, in forward and again in backward
    (resharded after forward), the root unit (the embedding and the final norm) once. A layer is its projections
    (bf16, or as 4-bit packed codes, 0.5 B per weight: their constants are resident on every rank), its norms and
    its LoRA adapters, gathered in bf16 (`--param-dtype`); under TP, one rank's share of each."""
    linear_bytes = NF4_PACKED_BYTES if quant == "nf4" else BF16
    adapters = lora_params(shape, rank, tp=tp) / shape.layers
    layer_bytes = shape.linear_params() / tp * linear_bytes + (shape.norm_params() + adapters) * BF16
    return 2 * shape.layers * layer_bytes + (shape.embedding_params() + shape.hidden) * BF16


def adapter_grad_bytes(shape: ModelShape, rank: int, tp: int = 1) -> int:
    """One rank's fp32 LoRA gradients, what FSDP reduce-scatters each step: under TP one half of each projection's
    adapter is split and the other whole on every rank (`memory.lora_params`), so not the whole adapter / tp."""
    return FP32 * lora_params(shape, rank, tp=tp)


def exposed_comm(
    s: Setting, technique: str, mesh: dict[str, int], quant: str, step: Step, busy: float
) -> tuple[float, float]:
    """What the technique cannot hide, in a step whose micro-batches keep the GPU `busy` seconds: (the exposed
    communication, the pipeline's bubble)."""
    shape = s.shape
    dp, tp, pp, cp = mesh.get("dp", 1), mesh.get("tp", 1), mesh.get("pp", 1), mesh.get("cp", 1)
    n_lora = lora_params(shape, s.lora_rank)
    accum = len(step.micros)
    micro = busy / accum  # one micro-batch's share, the window the overlapped collectives have
    # TP's and CP's groups are the innermost mesh dimension (neighbouring ranks): inside one node while they fit in
    # one; any other group spans the GPUs used.
    spans_nodes = dp * tp * pp * cp > s.per_node
    tp_inside, cp_inside = tp <= s.per_node, cp <= s.per_node

    # A group across nodes runs its ring through each node's GPUs and between the nodes: the slower of the two
    # links bounds it (PCIe inside a node can be slower than InfiniBand between them).
    across = min((s.link, s.inter_node_link), key=lambda link: link.bytes_per_s)

    def coll(kind: str, size: float, n: int, inside_node: bool = False) -> float:
        link = across if spans_nodes and not inside_node else s.link
        return collective_s(kind, size, n, link, s.link_efficiency)

    activations = [m.rows * m.width * shape.hidden * BF16 for m in step.micros]
    exposed = bubble = 0.0
    if technique == "ddp":
        exposed = max(0.0, coll("all_reduce", FP32 * n_lora, dp) - micro / 2)
    if technique in ("fsdp", "fsdp-tp"):
        gathers = coll("all_gather", fsdp_gather_bytes(shape, s.lora_rank, quant, tp), dp)
        exposed = accum * (max(0.0, gathers - micro) + gathers / (2 * shape.layers))
        exposed += max(0.0, coll("reduce_scatter", adapter_grad_bytes(shape, s.lora_rank, tp), dp) - micro / 2)
    if technique in ("tp", "fsdp-tp"):
        per_layer = 7 + 2 * s.recomputed  # a checkpointed layer's two forward all-reduces again
        exposed += sum(shape.layers * per_layer * coll("all_reduce", a, tp, tp_inside) for a in activations)
    if technique == "tp-sp":
        per_layer = 4 + 1.5 * s.recomputed  # in pairs: a checkpointed layer's recompute adds three halves
        replicated = (
            shape.layers
            * s.lora_rank
            * sum(n_out if name in ROW_PARALLEL else n_in for name, (n_in, n_out) in shape.linears().items())
        )
        exposed = sum(
            shape.layers * per_layer * (coll("all_gather", a, tp, tp_inside) + coll("reduce_scatter", a, tp, tp_inside))
            for a in activations
        )
        exposed += coll("all_reduce", FP32 * replicated, tp, tp_inside)
    if technique == "cp":
        # cp-ft: per layer and micro-batch, K and V all-gathered (in forward, and again in checkpointing's recompute)
        # and their gradients reduce-scattered, each [rows, width, kv heads x head_dim] bf16 whole, on the critical
        # path (the script does not overlap them), inside a node where the group fits in one; then the LoRA
        # gradients' one all-reduce over every rank, after backward.
        gathers = 1 + s.recomputed
        kv = [m.rows * m.width * shape.kv_dim * BF16 for m in step.micros]
        exposed = sum(
            2
            * shape.layers
            * (gathers * coll("all_gather", b, cp, cp_inside) + coll("reduce_scatter", b, cp, cp_inside))
            for b in kv
        )
        exposed += coll("all_reduce", FP32 * n_lora, dp * cp)
    if technique == "pp":
        bubble = (pp - 1) / accum * busy
        hop = across if spans_nodes else s.link
        exposed = 2 * (pp - 1) * (activations[0] / (hop.bytes_per_s * s.link_efficiency) + hop.latency_s)
    return exposed, bubble


def step_time(s: Setting, technique: str, mesh: dict[str, int], quant: str, step: Step) -> dict:
    """One optimizer step on rank 0: its micro-batches' GPU and host time through the queue, plus the communication
    the technique cannot hide and the pipeline's bubble."""
    dp, tp, pp, cp = mesh.get("dp", 1), mesh.get("tp", 1), mesh.get("pp", 1), mesh.get("cp", 1)
    op_s = host_calibration(s)[0]
    passes = 2 + s.recomputed  # forward, backward, and the checkpointed layers' recompute
    gpu = gpu_times(s, quant, step, tp, pp, passes, cp)
    compute = sum(gpu)
    ops, host_micro, step_ops = host_costs(s, quant, s.shape.layers // pp, passes)
    busy = queue([host_micro] * len(gpu), gpu, step_ops * op_s)  # == compute when the host costs nothing
    accum = len(gpu)
    exposed, bubble = exposed_comm(s, technique, mesh, quant, step, busy)
    step_s = busy + exposed + bubble
    return {
        "micros": step.micros,
        "tokens": step.tokens,
        "positions": step.positions,
        "compute_s": compute,
        "host_s": host_micro * accum + step_ops * op_s,
        "host_ops_per_micro_batch": ops,
        "host_ops": (ops * accum + step_ops) * dp * tp * pp * cp,  # every rank's, this step
        "gpu_side_s": compute + exposed + bubble,
        "exposed_comm_s": exposed,
        "bubble_s": bubble,
        "step_time_s": step_s,
    }
