"""Tensor + sequence parallel LoRA, hand-rolled: Megatron-style column/row-parallel linears with LoRA built in.

Every rank holds 1/N of each projection (attention heads, MLP columns) and all ranks run the SAME micro-batches
together; activations between the blocks are split along the sequence, so the norms and the residual stream
of each rank cover 1/N of the tokens:
    uv run torchrun --nproc_per_node=2 experiments/tp-sp-ft/train.py                    # Qwen3-4B, 2 GPUs, NCCL
    uv run torchrun --nproc_per_node=2 experiments/tp-sp-ft/train.py --smoke            # CPU
    uv run torchrun --nproc_per_node=2 experiments/tp-sp-ft/train.py --smoke --no-sequence-parallel  # plain TP

Tensor parallelism does not split the batch: the data-parallel degree is 1, so accumulation is
--batch-size / --micro-batch-size and every rank computes the loss of the whole global batch (no scaling by
the world size). The collectives are written out below as autograd Functions that cite the equations they
implement: Megatron-LM's f and g (Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3, Fig. 3) and the sequence-parallel
all-gather / reduce-scatter pair (Korthikanti et al. 2022, arXiv 2205.05198, Sec. 4.2.2, Fig. 5). The model stays
a transformers Qwen3ForCausalLM: only its seven projections are replaced, in place, by parallel ones.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftkit import (
    batching,
    checkpoint,
    cli,
    comm,
    compilation,
    evaluation,
    fit,
    lora,
    metrics,
    models,
    optim,
    prepare,
    ranks,
    rundir,
)
from ftkit.profiling import StepProfiler


def parse_args():
    p = cli.common_parser(__doc__.splitlines()[0], experiment="tp-sp-ft")
    g = p.add_argument_group("tensor parallel")
    g.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_false",
        help="plain Megatron TP: the activations between blocks replicated on every rank, f/g all-reduces",
    )
    g.add_argument("--merge", action="store_true", help="also write the base with the LoRA merged in (merged/)")
    cli.add_dump_flags(g)  # --dump-grads, --dump-logits: for the tests' one-device comparison
    return cli.resolve(p.parse_args())


# ---- the collectives. The flat *_tensor collectives concatenate / split along dim 0, so the sequence dim (1 of
# [batch, seq, hidden]) is moved to the front and back. The results are made contiguous: a strided view would be
# copied by every linear that reads it, and each LoRA A would save its own copy for backward.


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    xs = x.transpose(0, 1).contiguous()
    out = xs.new_empty((xs.shape[0] * dist.get_world_size(group), *xs.shape[1:]))
    dist.all_gather_into_tensor(out, xs, group=group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    xs = x.transpose(0, 1).contiguous()
    out = xs.new_empty((xs.shape[0] // dist.get_world_size(group), *xs.shape[1:]))
    dist.reduce_scatter_tensor(out, xs, group=group)
    return out.transpose(0, 1).contiguous()


def _local_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


class CopyToTP(torch.autograd.Function):
    """Megatron's f (Shoeybi et al. 2019, Fig. 3): identity forward, all-reduce backward. It enters a block whose
    first linears are column-parallel: each rank's Y_i = X A_i gives only its part of dL/dX = sum_i dL/dY_i A_i^T."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. It leaves a block whose last linear is row-parallel:
    Z = sum_i Y_i B_i, each rank holding one partial product."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSeqToTP(torch.autograd.Function):
    """Sequence parallel's g (Korthikanti et al. 2022, Sec. 4.2.2, Fig. 5): all-gather along the sequence forward,
    reduce-scatter backward. Replaces f: the block sees the whole sequence, each rank's partial dL/dX is summed
    over ranks and each keeps its own tokens' share, the same bytes as f's all-reduce in two halves."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterSeqFromTP(torch.autograd.Function):
    """Sequence parallel's g-bar: reduce-scatter along the sequence forward, all-gather backward. Replaces g: the
    partial sums of the row-parallel linear are summed and each rank keeps its tokens only."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class ScatterSeq(torch.autograd.Function):
    """Into the sequence-parallel region (before layer 0): keep this rank's tokens; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _local_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


class GatherSeq(torch.autograd.Function):
    """Out of the sequence-parallel region (after the final norm): all-gather; every rank then computes the same
    logits and loss, so the gradient arriving here is the same on every rank and backward keeps this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _local_seq(grad, ctx.group), None


# ---- the parallel linears, LoRA built in. PEFT computes y = x W^T + s * (x A^T) B^T (A: r x in, B: out x r).


class ParallelLoRALinear(torch.nn.Module):
    """This rank's slices of a PEFT LoRA linear: the frozen W and the adapter's A and B, each split along its dim in
    `split` (None: whole on every rank). The dropout is PEFT's module (nn.Identity at --lora-dropout 0): every rank
    seeded its RNG alike and runs the same ops, so the ranks draw the same mask for a replicated input, as one
    GPU's layer would."""

    def __init__(self, peft_linear, tp: int, rank: int, split: dict[str, int | None]):
        super().__init__()
        self.split = split

        def part(t: torch.Tensor, dim: int | None) -> torch.Tensor:
            return (t if dim is None else t.chunk(tp, dim)[rank]).detach().clone()

        self.weight = torch.nn.Parameter(part(peft_linear.base_layer.weight, split["W"]), requires_grad=False)
        self.lora_A = torch.nn.Parameter(part(peft_linear.lora_A["default"].weight, split["A"]))
        self.lora_B = torch.nn.Parameter(part(peft_linear.lora_B["default"].weight, split["B"]))
        self.scaling = peft_linear.scaling["default"]
        self.dropout = peft_linear.lora_dropout["default"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As the PEFT scripts do under autocast: the adapter computes in x's dtype, its small fp32 weights cast.
        lora = F.linear(F.linear(self.dropout(x), self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scaling
        return F.linear(x, self.weight) + lora


class ColumnParallelLoRALinear(ParallelLoRALinear):
    """Y_i = X W_i^T + s (X A^T) B_i^T: W and B split by output rows, A whole on every rank (its rank-r output
    is needed in full by every slice of B). X arrives already replicated (after f / the SP all-gather).

    A's gradient s (dY_i B_i)^T X is only rank i's share of the sum over output slices: `sync_replicated_grads`
    all-reduces it once per optimizer step."""

    def __init__(self, peft_linear, tp: int, rank: int):
        super().__init__(peft_linear, tp, rank, split={"W": 0, "A": None, "B": 0})


class RowParallelLoRALinear(ParallelLoRALinear):
    """Z = sum_i [X_i W_i^T + s (X_i A_i^T) B^T]: W and A split by input columns, B whole. LoRA is linear, so B
    is applied before the sum and the adapter rides on the base layer's one reduction (g, or g-bar under SP):
    no collective of its own. B's gradient s (X_i A_i^T)^T dZ is rank i's share: all-reduced once per step."""

    def __init__(self, peft_linear, tp: int, rank: int, exit_block: type[torch.autograd.Function], group):
        super().__init__(peft_linear, tp, rank, split={"W": 1, "A": 1, "B": None})
        self.exit_block, self.group = exit_block, group  # g, or g-bar under SP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.exit_block.apply(super().forward(x), self.group)


def parallelize(model, tp: int, rank: int, group, sequence_parallel: bool) -> None:
    """Replace the seven projections of every decoder layer, in place, and put the block-entry collective in front
    of the attention and the MLP. The model stays a Qwen3ForCausalLM; `model` is the PEFT-wrapped one, whose
    LoRA initialisation (seeded like every other experiment's) the parallel linears take over."""
    into, out_of = (GatherSeqToTP, ReduceScatterSeqFromTP) if sequence_parallel else (CopyToTP, ReduceFromTP)
    for layer in model.base_model.model.model.layers:
        for block, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (layer.mlp, None)):
            for name in names or ("gate_proj", "up_proj", "down_proj"):
                old = getattr(block, name)
                if name in lora.COLUMN_PARALLEL:
                    setattr(block, name, ColumnParallelLoRALinear(old, tp, rank))
                else:
                    setattr(block, name, RowParallelLoRALinear(old, tp, rank, out_of, group))
        # One entry collective per block, shared by q/k/v (by gate/up), as in Megatron: a pre-hook on the block.
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs: (args, {**kwargs, "hidden_states": into.apply(kwargs["hidden_states"], group)}),
            with_kwargs=True,
        )
        layer.mlp.register_forward_pre_hook(lambda mod, args: (into.apply(args[0], group),))
    inner = model.base_model.model.model
    if sequence_parallel:
        # The embedding, the rotary cos/sin and the causal mask are computed for the whole sequence before layer 0;
        # the decoder stack then runs on this rank's tokens, and the final norm's output is gathered for lm_head.
        inner.layers[0].register_forward_pre_hook(lambda mod, args: (ScatterSeq.apply(args[0], group), *args[1:]))
        inner.norm.register_forward_hook(lambda mod, args, out: GatherSeq.apply(out, group))


def parallel_linears(model) -> list[tuple[str, ParallelLoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ParallelLoRALinear)]


def replicated_lora(model) -> list[torch.nn.Parameter]:
    """The LoRA tensors every rank holds whole but computes only a share of the gradient of."""
    return [getattr(m, f"lora_{w}") for _, m in parallel_linears(model) for w in "AB" if m.split[w] is None]


def sync_replicated_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum the ranks' shares of the replicated LoRA gradients: one all-reduce per optimizer step, over all of them
    (a flat buffer), as Megatron-LM does for the LayerNorm weights that sequence parallelism leaves replicated.
    Without it each rank would step with its share and the replicas would drift apart."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))


def main() -> None:
    args = parse_args()
    # ---- process group: one process per GPU; all of them form one tensor-parallel group, whose degree must deal
    # out whole heads (refused from the config before the data, the group or any weight: `prepare.start_ranks`).
    device, splits = prepare.start_ranks(args, tp=int(os.environ["WORLD_SIZE"]))
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    # TP does not split the batch: data-parallel degree 1, every rank runs every micro-batch.
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=1)
    dtype = cli.torch_dtype(args.dtype)
    run_dir, resume_from = ranks.on_rank0(rundir.resolve, args)

    # ---- data: every rank builds the same global batches and runs all of them (rank 0 of a world of 1).
    tokenizer, train_set, val_set, train_stats = prepare.encode_data(args, splits)
    batches = fit.global_batches(args, train_set)
    eval_batches = evaluation.micro_batches(val_set, args.eval_examples, args.micro_batch_size)
    eval_batches = [batching.pad_to_multiple(mb, tp) for mb in eval_batches]  # as every training micro-batch, below

    # ---- model: the whole bf16 base and the PEFT LoRA are built on every rank (the same seed, the same init),
    # then each rank keeps its slices. A real-size run would load only its shard; here clarity wins. Checkpointing
    # is non-reentrant: backward recomputes each layer, and with it the layer's forward collectives.
    model = prepare.load_lora_model(args, dtype, device, len(tokenizer))
    checkpoint.seed_dropout(args.seed, stream=0)  # every rank holds the same tokens: the same masks on each
    # --compile: eager, and says why: dynamo cannot trace the recording wrappers around the hand-rolled collectives
    compiled = compilation.compile_layers(model, args.compile, eager_because=compilation.TP_SP_EAGER_BECAUSE)
    config = model.config
    token_bytes = config.hidden_size * dtype.itemsize  # a token's activation between blocks, for the comm theory
    n_lora = models.parameter_counts(model)["trainable"]  # the whole adapter, for the FLOP count
    # ---- tensor parallel: the projections become column/row-parallel linears holding this rank's slices. The
    # norms are untouched: frozen, replicated, and (under SP) run on this rank's tokens.
    parallelize(model, tp, rank, group, args.sequence_parallel)
    linears = parallel_linears(model)  # by name: their slices make up the adapter (`checkpoint.gather_slices`)
    metrics.release_cached_memory(device)  # the whole model this rank built, but its slices, back to the driver
    counts = models.parameter_counts(model)
    ranks.print0(f"parameters on this rank: {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen")
    replicated = replicated_lora(model)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optim.adamw_cosine(trainable, args)
    # ---- resume: each rank reads back its own slices, their optimizer state and its RNG (rank<r>.pt)
    adapter = {name: p for name, p in model.named_parameters() if p.requires_grad}
    start_step = checkpoint.load_per_rank(resume_from, adapter, optimizer, scheduler)  # 0 without --resume

    log = rundir.start_log(
        args, run_dir, device, train_stats, counts, accum, start_step, resume_from, config, n_lora, tensor_parallel=tp
    )
    recorder = comm.CommRecorder(device)
    # Per-rank activation memory, measured on the first micro-batch in layer 1 (layer 0's input needs no gradient,
    # so it saves less): what SP divides by the TP degree is the norms' part.
    layer = model.base_model.model.model.layers[1]
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    saved = metrics.SavedActivations(model, {"layer": [layer], "norms": norms})

    # ---- train
    model.train()
    last_step = args.stop_after or args.max_steps
    with StepProfiler(args.profile_steps, run_dir, device, rank, start_step=start_step) as profiler:
        for step in range(start_step, last_step):
            metrics.reset_peak_memory(device)
            n_target = batches.n_target(step)  # the whole global batch's target tokens, on every rank
            loss_sum = torch.zeros((), device=device)
            with metrics.StepTimer(device) as timer:
                with comm.recording(recorder):  # the technique's traffic: the blocks' collectives + the LoRA sync
                    for mb in batches.micro_batches(step, args.micro_batch_size):
                        # Sequence parallelism splits the sequence into equal parts: right-padded to a multiple of
                        # the TP degree (masked out of attention and of the loss, so the step is unchanged).
                        mb = batching.to_device(batching.pad_to_multiple(mb, tp), device)
                        local_seq = mb["input_ids"].shape[1] // (tp if args.sequence_parallel else 1)
                        with saved.first_forward(tokens=mb["input_ids"].shape[0] * local_seq):
                            logits = lora.answer_logits(model, mb)  # the lm_head on the answer positions only
                        loss = batching.token_loss_sum(logits, mb["targets"]) / n_target
                        del logits  # freed by backward, not kept alive into the next forward
                        loss.backward()  # the same loss on every rank: no scaling by the world size
                        loss_sum += loss.detach()
                    sync_replicated_grads(replicated, group)
                if args.dump_grads and step == 2:
                    rundir.dump_grads(checkpoint.gather_slices(linears, group, grads=True), run_dir, rank)
                # The global norm: the sharded tensors' squares summed over ranks, the replicated ones counted once.
                # Its one scalar all-reduce is outside the accounting, like the metrics' own.
                grad_norm = optim.clip_grads_over_ranks(trainable, args.max_grad_norm, group, replicated)
                lr = optim.optimizer_step(optimizer, scheduler)  # AdamW on this rank's slices; the rate it ran at
            # The step's one host sync: every device scalar the metrics need, copied together.
            loss_value, grad_norm = metrics.host_values(loss_sum, grad_norm)
            row = log.row(
                step=step + 1,
                loss=loss_value,  # every rank computed the whole batch's loss
                grad_norm=grad_norm,
                lr=lr,
                target_tokens=n_target,
                lengths=batches.lengths(step),  # real tokens of the global batch, all ranks: known on the host
                seconds=timer.seconds,
                comm=recorder.take(),
                activation_bytes=batches.padded_tokens(step, args.micro_batch_size, multiple=tp) * token_bytes,
                **batches.layout(step, args.micro_batch_size, multiple=tp),  # micro-steps, share of positions padded
            )
            if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
                sums = evaluation.loss_sums(model, eval_batches, device)  # the same on every rank
                row["eval_loss"] = (sums[0] / sums[1]).item()
            log.log(row)
            if (step + 1) % args.save_every == 0 or step + 1 == args.stop_after:
                checkpoint.save_per_rank(run_dir, step + 1, adapter, optimizer, scheduler, args)
            profiler.step(step + 1)
    log.close()

    # ---- save: the shards reassembled into one stock PEFT adapter, and optionally the merged model
    finished = last_step == args.max_steps
    if finished:  # every rank sends its slices, rank 0 writes the adapter
        checkpoint.save_sliced_adapter(run_dir / "adapter", linears, group, model.peft_config["default"])
    if args.dump_logits and finished:
        rundir.dump_logits(model, eval_batches[0], device, run_dir / "logits.pt", rank)
    if rank != 0:
        return
    if args.merge and finished:
        lora.merge_adapter(args.model, args.seed, run_dir / "adapter", run_dir / "merged", len(tokenizer), dtype)
    theory = comm.tp_sp_collective_theory(config, args, log.rows, comm.nbytes(replicated))
    summary = log.run_summary(
        last_step,
        predicted=metrics.predicted_memory(config, args, "tp-sp" if args.sequence_parallel else "tp", world_size=tp),
        note=metrics.memory_note(device),
        compile=compilation.compile_report(compiled),
        sequence_parallel=args.sequence_parallel,
        replicated_lora_grad_bytes=comm.nbytes(replicated),
        theory_comm_by_kind_per_step=theory,
        theory_comm_bytes_per_step=sum(theory.values()),
        **comm.summarize(log.rows),
        comm_note=comm.NOTES["tp-sp-ft"],
        # Layer 1 on rank 0, first micro-batch: `tokens` is what this rank's norms and residual stream hold.
        activations_measured=saved.measured,
    )
    rundir.finish(args, run_dir, summary, finished)


if __name__ == "__main__":
    ranks.launch(main)
