"""Every experiment's optimizer and schedule, its step, and the gradient norm and clipping over ranks that each
hold a share of the trainable tensors."""

from __future__ import annotations

import argparse

import torch


def adamw_cosine(
    params: list[torch.nn.Parameter], args: argparse.Namespace
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """Every experiment's optimizer: AdamW (--lr, --weight-decay) over `params`, fused where they are all on CUDA
    (`fused_adamw`), and its schedule: linear warmup over --warmup-steps, then cosine decay to 0 at --max-steps.
    Returns (optimizer, scheduler)."""
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, fused=fused_adamw(params))
    return optimizer, get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)


def fused_adamw(params: list) -> bool:
    """AdamW's fused CUDA kernel: one launch per group of tensors of a device and dtype for the whole update, where
    the default (foreach) launches several, each a host dispatch (Qwen3-4B's LoRA: 504 matrices). Only where every
    parameter is on CUDA (a DTensor's device is its local shard's); on the CPU (the walkthrough, fsdp-ft's
    --cpu-offload) the default, whose numbers every CPU parity test compares."""
    return bool(params) and all(p.device.type == "cuda" for p in params)


def optimizer_step(optimizer: torch.optim.Optimizer, scheduler) -> float:
    """The optimizer's step, then the schedule's, and the gradients freed (set to None) for the next step's
    backward; returns the learning rate the step ran at (the scheduler's step() sets the next one's)."""
    optimizer.step()
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr


def squares_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the tensors' squared elements, in fp32, on `device`, for a gradient norm: torch._foreach_norm
    launches one kernel per group of tensors of one device and dtype, where a loop of p.grad.pow(2).sum() launches
    three per tensor (Qwen3-4B's LoRA has 504 matrices: ~1,500 launches a step, each a host dispatch)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(tensors)).float().pow(2).sum()


def clip_grads_over_ranks(trainable: list, max_norm: float, group=None, replicated: tuple = ()) -> torch.Tensor:
    """The whole model's gradient norm when each rank holds a distinct share of its trainable tensors (pipeline
    stages, tensor-parallel slices), and the gradients clipped to `max_norm` (0: not clipped) as
    torch.nn.utils.clip_grad_norm_ clips one model's: the shares' squares summed over the ranks (one scalar
    all-reduce), the `replicated` tensors (whole on every rank, the same gradient) counted once. The norm stays
    on the device: no host sync."""
    import torch.distributed as dist

    shared = {id(p) for p in replicated}

    def sum_sq(params) -> torch.Tensor:
        return squares_sum([p.grad.detach() for p in params if p.grad is not None], trainable[0].device)

    sq = sum_sq(p for p in trainable if id(p) not in shared)
    dist.all_reduce(sq, group=group)
    norm = (sq + sum_sq(replicated)).sqrt()
    torch.nn.utils.clip_grads_with_norm_(trainable, max_norm if max_norm > 0 else float("inf"), norm)
    return norm
