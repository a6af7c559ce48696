"""What stands in for a run on the GPU, and the text that says so (`stand_ins` in the output): CUDA's behaviours
that the CPU device would change, made CUDA's again (`causal_mask_skipped`, `cuda_dropout`), and the stand-ins each
configuration states (`of_setup`, `pipeline_stage`; ddp's in `builders.wrap_ddp`)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from ftkit.realscale.configuration import Setup
from ftkit.realscale.nf4 import GEMM_4BIT_FUSED_MAX_ROWS

TENSORS = (
    "tensors on the CPU device under FakeTensorMode (faking CUDA fails at FSDP2's CUDA streams): attention is "
    "PyTorch SDPA's CPU flash kernel (the scripts' choice on a GPU without flash-attn is SDPA's CUDA kernels), "
    "and autocast applies its CPU op lists"
)
NO_MASK = (
    "no attention mask: the synthetic batch has no padding, so the causal mask is left to SDPA's is_causal "
    "(GQA kept), as transformers decides on a real run; on fake tensors it cannot read the mask or the "
    "position ids and would build the mask, which every layer's SDPA then saves, with k and v repeated "
    "to every head"
)
DROPOUT = (
    "LoRA dropout runs as torch.native_dropout, CUDA's fused kernel, which saves a 1-byte mask; CPU's "
    "dropout multiplies by a noise tensor in the input dtype and saves that instead"
)


def of_setup(s: Setup, unmasked: bool) -> list[str]:
    """The stand-ins a configuration states before its model has storage, in the output's order: the device, the
    synthetic batch, the restated loop; the micro-steps left out (--micro-steps), the mask left to SDPA (an
    unpadded batch that is not pp's), dropout's mask, the 4-bit base."""
    stand_ins = [TENSORS, batch(s), loop(s)]
    if s.runs < s.accum:
        stand_ins.append(micro_steps(s))
    if unmasked:
        stand_ins.append(NO_MASK)
    if s.technique == "cp":
        stand_ins.append(LOWER_RIGHT_FLASH)
    if s.args.lora_dropout > 0:
        stand_ins.append(DROPOUT)
    if s.nf4:
        stand_ins.append(four_bit(s))
    return stand_ins


def batch(s: Setup) -> str:
    args, answer = s.args, s.opts.answer_tokens
    if s.pp:
        return (
            f"a synthetic batch: {args.batch_size} x {args.max_length} random tokens per step, collated and padded "
            "as pp-ft's `padded` pads them (restated here), cut by the schedule into "
            f"{s.accum} micro-batches of {args.micro_batch_size}, the last {answer} positions the answer "
            "(the last stage's loss and lm_head)"
        )
    return (
        f"a synthetic batch: {args.micro_batch_size} x {args.max_length} random tokens per micro-batch, every "
        f"sequence full length, the last {answer} positions the answer (loss and lm_head)"
    )


def loop(s: Setup) -> str:
    if s.pp:
        return (
            "the training loop's step (the script's schedule.step under autocast, run.clip_grads_over_ranks, AdamW "
            "step, zero_grad) is restated here from the script, and so is its loss function (pp-ft's loss_fn, a "
            "closure in its main: the last stage's lm_head at the answer positions, token_loss_sum over the global "
            "batch's target tokens), given to the schedule without the script's timer around it"
            + (" and called by it on the last stage only" if s.opts.pp_stage == "first" else "")
            + "; the step's timers, learning-rate schedule, metrics and evaluation are left out"
        )
    return (
        "the training loop's step (forward, token_loss_sum, backward, AdamW step, zero_grad) is restated "
        "here from the script, the TP scripts' gradient sync and clip called from them (cp-ft's shard, "
        "forward_loss and all_reduce_grads too); the learning-rate schedule, metrics and evaluation are left out"
    )


def micro_steps(s: Setup) -> str:
    runs, accum = s.runs, s.accum
    return (
        f"each optimizer step ran {runs} of its {accum} accumulation micro-steps (--micro-steps); the FLOPs "
        f"counted are scaled by {accum}/{runs} (every micro-step counts the same); the peak is the one all "
        f"{accum} reach, since every micro-step after the first accumulates into the same gradients (tracked to "
        "the byte with 2 layers: 2 and 8 micro-steps, 2,260,994,684 bytes each)"
    )


def four_bit(s: Setup) -> str:
    technique, args = s.technique, s.args
    rows_4bit = args.micro_batch_size * args.max_length
    stored = (
        "and their weights the packed uint8 codes bitsandbytes stores ([out * in / 2, 1]), which the script's "
        "shard_model shards, as fsdp-ft shards the loaded base; each layer's quantization constants come from "
        "bitsandbytes' quantize_4bit of a fake bf16 weight (NF4, double quantization, blocksize 64) and are its "
        "module's quant_state, whole on this rank, tracked as 'Inputs'; the gathered weight, a plain parameter "
        "of FSDP2's, is given the module's quant_state as it is (bitsandbytes wraps it in a Params4bit first, "
        "sharing its storage, which a fake tensor cannot be)"
        if technique == "fsdp"
        else "each weight is quantized by bitsandbytes' quantize_4bit from a fake bf16 weight (NF4, double "
        "quantization, blocksize 64) and kept as a plain frozen parameter carrying its quant_state (a Params4bit "
        "cannot wrap a fake tensor); the quantization constants are tracked as 'Other'"
    )
    return (
        "the 4-bit base: transformers' bitsandbytes quantizer makes the meta model's projections Linear4bit "
        f"layers, as from_pretrained does{',' if technique == 'fsdp' else ';'} {stored}. gemm_4bit runs as "
        f"bitsandbytes' CUDA kernel runs it past {GEMM_4BIT_FUSED_MAX_ROWS} rows (dequantize to a bf16 weight, "
        f"F.linear; its fake kernel allocates and computes nothing); these micro-batches have {rows_4bit} rows"
        + ("" if rows_4bit > GEMM_4BIT_FUSED_MAX_ROWS else ", where a per-GPU heuristic may pick its fused kernel")
    )


def pipeline_stage(first: bool) -> str:
    """pp: what the stage is given in place of its neighbours (their metadata, its receive buffers), and stage 0's
    release of what it sent."""
    return (
        "the PipelineStage is given its input and output metadata (input_args, output_args: pp-ft's own "
        "`pipeline_stage`, so no shapes are exchanged between ranks, which the fake group could not do)"
        + (
            "; the gradients stage 0 receives are its receive buffers as the stage allocates them (fake "
            "tensors: the fake group's receive returns at once and writes nothing); a sent stage output is "
            "released as torch releases a plain tensor's (it keeps a FakeTensor, a subclass, until its "
            "backward: one [micro, seq, hidden] tensor per micro-batch in flight)"
            if first
            else "; the activations the last stage receives from the stage before are its receive buffers as "
            "the stage allocates them (fake tensors: the fake group's receive returns at once and writes "
            "nothing), requiring grad as the given input metadata says, so the stage computes their "
            "gradient and sends it back"
        )
    )


@contextlib.contextmanager
def causal_mask_skipped(unpadded: bool):
    """transformers' decision for a batch without padding passed without a mask, made for fake tensors.

    With no mask transformers looks for packed sequences in the position ids; a fake tensor has no values to look
    at, so it assumes packing and builds a 4-D mask. These position ids are 0..s-1 in every row, for which the check
    finds none (returns None): that is what this returns. Then the mask is skipped (SDPA's is_causal), as on a
    real run."""
    if not unpadded:
        yield
        return
    from transformers import masking_utils

    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


LOWER_RIGHT_FLASH = (
    "cp-ft's attention of a rank's query chunk over the keys up to its end (SDPA with causal_lower_right) runs as "
    "CUDA's flash kernel (aten._scaled_dot_product_flash_attention with is_causal, lower right in its convention): "
    "torch chooses it on an H100 for bf16, head_dim 128 and no mask, and saves q, k, v, the output and a logsumexp; "
    "on the CPU device torch 2.15 materialises the mask and runs its CPU flash kernel instead; the "
    "CausalBias (a tensor subclass holding no data) is made outside the fake mode and the memory tracker, under "
    "which it cannot be made"
)


@contextlib.contextmanager
def lower_right_flash(script):
    """SDPA's causal_lower_right as an H100 runs it (LOWER_RIGHT_FLASH), for cp-ft (`script`; None: nothing to do):
    torch's `CausalBias` asks whether the flash kernel can run (on CUDA it can, on the CPU device it cannot), and
    the script's CausalBias is made outside the fake mode."""
    if script is None:
        yield
        return
    from torch.nn.attention import bias
    from torch.utils._python_dispatch import _disable_current_modes

    def causal_lower_right(seq_len_q: int, seq_len_kv: int):
        with _disable_current_modes():  # the fake mode and the memory tracker's
            return bias.causal_lower_right(seq_len_q, seq_len_kv)

    with (
        mock.patch.object(bias, "can_use_flash_attention", lambda params: True),
        mock.patch.object(script, "causal_lower_right", causal_lower_right),
    ):
        yield


@contextlib.contextmanager
def cuda_dropout():
    """`F.dropout` (what PEFT's `nn.Dropout` calls) as CUDA runs it: `torch.native_dropout`, the fused kernel that
    saves a bool mask for backward. On the CPU device `F.dropout` multiplies by a noise tensor in the input dtype
    and saves it, 2 bytes per element for bf16 instead of 1 (tests/test_memory.py measures both)."""

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0:
            return input
        return torch.native_dropout(input, p, True)[0]

    with mock.patch.object(torch.nn.functional, "dropout", dropout):
        yield
