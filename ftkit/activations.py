"""Activation memory: the bytes one decoder layer of a Qwen3-style decoder saves for backward, derived op by op
(`layer_activation_bytes`), and what that is on one rank under tensor and sequence parallelism
(`layer_saved_bytes`). The memory model (`ftkit/memory.py`) counts them for every layer a rank holds;
tests/test_memory.py checks the derivation against the tensors autograd actually saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ftkit.lora import LORA_TARGETS, ROW_PARALLEL

if TYPE_CHECKING:
    from ftkit.memory import ModelShape

FP32 = 4
# The tensor each projection reads: q/k/v read the attention norm's output, o_proj the SDPA output, ...
LINEAR_INPUT = {
    "q_proj": "attn_norm_out",
    "k_proj": "attn_norm_out",
    "v_proj": "attn_norm_out",
    "o_proj": "sdpa_out",
    "gate_proj": "mlp_norm_out",
    "up_proj": "mlp_norm_out",
    "down_proj": "swiglu_out",
}


def layer_activation_bytes(
    shape: ModelShape,
    *,
    act_bytes: int,
    lora_targets: Sequence[str] = LORA_TARGETS,
    lora_rank: int = 16,
    lora_dropout: float = 0.0,
    full_finetune: bool = False,
    fp32_adapter_compute: bool = False,
) -> tuple[float, float]:
    """Bytes one decoder layer saves for backward, per token, as (hidden_part, sharded_part).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
    2205.05198, Sec. 4.1) count s*b*h*(34 + 5*a*s/h) bytes per GPT layer in 16-bit with 1-byte dropout
    masks: 11sbh for attention + 5as^2b for its score/softmax/dropout matrices, 19sbh for the 4h GELU MLP,
    4sbh for two LayerNorms. A Qwen3 layer trained with LoRA on a frozen base differs, op by op (per token;
    h hidden, q = heads*head_dim, kv = kv_heads*head_dim, i intermediate, a = activation dtype bytes):

    - RMSNorm computes in fp32: `x.float().pow(2)` and `x * rsqrt(...)` save the fp32 input (a copy when the
      stream is bf16) and the fp32 1/rms: 4(h + 1) for each of the two norms, 4(q + heads) + 4(kv + kv_heads)
      for q_norm/k_norm. Frozen norm weights need nothing else.
    - SDPA with a fused kernel (flash / memory-efficient) saves q, k, v, the output and an fp32 logsumexp per
      head, never the s x s matrix: the 5as/h term is gone. a(2q + 2kv) + 4*heads. (GQA stays GQA only
      without a padding mask; with one, transformers repeats k, v to all heads first.)
    - SwiGLU: silu saves gate; silu(gate) * up saves both factors: 3ai. No dropout in Qwen3.
    - Frozen base linears save no input (only the weight-gradient needs it). LoRA's A does. The adapters compute
      in the stream dtype (`lora.adapters_compute_in`: autocast, PEFT's fp32 input cast off), so without
      dropout A saves the stream tensor the base reads, one tensor shared by the adapters that read it (q/k/v,
      gate/up; o_proj's input is the SDPA output, saved already). LoRA dropout > 0 gives each adapter its own
      dropout output (a bytes) plus a 1-byte mask. B saves A's output: a*r per adapter.
    - full_finetune: every linear saves its input in the stream dtype (q/k/v share one, gate/up another,
      o_proj's is the SDPA output) and each trainable norm weight saves its normalised input.

    The hidden part (width h: the norms and the q/k/v/gate/up inputs) is replicated under tensor parallelism
    without SP (Korthikanti's 10sbh); the rest is split across TP ranks by heads and intermediate columns.

    fp32_adapter_compute: the adapters as PEFT computes them by default, before `lora.adapters_compute_in`
    (kept for runs measured that way): PEFT casts each adapter's input to the fp32 adapter dtype, a private 4-byte
    copy per adapter on a bf16 stream (one shared tensor on an fp32 stream), its dropout output fp32 too, and B
    saves A's fp32 output, 4r per adapter.

    Not per token, so not here: the bf16 copies autocast makes of a layer's fp32 adapter weights, which the
    LoRA matmuls save too (`predict` adds them, a*r*(in + out) per adapter).

    For Qwen3-4B with adapters on all seven projections, r = 16, no dropout, the sum is 150,024 B per token
    per layer on a bf16 stream (58.6h, against GPT's 34h: the 3.8h-wide SwiGLU and the fp32 copies that
    RMSNorm makes), 200,200 B with dropout 0.05, and 258,792 B on an fp32 stream. tests/test_memory.py checks
    the derivation against the tensors autograd actually saves.
    """
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    a = act_bytes
    lora_a = FP32 if fp32_adapter_compute else a  # the dtype the adapters compute in
    hidden_part = 2 * FP32 * (h + 1)  # input_layernorm, post_attention_layernorm
    sharded = FP32 * (q + shape.heads + kv + shape.kv_heads)  # q_norm, k_norm
    sharded += a * (2 * q + 2 * kv) + FP32 * shape.heads  # SDPA
    sharded += 3 * a * i  # SwiGLU
    if full_finetune:
        hidden_part += 2 * a * h  # the normalised inputs of the two norm weights
        sharded += a * (q + kv)  # and of q_norm / k_norm
    else:
        hidden_part += lora_a * lora_rank * len(lora_targets)  # A's outputs, saved by B

    inputs: dict[str, tuple[float, bool]] = {}  # storage -> (bytes, replicated under TP)
    for name in LORA_TARGETS if full_finetune else lora_targets:
        n_in = shape.linears()[name][0]
        if full_finetune or (lora_dropout == 0 and lora_a == a):
            storage, nbytes = LINEAR_INPUT[name], a * n_in  # linears reading one tensor share it
        elif lora_dropout == 0:
            storage, nbytes = name, FP32 * n_in  # PEFT's own fp32 cast of a bf16 input, per adapter
        else:
            storage, nbytes = name, (lora_a + 1) * n_in  # the adapter's own dropout output + bool mask
        inputs[storage] = (nbytes, name not in ROW_PARALLEL)
    inputs.pop("sdpa_out", None)  # saved by SDPA already
    hidden_part += sum(nbytes for nbytes, replicated in inputs.values() if replicated)
    sharded += sum(nbytes for nbytes, replicated in inputs.values() if not replicated)
    return hidden_part, sharded


def layer_saved_bytes(
    shape: ModelShape, tokens: int, *, tp: int = 1, sequence_parallel: bool = False, **layer: Any
) -> float:
    """Bytes one decoder layer saves for backward on one rank, for `tokens` tokens of the whole sequence:
    `layer_activation_bytes` (its keyword arguments in `layer`), the sharded part split by tp. Sequence parallelism
    runs the norms on this rank's tokens, so their saved inputs are split by tp too; each block's LoRA A then saves
    the all-gathered input it reads, whole on every rank, as tp-sp-ft's linears do. (Megatron-LM saves a column
    linear's local shard instead and all-gathers it again in backward, Korthikanti et al. 2022, Sec. 4.2.2, which
    would split the whole hidden part.)"""
    hidden_part, sharded_part = layer_activation_bytes(shape, **layer)
    norms = 2 * FP32 * (shape.hidden + 1)  # input_layernorm, post_attention_layernorm: fp32 input and 1/rms
    if layer.get("full_finetune"):
        norms += 2 * layer["act_bytes"] * shape.hidden  # and the normalised inputs their trainable weights save
    sp = tp if sequence_parallel else 1
    return tokens * (norms / sp + hidden_part - norms + sharded_part / tp)
