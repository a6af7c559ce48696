"""Qwen3-4B at real scale without a GPU: one rank's training step on fake tensors, its memory and FLOPs tracked.

    uv run python -m ftkit.realscale --technique fsdp --world 8 --json
    uv run python -m ftkit.realscale --technique fsdp --quant nf4 --world 2 --json
    uv run python -m ftkit.realscale --technique single --no-grad-checkpointing
    uv run python -m ftkit.realscale --technique pp --world 2 --schedule gpipe --json
    uv run python -m ftkit.realscale --technique pp --world 2 --pp-stage last --json

Under `FakeTensorMode` a tensor has a shape, a dtype and a device but no storage, and the `fake` process-group
backend lets this one process play one rank (rank 0; with pp, --pp-stage's) of a world of --world ranks (its
collectives return at once). So the real step runs here at Qwen3-4B's exact shape (`qwen3-4b-shape`): the model
built by `ftkit.models` as the scripts build it, parallelised by the scripts' own code (FSDP2 through
experiments/fsdp-ft/train.py's `shard_model`; a pipeline stage through experiments/pp-ft/train.py's `Stage`,
schedule and loss), two optimizer steps of the scripts' default configuration (their own parsers give the flags and
defaults), on a synthetic batch of full-length sequences. Measured on that rank:

- peak bytes by category, from PyTorch's memory trackers (`MemTracker`; `FSDPMemTracker` for FSDP), beside
  `ftkit.memory`'s prediction for the same configuration (as the scripts' summaries call it, at the batch's
  answer positions);
- FLOPs per optimizer step from `torch.utils.flop_counter.FlopCounterMode` (SDPA counted for the pairs its causal
  mask keeps, as the GPU's causal kernels compute them), without activation checkpointing's recompute
  (`flops_counted`, what the MFU convention counts) and with it, beside `ftkit.metrics.step_flops` with the
  lm_head at every token (`flops_convention`, the MFU convention until 2026-11-25), by component, and with the
  lm_head at the positions the step computes logits at (`flops_convention_at_logits`: the MFU convention since);
- the fraction of matmul FLOPs (matmuls and attention) whose operands are bf16;
- bytes per collective kind in the counted step, recorded as the script records them (`ftkit.comm`), beside the
  script's own theory for the same micro-steps (ddp, fsdp, tp, tp-sp; pp: the stage's sends).

Pipeline parallelism (pp, --schedule gpipe or 1f1b, the two the memory model predicts): this process plays the rank
that holds --pp-stage's stage and runs pp-ft's schedule over the whole global batch (one micro-batch per
--micro-batch-size rows). first: rank 0, the embedding and the first 1/--world of the decoder layers; under 1F1B it
keeps min(m, p) micro-batches in flight, the most of any stage; it sends each micro-batch's output forward. last:
the last rank, the last 1/--world of the layers, the final norm and the lm_head (its own copy of the tied
embedding), and pp-ft's loss on the answer positions; it sends each micro-batch's input gradient back. The peak is
compared with the memory model's prediction for that stage (`pp_stage`); the busier of the two, the one pp-ft's
summary states, is reported beside it.

Context parallelism (cp): this process plays rank 0 of cp-ft's --world ranks, which holds the sequence's first and
last chunks (so every answer position of the synthetic batch), runs cp-ft's own `shard`, `forward_loss` (its
`cp_attention`, K and V all-gathered and their gradients reduce-scattered by its `GatherKV`) and `all_reduce_grads`;
the sequence's causal attention with its keys aligned at the bottom right runs as CUDA's flash kernel does it on an
H100 (`stand_ins.lower_right_flash`).

QLoRA (--quant nf4, single-gpu-ft's and ddp-ft's default, an option of fsdp-ft's): the projections are bitsandbytes
`Linear4bit` layers, made by transformers' own quantizer and quantized by bitsandbytes' own `quantize_4bit`
(`quantize_fake`), and each 4-bit matmul dequantizes its weight to bf16 as bitsandbytes' CUDA kernel does at these
row counts. Under FSDP the packed codes (uint8, the shape bitsandbytes stores) are sharded by the script's
`shard_model` and gathered as bytes; the quantization constants stay on the module, whole on every rank.

These are tracked on fake tensors at Qwen3-4B's shape: they exclude the CUDA context, NCCL buffers and allocator
fragmentation, and the tensors live on the CPU device (faking CUDA fails at FSDP2's CUDA streams), so CPU-only
choices (the SDPA kernel, autocast's CPU op lists) stand in for CUDA's; `stand_ins` in the output lists them.

The package, by concern: `command` (the command line, the table; `python -m ftkit.realscale` runs its `main`),
`configuration` (the script's flags and the rank played, before any model is built), `builders` (the model as each
script builds and parallelises it), `nf4` (the 4-bit base as bitsandbytes stores and computes it), `step` (the
synthetic batch and the scripts' training step, restated), `trackers` (the memory trackers), `flops` (the FLOP
count), `stand_ins` (CUDA's behaviours on the CPU device, and the stand-ins' text), `measure` (the run and its
steps) and `report` (the JSON: the measurements beside the memory model, the convention and the theory).
"""

from __future__ import annotations

SCRIPTS = {
    "single": "single-gpu-ft",
    "ddp": "ddp-ft",
    "fsdp": "fsdp-ft",
    "tp": "tp-ft",
    "tp-sp": "tp-sp-ft",
    "pp": "pp-ft",
    "cp": "cp-ft",
}
# The pipeline schedules the memory model predicts (`pp_schedule`), each holding one stage per rank.
PP_SCHEDULES = ("gpipe", "1f1b")
TENSOR_PARALLEL = ("tp", "tp-sp")  # every rank runs every sequence
SEQUENCE_SPLIT = (*TENSOR_PARALLEL, "cp")  # ... or its share of every sequence: no data parallelism
LABEL = (
    "tracked on fake tensors at Qwen3-4B's shape; excludes the CUDA context, NCCL buffers and allocator fragmentation"
)
# The answer positions per sequence of the synthetic batch (the lm_head runs on those only): the most the
# committed H100 runs on AMI met in a micro-batch was 200 (devlogs/runs/single-gpu-ft-gpu/memory-check-*.md, padded
# rows, the tiny tokenizer's tokens); AMI's longest answer is 208 of Qwen3's tokens with its <|im_end|>
# (ftkit/ami_lengths.json), and a packed row of several examples at 2,048 holds up to 446 (tests/test_ami_lengths.py).
ANSWER_TOKENS = 256


class RealScaleError(RuntimeError):
    """A configuration this command cannot run; the message says why."""
