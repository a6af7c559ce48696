"""The held-out loss: a fixed set of examples cut into micro-batches and dealt to the ranks, and the sums an
all-reduce turns into the eval loss."""

from __future__ import annotations

import torch

from ftkit.errors import RunError


def micro_batches(
    encoded: list,
    n_examples: int,
    micro_batch_size: int,
    rank: int = 0,
    world: int = 1,
    even: bool = False,
    collate=None,
):
    """A fixed held-out set (the first n examples, longest first to pad little), cut into micro-batches and
    dealt round-robin to ranks. `even`: refuse a set that does not split evenly over the ranks, for techniques
    whose every forward is a collective (FSDP's all-gathers) and so must run as many micro-batches on every rank.
    `collate`: what makes a micro-batch of a list of examples [`batching.collate`]; a pipeline gives its own, for the
    one shape its stages send (experiments/pp-ft)."""
    from ftkit import batching

    chosen = sorted(encoded[:n_examples], key=lambda e: -len(e.input_ids))
    chunks = [chosen[i : i + micro_batch_size] for i in range(0, len(chosen), micro_batch_size)]
    if even and len(chunks) % world:
        raise RunError(
            f"--eval-examples {n_examples} makes {len(chunks)} eval micro-batches of {micro_batch_size}, which do "
            f"not split evenly over {world} data-parallel groups (every FSDP forward is a collective)"
        )
    return [(collate or batching.collate)(c) for c in chunks[rank::world]]


@torch.no_grad()
def loss_sums(
    model, micro_batches: list[dict], device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[sum of token losses, target tokens] over these micro-batches, as a tensor ready for an all-reduce.
    dtype: the adapters' compute dtype, for a model prepared with `lora.adapters_compute_in` (the forward runs
    under `lora.compute_autocast`, as in training); fp32 runs it as it is."""
    from ftkit.batching import to_device, token_loss_sum
    from ftkit.lora import answer_logits, compute_autocast

    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in micro_batches:
        mb = to_device(mb, device)
        with compute_autocast(device, dtype):
            logits = answer_logits(model, mb)
        sums[0] += token_loss_sum(logits, mb["targets"]).double()
        sums[1] += (mb["targets"] != -100).sum()
    model.train(was_training)
    return sums
