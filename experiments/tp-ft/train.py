"""Tensor parallel LoRA with PyTorch's DTensor: `parallelize_module` on a device mesh, a plan that knows about LoRA.

Every rank holds 1/N of each projection (attention heads, MLP columns) and all ranks run the SAME micro-batches
together. The plan is written for PEFT's modules: the frozen base layers are split as in Megatron-LM (q/k/v and
gate/up column-wise, o/down row-wise) and each adapter is split to match its base:
    uv run torchrun --nproc_per_node=2 experiments/tp-ft/train.py                    # Qwen3-4B, 2 GPUs, NCCL
    uv run torchrun --nproc_per_node=2 experiments/tp-ft/train.py --smoke            # CPU
    uv run torchrun --nproc_per_node=2 experiments/tp-ft/train.py --smoke --naive-plan   # the plan PEFT breaks

Tensor parallelism does not split the batch: the data-parallel degree is 1, so accumulation is
--batch-size / --micro-batch-size and every rank computes the loss of the whole global batch (no scaling by
the world size). No sequence parallelism here: the activations between blocks are replicated on every rank
(experiments/tp-sp-ft writes the collectives out by hand and splits them along the sequence).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ftkit import (
    batching,
    checkpoint,
    cli,
    comm,
    compilation,
    errors,
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
    p = cli.common_parser(__doc__.splitlines()[0], experiment="tp-ft")
    g = p.add_argument_group("tensor parallel")
    g.add_argument(
        "--naive-plan",
        action="store_true",
        help="shard only PEFT's base layers (the model's own TP plan pointed at `<proj>.base_layer`) and leave "
        "the adapters whole: reproduces the error this gives",
    )
    g.add_argument(
        "--comm-every-step",
        action="store_true",
        help="record DTensor's collectives on every step; by default only on sampled steps (the first step run "
        "and every eval step), since the dispatch mode that sees them runs Python on every op of the step",
    )
    cli.add_dump_flags(g)  # --dump-grads, --dump-logits: for the tests' one-device comparison
    return cli.resolve(p.parse_args())


# ---- the plan. ColwiseParallel shards a Linear's weight by output rows (Shard(0)) and expects a replicated input;
# RowwiseParallel shards by input columns (Shard(1)), takes a sharded input and all-reduces its partial output
# (Megatron-LM's f and g, Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3). PEFT wraps each projection as
# `<proj>.base_layer` + `<proj>.lora_A.default` + `<proj>.lora_B.default` and adds
# base_layer(x) + lora_B(lora_A(x)) * scaling, so the adapter has to be split like its base or the sum does not fit.
def lora_aware_plan() -> dict:
    """Column layers: base and B by output rows, A whole (every slice of B needs A's whole rank-r output; in
    backward ColwiseParallel all-reduces the gradient of B's input, so A's gradient is complete on every rank).
    Row layers: base and A by input columns (A's partial outputs all-reduced by RowwiseParallel), B whole."""
    plan = {}
    for name in lora.COLUMN_PARALLEL:
        block = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj")) else "mlp"
        plan[f"{block}.{name}.base_layer"] = ColwiseParallel()
        plan[f"{block}.{name}.lora_B.default"] = ColwiseParallel()
    for name in lora.ROW_PARALLEL:
        block = "self_attn" if name == "o_proj" else "mlp"
        plan[f"{block}.{name}.base_layer"] = RowwiseParallel()
        plan[f"{block}.{name}.lora_A.default"] = RowwiseParallel()
    return plan


def naive_plan() -> dict:
    """The model's own TP plan (transformers' Qwen3 base_model_tp_plan) pointed at the layers PEFT wrapped: the
    base is split, the adapters are not. Each rank's base output is a slice, its LoRA output is whole: the sum
    in PEFT's forward fails on the shapes (the same plan applied *before* get_peft_model fails the same way:
    DTensor keeps the projections' unsharded shapes, so PEFT builds whole adapters beside sliced bases)."""
    plan = {}
    for name in lora.COLUMN_PARALLEL + lora.ROW_PARALLEL:
        block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        plan[f"{block}.{name}.base_layer"] = ColwiseParallel() if name in lora.COLUMN_PARALLEL else RowwiseParallel()
    return plan


def clip_grads(trainable: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global gradient norm, and the gradients clipped to `max_norm` (0: not clipped) as clip_grad_norm_ clips,
    the factor left on the device: the DTensor shards' squares summed over the mesh, the replicated adapters
    counted once. (clip_grad_norm_ itself refuses a mix of DTensor and plain tensors.)"""
    device = trainable[0].device
    sq = optim.squares_sum([p.grad.to_local() for p in trainable if isinstance(p.grad, DTensor)], device)
    dist.all_reduce(sq)
    norm = (sq + optim.squares_sum([p.grad for p in trainable if not isinstance(p.grad, DTensor)], device)).sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in trainable], coef)
    return norm


def full_lora(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """The whole adapter (or its gradient) under PEFT's names: DTensor shards gathered with `full_tensor()`,
    replicated tensors as they are. Every rank takes part; the result is the same on every rank."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" not in name:
            continue
        t = (p.grad if grads else p).detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t
        out[name.replace(".default", "")] = t.cpu().contiguous()
    return out


def main() -> None:
    args = parse_args()
    # ---- process group: one process per GPU; all of them form one tensor-parallel group, whose degree must deal
    # out whole heads (refused from the config before the data, the group or any weight: `prepare.start_ranks`).
    device, splits = prepare.start_ranks(args, tp=int(os.environ["WORLD_SIZE"]))
    rank, tp = dist.get_rank(), dist.get_world_size()
    # TP does not split the batch: data-parallel degree 1, every rank runs every micro-batch.
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=1)
    dtype = cli.torch_dtype(args.dtype)
    run_dir, resume_from = ranks.on_rank0(rundir.resolve, args)

    # ---- data: every rank builds the same global batches and runs all of them (rank 0 of a world of 1).
    tokenizer, train_set, val_set, train_stats = prepare.encode_data(args, splits)
    batches = fit.global_batches(args, train_set)
    eval_batches = evaluation.micro_batches(val_set, args.eval_examples, args.micro_batch_size)

    # ---- model: the whole bf16 base and the PEFT LoRA are built on every rank (the same seed, the same init),
    # then each rank keeps its slices. A real-size run would load only its shard; here clarity wins. Checkpointing
    # is non-reentrant: backward recomputes each layer, and with it the layer's forward collectives.
    model = prepare.load_lora_model(args, dtype, device, len(tokenizer))
    checkpoint.seed_dropout(args.seed, stream=0)  # every rank holds the same tokens: the same masks on each
    compiled = compilation.compile_layers(model, args.compile)  # --compile: each decoder layer, in place, before TP
    config = model.config
    token_bytes = config.hidden_size * dtype.itemsize  # a token's activation between blocks, for the comm theory
    # bf16 compute (autocast casts the fp32 adapter weights, DTensor shards included), fp32 master weights.
    model = lora.adapters_compute_in(model, dtype)
    peft_config = model.peft_config["default"]
    n_lora = models.parameter_counts(model)["trainable"]  # the whole adapter, for the FLOP count
    # ---- tensor parallel: each decoder layer's projections (and their adapters) become DTensors sharded over
    # the mesh. Heads per rank need no config change: Qwen3Attention reshapes q/k/v with view(..., -1, head_dim),
    # so a rank whose q_proj returns heads/N * head_dim features runs heads/N heads (and kv_heads/N KV heads).
    # A 1-D device mesh: all ranks form the one tensor-parallel dimension the plan's DTensors are placed on.
    mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
    plan = naive_plan() if args.naive_plan else lora_aware_plan()
    for layer in model.base_model.model.model.layers:
        parallelize_module(layer, mesh, plan)
    for name, p in model.named_parameters():  # the plan must not make a frozen weight trainable
        p.requires_grad_("lora_" in name)
    metrics.release_cached_memory(device)  # the whole model this rank built, but its slices, back to the driver
    counts = models.parameter_counts(model)
    ranks.print0(f"parameters (whole model): {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen")

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optim.adamw_cosine(trainable, args)

    # ---- resume: the adapter's DTensor shards and replicated tensors and the optimizer state (each rank reads its
    # own pieces with torch.distributed.checkpoint), the scheduler and each rank's RNG.
    start_step = checkpoint.load_sharded(resume_from, model, optimizer, scheduler)  # 0 without --resume

    log = rundir.start_log(
        args, run_dir, device, train_stats, counts, accum, start_step, resume_from, config, n_lora, tensor_parallel=tp
    )
    recorder = comm.CommRecorder(device)

    # ---- train
    model.train()
    last_step = args.stop_after or args.max_steps
    with StepProfiler(args.profile_steps, run_dir, device, rank, start_step=start_step) as profiler:
        for step in range(start_step, last_step):
            metrics.reset_peak_memory(device)
            n_target = batches.n_target(step)  # the whole global batch's target tokens, on every rank
            loss_sum = torch.zeros((), device=device)
            evals = (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps
            # DTensor redistributes through functional collectives, which `comm.recording` cannot see; the
            # dispatch mode that does costs Python work on every op, so it runs on sampled steps only.
            sampled = args.comm_every_step or step == start_step or evals
            with metrics.StepTimer(device) as timer:
                with comm.recording_functional(recorder) if sampled else contextlib.nullcontext():
                    for mb in batches.micro_batches(step, args.micro_batch_size):
                        mb = batching.to_device(mb, device)
                        try:
                            with lora.compute_autocast(device, dtype):
                                logits = lora.answer_logits(model, mb)  # the lm_head on the answer positions only
                        except RuntimeError as e:
                            if not args.naive_plan:
                                raise
                            raise errors.RunError(
                                f"--naive-plan: the forward failed, as it must: {e}. The base layers return 1/{tp} "
                                "of their features (or a partial sum) on each rank, the unsharded LoRA branch returns "
                                "all of them, and PEFT adds the two. Shard the adapters like their base (the default "
                                "plan)."
                            ) from e
                        loss = batching.token_loss_sum(logits, mb["targets"]) / n_target
                        del logits  # freed by backward, not kept alive into the next forward
                        loss.backward()  # the same loss on every rank: no scaling by the world size
                        loss_sum += loss.detach()
                if args.dump_grads and step == 2:
                    rundir.dump_grads(full_lora(model, grads=True), run_dir, rank)
                grad_norm = clip_grads(trainable, args.max_grad_norm)
                lr = optim.optimizer_step(optimizer, scheduler)  # AdamW on this rank's shards; the rate it ran at
            # The step's one host sync: every device scalar the metrics need, copied together.
            loss_value, grad_norm = metrics.host_values(loss_sum, grad_norm)
            step_comm = recorder.take()
            row = log.row(
                step=step + 1,
                loss=loss_value,  # every rank computed the whole batch's loss
                grad_norm=grad_norm,
                lr=lr,
                target_tokens=n_target,
                lengths=batches.lengths(step),  # real tokens of the global batch, all ranks: known on the host
                seconds=timer.seconds,
                activation_bytes=batches.padded_tokens(step, args.micro_batch_size) * token_bytes,
                **batches.layout(step, args.micro_batch_size),  # micro-steps, the share of positions padded
                **({"comm": step_comm} if sampled else {}),
            )
            if evals:
                sums = evaluation.loss_sums(model, eval_batches, device, dtype)  # the same on every rank
                row["eval_loss"] = (sums[0] / sums[1]).item()
            log.log(row)
            if (step + 1) % args.save_every == 0 or step + 1 == args.stop_after:
                checkpoint.save_sharded(run_dir, step + 1, model, optimizer, scheduler, args)
            profiler.step(step + 1)
    log.close()

    # ---- save: the shards reassembled into one stock PEFT adapter
    finished = last_step == args.max_steps
    adapter = full_lora(model) if finished else None
    if args.dump_logits and finished:
        rundir.dump_logits(model, eval_batches[0], device, run_dir / "logits.pt", rank, dtype)
    if rank != 0:
        return
    if finished:
        checkpoint.save_adapter(run_dir / "adapter", adapter, peft_config)
    summary = log.run_summary(
        last_step,
        predicted=metrics.predicted_memory(config, args, "tp", world_size=tp),
        note=metrics.memory_note(device),
        compile=compilation.compile_report(compiled),
        # Theory: RowwiseParallel all-reduces the partial outputs of o_proj and down_proj (and of their lora_A) in
        # forward; every ColwiseParallel module all-reduces the gradient of its own replicated input in backward:
        # q, k, v, gate, up (and their lora_B), one each (`comm.tp_all_reduce_theory`).
        theory_comm_bytes_per_step=comm.tp_all_reduce_theory(config, args, log.rows, tp),
        **comm.summarize(log.rows),
        comm_note=comm.NOTES["tp-ft"],
    )
    rundir.finish(args, run_dir, summary, finished)


if __name__ == "__main__":
    ranks.launch(main)
