"""Context parallel LoRA: finetune Qwen3-4B on whole meetings, each sequence split along its length over GPUs.

A whole AMI meeting's transcript runs up to 15k words (20.5k of Qwen3's tokens), and at Qwen3-4B's 32k
context one sequence's activations no longer fit a 24 GB card beside a bf16 base. Context parallelism (CP) cuts
every sequence into 2 x --cp chunks, and rank r holds chunks r and 2cp-1-r, so that every rank has as much causal
attention to compute (Llama 3, Dubey et al. 2024, arXiv 2407.21783, Sec. 3.3.2; the imbalance of contiguous
slices: Brandon et al. 2023, arXiv 2311.09431):

    --cp 2:   | c0 | c1 | c2 | c3 |      rank 0: c0 + c3      rank 1: c1 + c2
    causal work:  1    2    3    4       1 + 4 = 5            2 + 3 = 5

Everything but attention works token by token, so each rank runs the model on its own tokens, RoPE at their global
positions. Attention needs every earlier key: each layer all-gathers K and V (8 KV heads, before GQA repeats them
for the 32 query heads: a quarter of Q's bytes) and each local chunk attends causally to the keys up to its end;
backward reduce-scatters their gradients to the ranks that own them. The loss is each rank's answer tokens over
the global batch's target tokens, and the LoRA gradients are summed over the ranks in one all-reduce (DDP's averages).

With more ranks than --cp, the world is a grid of world/cp data-parallel groups (each its own meetings) of --cp
consecutive ranks (one meeting's chunks: the per-layer gathers stay among neighbours, inside a node):

    uv run torchrun --nproc_per_node=2 experiments/cp-ft/train.py            # Qwen3-4B, whole meetings, 32k tokens
    uv run torchrun --nproc_per_node=4 experiments/cp-ft/train.py --cp 2     # 2 meetings at a time, 2 GPUs each
    uv run torchrun --nproc_per_node=2 experiments/cp-ft/train.py --smoke    # CPU, gloo

One row per meeting, right-padded to a multiple of 2 x cp: packing does not apply to one sequence per row.
"""

from __future__ import annotations

import os

import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import set_peft_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from ftkit import (
    batching,
    checkpoint,
    cli,
    comm,
    compilation,
    errors,
    evaluation,
    lora,
    metrics,
    models,
    optim,
    prepare,
    ranks,
    rundir,
)
from ftkit.profiling import StepProfiler

# The reference configuration of this experiment: whole meetings, one per micro-batch, at Qwen3-4B's 32k context.
REAL = dict(task="meetings", max_length=32768, micro_batch_size=1, batch_size=8)
# The walkthrough: the tiny tokenizer's whole-meeting examples are 1.7k-21k tokens; 4,096 keeps the 11 shortest.
SMOKE = dict(task="meetings", max_length=4096, micro_batch_size=1, batch_size=2)
EAGER_BECAUSE = "cp-ft's attention calls collectives inside a hand-written autograd Function (GatherKV)"
TRAP = (
    "cp-ft's attention got a mask: where transformers builds masks for an attention (as for its own SDPA), it reads "
    "the chunks' position ids, which jump from one chunk to the next, as packed sequences and masks them apart; "
    "pass attention_mask={'full_attention': None}"
)


def parse_args():
    p = cli.common_parser(__doc__.splitlines()[0], experiment="cp-ft")
    p.add_argument(
        "--cp",
        type=int,
        default=None,
        help="ranks each sequence is split over; the world / cp groups of them train on different meetings "
        "[the world size]",
    )
    args = p.parse_args()
    for key, value in (SMOKE if args.smoke else REAL).items():  # this experiment's own defaults
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.packing = False
    return cli.resolve(args)


class GatherKV(torch.autograd.Function):
    """K or V of every rank's chunks [cp, batch, kv heads, local tokens, dim]: all-gather forward; backward
    reduce-scatters, so each rank gets, summed over the ranks, the gradient every query put on its keys."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x, world = x.contiguous(), dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))  # the ranks' tensors one after another along dim 0
        dist.all_gather_into_tensor(out, x, group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.reshape(-1, *grad.shape[2:]).contiguous(), group=ctx.group)
        return out, None


class Chunks:
    """Which chunks of the padded sequence this rank holds: chunk r and chunk 2cp-1-r, `size` tokens each; `group`:
    the ranks that hold the others (None: the default group)."""

    def __init__(self, cp: int, rank: int, length: int, group: dist.ProcessGroup | None = None):
        self.cp, self.size, self.group = cp, length // (2 * cp), group
        self.mine = (rank, 2 * cp - 1 - rank)
        # Where each global chunk sits in the gathered tensor: (rank, slot 0 or 1)
        self.home = [(c, 0) if c < cp else (2 * cp - 1 - c, 1) for c in range(2 * cp)]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a [rows, seq] tensor: its two chunks, in order."""
        return torch.cat([x[:, c * self.size : (c + 1) * self.size] for c in self.mine], dim=1)


CHUNKS: Chunks | None = None  # the current micro-batch's, set before its forward (and its backward's recompute)


def cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention of this rank's query chunks over every earlier key ([batch, heads, tokens, dim] in,
    [batch, tokens, heads, dim] out, as transformers' attention functions). K and V are gathered with their 8 KV
    heads; each chunk c's queries attend to keys 0 .. (c+1) x size, causally aligned at the bottom right."""
    if attention_mask is not None:
        raise RuntimeError(TRAP)
    n = CHUNKS.size
    k_all, v_all = GatherKV.apply(key, CHUNKS.group), GatherKV.apply(value, CHUNKS.group)
    # The gathered chunks in sequence order: global chunk c is slot s of rank r's local tokens.
    k_seq = torch.cat([k_all[r][:, :, s * n : (s + 1) * n] for r, s in CHUNKS.home], dim=2)
    v_seq = torch.cat([v_all[r][:, :, s * n : (s + 1) * n] for r, s in CHUNKS.home], dim=2)
    # GQA after the gather: each KV head serves query heads // KV heads query heads (repeated here, not sent).
    repeat = query.shape[1] // key.shape[1]
    k_seq, v_seq = k_seq.repeat_interleave(repeat, dim=1), v_seq.repeat_interleave(repeat, dim=1)
    outs = []
    for slot, c in enumerate(CHUNKS.mine):
        q = query[:, :, slot * n : (slot + 1) * n]
        k, v = k_seq[:, :, : (c + 1) * n], v_seq[:, :, : (c + 1) * n]
        outs.append(
            F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, (c + 1) * n), scale=scaling)
        )
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register("cp", cp_attention)


def shard(mb: dict, cp: int, rank: int, group: dist.ProcessGroup | None = None) -> dict:
    """This rank's part of a padded micro-batch: its two chunks' input ids and global positions, and the answer
    positions among its tokens with their targets (a rank with none keeps one position and no target: its backward
    must still run, for the collectives)."""
    global CHUNKS
    mb = batching.pad_to_multiple(mb, 2 * cp)
    rows, length = mb["input_ids"].shape
    CHUNKS = Chunks(cp, rank, length, group)
    positions = CHUNKS.local(torch.arange(length).expand(rows, length))
    labels = mb["labels"]
    nxt = torch.cat([labels[:, 1:], torch.full((rows, 1), batching.IGNORE_INDEX)], dim=1)  # the token each predicts
    targets = CHUNKS.local(nxt)
    keep = [torch.nonzero(t != batching.IGNORE_INDEX).flatten() for t in targets]
    k = max(1, max(len(i) for i in keep))
    logit_positions = torch.zeros((rows, k), dtype=torch.long)
    picked = torch.full((rows, k), batching.IGNORE_INDEX, dtype=torch.long)
    for r, idx in enumerate(keep):
        logit_positions[r, : len(idx)] = idx
        picked[r, : len(idx)] = targets[r, idx]
    return {
        "input_ids": CHUNKS.local(mb["input_ids"]),
        "position_ids": positions,
        "logit_positions": logit_positions,
        "targets": picked,
    }


def forward_loss(model, mb: dict, device, dtype) -> torch.Tensor:
    """The sum of this rank's token losses on its part of a micro-batch."""
    mb = batching.to_device(mb, device)
    with lora.compute_autocast(device, dtype):
        out = model(
            input_ids=mb["input_ids"],
            position_ids=mb["position_ids"],
            attention_mask={"full_attention": None},  # no mask: cp_attention masks by chunk (the TRAP otherwise)
            logits_to_keep=mb["logit_positions"],
            use_cache=False,
        )
        return batching.token_loss_sum(out.logits, mb["targets"])


def all_reduce_grads(trainable: list[torch.Tensor]) -> None:
    """Each rank's gradients are its tokens' share of the step's: summed, they are the whole gradient. One
    all-reduce of all of them, flattened into one buffer (33 M fp32 values at Qwen3-4B)."""
    flat = torch.cat([p.grad.reshape(-1) for p in trainable])
    dist.all_reduce(flat)
    for p, g in zip(trainable, flat.split([p.numel() for p in trainable])):
        p.grad.copy_(g.view_as(p.grad))


def comm_theory(config, args, padded_tokens: float, trainable: list[torch.Tensor]) -> dict[str, float]:
    """What theory says a step of `padded_tokens` (all its micro-batches') sends, by collective: per layer and padded
    token, K and V (8 heads x 128 x bf16 at Qwen3-4B: 4 KiB) all-gathered in forward, again in the recompute of each
    checkpointed layer, and their gradients reduce-scattered; then the LoRA gradients' one all-reduce. Bytes of the
    whole buffers, as recorded."""
    kv = 2 * config.num_key_value_heads * config.head_dim * cli.torch_dtype(args.dtype).itemsize
    per_pass = kv * config.num_hidden_layers * padded_tokens
    recomputed = kv * comm.checkpointed_count(args, config.num_hidden_layers) * padded_tokens  # recomputed layers
    return {"all_gather": per_pass + recomputed, "reduce_scatter": per_pass, "all_reduce": comm.nbytes(trainable)}


def check_layout(args, world: int) -> tuple[int, int]:
    """(DP, CP): the CP degree (--cp, or the world size) and the data-parallel groups of it, or the reason cp-ft
    cannot split this run's sequences and batches so."""
    cp = args.cp or world
    if cp <= 0 or world % cp:
        raise errors.RunError(f"--cp {cp} must divide the world size {world}")
    ranks.check_cp_chunks(args.max_length, cp)
    batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=world // cp)
    return world // cp, cp


def main() -> None:
    args = parse_args()
    ranks.torchrun_local_rank()
    world = int(os.environ["WORLD_SIZE"])
    dp, cp = check_layout(args, world)  # refused before the group and the model, on every rank alike
    config = models.model_config(args.model)
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"]):
        raise errors.RunError(f"cp-ft's attention is full causal attention; {args.model} has {config.layer_types}")

    device, splits = prepare.start_ranks(args)
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))  # rank = dp_rank x cp + cp_rank
    dp_rank, cp_rank, cp_group = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank(), mesh["cp"].get_group()
    dtype = cli.torch_dtype(args.dtype)
    run_dir, resume_from = ranks.on_rank0(rundir.resolve, args)

    # ---- data: whole meetings (--task meetings), one padded row each. A CP group's ranks take the same micro-batches.
    tokenizer, train_set, val_set, train_stats = prepare.encode_data(args, splits)
    batches = batching.global_batches(args, train_set)
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=dp)
    held_out = evaluation.micro_batches(val_set, args.eval_examples, args.micro_batch_size)
    eval_batches = held_out[dp_rank::dp]  # dealt to the DP groups; a group may have none (its sums are 0)
    if not train_set or not held_out:
        raise errors.RunError(
            f"--task {args.task} at --max-length {args.max_length} keeps no training or held-out example: raise "
            "--max-length (whole meetings run up to 15k words; 2,592 keeps one of each with --smoke)"
        )

    # ---- model: the whole bf16 base on every rank, its attention `cp`, LoRA from --seed: every rank the same
    with ranks.rank0_first():
        model = models.load_model(
            args.model, quant="none", dtype=dtype, device=device, seed=args.seed, vocab_size=len(tokenizer), attn="cp"
        )
    config = model.config
    if args.grad_checkpointing:  # the recompute in backward runs cp_attention again, gathers included
        lora.checkpoint_activations(model, checkpointing=args.checkpointing)
    model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
    checkpoint.seed_dropout(args.seed, stream=rank)  # each rank's tokens differ, and so do its dropout masks
    compiled = compilation.compile_layers(model, args.compile, eager_because=EAGER_BECAUSE)
    model = lora.adapters_compute_in(model, dtype)
    counts = models.parameter_counts(model)
    ranks.print0(
        f"parameters: {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen; dp {dp} x cp {cp}"
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optim.adamw_cosine(trainable, args)
    recorder = comm.CommRecorder(device)

    # ---- resume: the adapter and optimizer are the same on every rank (rank 0 saved them); each rank its RNG
    start_step = 0
    if resume_from is not None:
        state = checkpoint.read_state(resume_from, ("adapter/adapter_model.safetensors", "optimizer.pt"))
        weights = safetensors.torch.load_file(resume_from / "adapter" / "adapter_model.safetensors")
        set_peft_model_state_dict(model, weights)
        opt = checkpoint.load_torch(resume_from / "optimizer.pt")
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        checkpoint.restore_rng(resume_from, state, rank, world)
        start_step = state["step"]

    log = rundir.start_log(
        args, run_dir, device, train_stats, counts, accum, start_step, resume_from, config, dp=dp, cp=cp
    )

    def save_checkpoint(step: int) -> None:
        rng = [None] * world if rank == 0 else None
        dist.gather_object(checkpoint.rng_state(), rng, dst=0)
        if rank == 0:
            tmp = checkpoint.staging_dir(run_dir, step)
            model.save_pretrained(tmp / "adapter", save_embedding_layers=False)
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
            for r, state in enumerate(rng):
                torch.save(state, tmp / f"rng-rank{r}.pt")
            checkpoint.commit(tmp, step, {"seed": args.seed, "world_size": world}, args.keep_checkpoints)
        dist.barrier()

    @torch.no_grad()
    def eval_loss() -> float:
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for mb in eval_batches:
            part = shard(mb, cp, cp_rank, cp_group)
            sums[0] += forward_loss(model, part, device, dtype).double()
            sums[1] += (part["targets"] != batching.IGNORE_INDEX).sum()
        dist.all_reduce(sums)  # each rank's answer tokens, each group's meetings: the sum is the whole set's
        model.train()
        return (sums[0] / sums[1]).item()

    # ---- train
    model.train()
    last_step = args.stop_after or args.max_steps
    with StepProfiler(args.profile_steps, run_dir, device, rank, start_step=start_step) as profiler:
        for step in range(start_step, last_step):
            metrics.reset_peak_memory(device)
            n_target = batches.n_target(step)  # the whole global batch's target tokens: the loss denominator
            loss_sum = torch.zeros((), device=device)
            with metrics.StepTimer(device) as timer, comm.recording(recorder):
                for mb in batches.micro_batches(step, args.micro_batch_size, dp_rank, dp):
                    loss = forward_loss(model, shard(mb, cp, cp_rank, cp_group), device, dtype) / n_target
                    loss.backward()  # every rank, answer tokens or not: its gathers' reduce-scatters are collectives
                    loss_sum += loss.detach()
                all_reduce_grads(trainable)
                clip = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable, clip)  # the same on every rank
                lr = optim.optimizer_step(optimizer, scheduler)
            dist.all_reduce(loss_sum)
            global_loss, grad_norm = metrics.host_values(loss_sum, grad_norm)
            row = log.row(
                step=step + 1,
                loss=global_loss,
                grad_norm=grad_norm,
                lr=lr,
                target_tokens=n_target,
                lengths=batches.lengths(step),
                seconds=timer.seconds,
                comm=recorder.take(),
                **batches.layout(step, args.micro_batch_size, dp_rank, dp, multiple=2 * cp),
            )
            if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
                row["eval_loss"] = eval_loss()
            log.log(row)
            if (step + 1) % args.save_every == 0 or step + 1 == args.stop_after:
                save_checkpoint(step + 1)
            profiler.step(step + 1)
    log.close()

    # ---- save: a stock PEFT adapter from rank 0 (every rank holds the same one)
    finished = last_step == args.max_steps
    if rank != 0:
        return
    if finished:
        model.save_pretrained(run_dir / "adapter", save_embedding_layers=False)
    steps = [r["step"] - 1 for r in log.rows]
    padded = [batches.padded_tokens(s, args.micro_batch_size, dp_rank, dp, multiple=2 * cp) for s in steps]
    theory = sum(comm_theory(config, args, sum(padded) / max(1, len(padded)), trainable).values())
    summary = log.run_summary(
        last_step,
        predicted=metrics.predicted_memory(config, args, "cp", world_size=world, cp=cp),
        note=metrics.memory_note(device),
        compile=compilation.compile_report(compiled),
        comm_theory_bytes_per_step=theory,
        **comm.summarize(log.rows),
        comm_note=comm.NOTES["cp-ft"],
    )
    rundir.finish(args, run_dir, summary, finished)


if __name__ == "__main__":
    ranks.launch(main)
