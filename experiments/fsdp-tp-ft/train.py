"""FSDP x TP LoRA: tensor parallel inside a node, FSDP across nodes, on one 2-D device mesh.

The ranks form a grid of --mesh-shape DP,TP. Each row is a tensor-parallel group (tp-ft's LoRA-aware plan, the
same function, not a copy): its ranks hold 1/TP of every projection and run the same micro-batches together, so
its collectives (activations, every layer) stay on the fast links inside a node. Each column is an FSDP group
(FSDP2 over the `dp` dimension): its ranks hold 1/DP of their TP slices, run different sequences, all-gather
the weights per layer and reduce-scatter the LoRA gradients, traffic that prefetching can hide across nodes:

                     tp = 0      tp = 1
        dp = 0     [ rank 0 ]  [ rank 1 ]     node 0: one TP group (NVLink)
        dp = 1     [ rank 2 ]  [ rank 3 ]     node 1: another
                       |           |
                   FSDP group  FSDP group     (InfiniBand)

    uv run torchrun --nnodes=2 --nproc_per_node=8 ... experiments/fsdp-tp-ft/train.py   # 2 x 8 GPUs: mesh 2,8
    uv run torchrun --nproc_per_node=4 experiments/fsdp-tp-ft/train.py --smoke --mesh-shape 2,2   # CPU

A mesh config of the form `mesh_shape: [[num_fsdp, num_tp], ["fsdp", "tp"]]` is `--mesh-shape num_fsdp,num_tp`.
The global batch is split over `dp` only: accumulation is --batch-size / (--micro-batch-size x DP), and each TP
group's loss is its share of the global batch's (FSDP's reduce-scatter averages over DP: scaled back by DP).
"""

from __future__ import annotations

import contextlib
import os
from statistics import mean

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from ftkit import (
    batching,
    checkpoint,
    cli,
    comm,
    compilation,
    data,
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

tp_ft = cli.load_experiment("tp-ft")  # its lora_aware_plan


def parse_args():
    p = cli.common_parser(__doc__.splitlines()[0], experiment="fsdp-tp-ft")
    g = p.add_argument_group("2-D mesh")
    g.add_argument(
        "--mesh-shape",
        default=None,
        metavar="DP,TP",
        help="FSDP degree x TP degree = the world size [default: TP = ranks per node, DP = nodes]",
    )
    return cli.resolve(p.parse_args())


def mesh_shape(flag: str | None, world: int, per_node: int) -> tuple[int, int]:
    """(DP, TP) from --mesh-shape, or TP = the ranks of one node and DP = the nodes; refused unless DP x TP is the
    world size."""
    if flag is None:
        return world // per_node, per_node
    try:
        dp, tp = (int(x) for x in flag.split(","))
    except ValueError:
        raise errors.RunError(f"--mesh-shape {flag!r}: expected two integers DP,TP, e.g. --mesh-shape 2,4") from None
    if dp < 1 or tp < 1 or dp * tp != world:
        raise errors.RunError(
            f"--mesh-shape {flag}: DP x TP = {dp * tp} ranks, but torchrun started {world}; the two degrees must "
            f"multiply to the world size (e.g. --mesh-shape {world // per_node},{per_node} on this launch)"
        )
    return dp, tp


def clip_grads(trainable: list[torch.nn.Parameter], max_norm: float, tp: int) -> torch.Tensor:
    """The global gradient norm, and the gradients clipped to `max_norm` (0: not clipped). After FSDP every
    gradient is a DTensor: on the 2-D mesh where TP split the tensor (each rank a distinct piece), on `dp` alone
    where TP left it whole (the TP ranks hold the same pieces). One all-reduce of the squares over all ranks counts
    the latter TP times, hence / TP."""
    device = trainable[0].device
    split = optim.squares_sum([p.grad.to_local() for p in trainable if p.grad.device_mesh.ndim == 2], device)
    whole = optim.squares_sum([p.grad.to_local() for p in trainable if p.grad.device_mesh.ndim == 1], device)
    sq = split + whole / tp
    dist.all_reduce(sq)
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad.to_local() for p in trainable], coef)
    return norm


def main() -> None:
    args = parse_args()
    device = ranks.device_for(args, ranks.torchrun_local_rank())
    ranks.share_cpu_cores(device)
    # Downloads before the group exists: no rank waits in a collective meanwhile (the group's 30-minute timeout).
    models.fetch(args.model)
    # The mesh is checked from the environment and the config, on every rank alike, before the data, the process
    # group or any weight: its product, and a TP degree that deals out whole heads.
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    dp, tp = mesh_shape(args.mesh_shape, world, per_node)
    ranks.check_tp_degree(models.model_config(args.model), tp)
    splits = data.load_splits(args.data, args.data_revision)
    ranks.init_process_group(device)  # "cpu:gloo,cuda:nccl" on GPUs
    rank = dist.get_rank()
    # ---- the 2-D mesh: rank r sits at row r // TP (its FSDP index), column r % TP (its TP index). TP is the
    # inner dimension, so a TP group is TP consecutive ranks: one node's, when TP = ranks per node.
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=dp)
    dtype = cli.torch_dtype(args.dtype)
    run_dir, resume_from = ranks.on_rank0(rundir.resolve, args)

    # ---- data: every rank builds the same global batches; a TP group takes its FSDP index's share of each.
    tokenizer, train_set, val_set, train_stats = prepare.encode_data(args, splits)
    batches = fit.global_batches(args, train_set, mesh={"dp": dp, "tp": tp})
    # Every FSDP forward is a collective: every TP group must run as many eval micro-batches.
    eval_batches = evaluation.micro_batches(val_set, args.eval_examples, args.micro_batch_size, dp_rank, dp, even=True)

    # ---- model: the whole base and the PEFT LoRA built on every rank (the same seed, the same init), as in tp-ft:
    # each GPU holds the whole base until it is sharded (8 GB for Qwen3-4B). A model near a GPU's memory needs
    # fsdp-ft's route instead: rank 0 loads into host memory, the others build on the meta device. Checkpointing
    # is non-reentrant, inside each layer's forward: FSDP's hooks stay outside, the TP collectives are recomputed.
    model = prepare.load_lora_model(args, dtype, device, len(tokenizer))
    checkpoint.seed_dropout(args.seed, stream=dp_rank)  # a TP group's ranks hold the same tokens: one stream per group
    # --compile: each decoder layer, in place, before TP+FSDP
    compiled = compilation.compile_layers(model, args.compile)
    config = model.config
    token_bytes = config.hidden_size * dtype.itemsize  # a token's activation between blocks, for the comm theory
    n_lora = models.parameter_counts(model)["trainable"]  # the whole adapter, for the FLOP count
    # ---- TP first, on the `tp` dimension: each layer's projections and adapters become DTensors split as tp-ft
    # splits them. Then FSDP2 on the `dp` dimension: each layer is a unit whose parameters (the TP slices, and the
    # tensors TP left whole) are sharded once more over the FSDP group, then the root (embeddings, final norm).
    for layer in model.base_model.model.model.layers:
        parallelize_module(layer, mesh["tp"], tp_ft.lora_aware_plan())
    for name, p in model.named_parameters():  # the plan must not make a frozen weight trainable
        p.requires_grad_("lora_" in name)

    def slice_bytes(params) -> int:  # this TP rank's slices, in the dtype FSDP gathers them in
        return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params) * dtype.itemsize

    layer_bytes = sum(slice_bytes(layer.parameters()) for layer in model.base_model.model.model.layers)
    all_bytes = slice_bytes(model.parameters())
    lora_slice = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters() if p.requires_grad
    )
    # The base computes in --dtype; the adapters' fp32 masters are gathered in it too, the gradients reduced in fp32.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    metrics.release_cached_memory(device)  # the whole model this rank built, but its shards, back to the driver
    counts = models.parameter_counts(model)
    ranks.print0(
        f"mesh {dp} x {tp} (dp x tp); parameters: {counts['trainable']:,} trainable, {counts['frozen']:,} frozen"
    )
    shard_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optim.adamw_cosine(trainable, args)
    # Resumed (0 without --resume): each rank reads its own pieces (torch.distributed.checkpoint), the RNG its own.
    start_step = checkpoint.load_sharded(resume_from, model, optimizer, scheduler)

    log = rundir.start_log(
        args, run_dir, device, train_stats, counts, accum, start_step, resume_from, config, n_lora, mesh=[dp, tp]
    )
    # Collectives per mesh dimension: FSDP2 calls torch.distributed on the `dp` group (`comm.recording`), DTensor's
    # TP redistributions are functional collectives on the `tp` group (`comm.recording_functional`, sampled steps).
    dp_recorder, tp_recorder = comm.CommRecorder(device), comm.CommRecorder(device)

    # ---- train
    model.train()
    last_step = args.stop_after or args.max_steps
    with StepProfiler(args.profile_steps, run_dir, device, rank, start_step=start_step) as profiler:
        for step in range(start_step, last_step):
            metrics.reset_peak_memory(device)
            n_target = batches.n_target(step)  # the whole global batch's target tokens, on every rank
            loss_sum = torch.zeros((), device=device)
            evals = (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps
            sampled = step == start_step or evals  # the TP dispatch mode costs Python work per op: sampled steps
            micro_batches = batches.micro_batches(step, args.micro_batch_size, rank=dp_rank, world=dp)
            tp_recording = comm.recording_functional(tp_recorder) if sampled else contextlib.nullcontext()
            with metrics.StepTimer(device) as timer:
                with comm.recording(dp_recorder), tp_recording:
                    for j, mb in enumerate(micro_batches):
                        mb = batching.to_device(mb, device)
                        model.set_requires_gradient_sync(j == len(micro_batches) - 1)  # reduce-scatter once
                        logits = lora.answer_logits(model, mb)
                        loss = batching.token_loss_sum(logits, mb["targets"]) / n_target
                        del logits
                        # This TP group's share of the global loss; FSDP's reduce-scatter averages over the DP
                        # groups, so scale by DP to sum them. Within a TP group every rank has the same loss.
                        (loss * dp).backward()
                        loss_sum += loss.detach()
                grad_norm = clip_grads(trainable, args.max_grad_norm, tp)  # outside the accounting
                lr = optim.optimizer_step(optimizer, scheduler)
            dist.all_reduce(loss_sum, group=dp_group)  # the DP groups' shares of the global loss
            loss_value, grad_norm = metrics.host_values(loss_sum, grad_norm)
            row = log.row(
                step=step + 1,
                loss=loss_value,
                grad_norm=grad_norm,
                lr=lr,
                target_tokens=n_target,
                lengths=batches.lengths(step),
                seconds=timer.seconds,
                comm=dp_recorder.take(),
                activation_bytes=batches.padded_tokens(step, args.micro_batch_size, dp_rank, dp) * token_bytes,
                **batches.layout(step, args.micro_batch_size, dp_rank, dp),  # micro-steps, share of positions padded
                **({"comm_tp": tp_recorder.take()} if sampled else {}),
            )
            if evals:
                sums = evaluation.loss_sums(model, eval_batches, device)
                model.reshard()  # FSDP2 keeps the root unsharded after a forward without backward: free it
                dist.all_reduce(sums, group=dp_group)
                row["eval_loss"] = (sums[0] / sums[1]).item()
            log.log(row)
            if (step + 1) % args.save_every == 0 or step + 1 == args.stop_after:
                checkpoint.save_sharded(run_dir, step + 1, model, optimizer, scheduler, args)
            profiler.step(step + 1)
    log.close()

    # ---- save: the 2-D shards gathered into one stock PEFT adapter on rank 0
    finished = last_step == args.max_steps
    if finished:
        checkpoint.save_fsdp_adapter(run_dir / "adapter", model)
    if rank != 0:
        return
    summary = log.run_summary(
        last_step,
        predicted=metrics.predicted_memory(config, args, "fsdp", world_size=world, tp=tp),
        note=metrics.memory_note(device),
        compile=compilation.compile_report(compiled),
        mesh={"dp": dp, "tp": tp},
        param_shard_bytes=shard_bytes,
        # Theory per optimizer step on the `dp` dimension, bytes of the whole buffers, as in fsdp-ft but of this TP
        # rank's slices: every unit all-gathered per micro-step forward, the layers again in backward; the LoRA
        # gradients reduce-scattered once, in fp32. On `tp`, tp-ft's all-reduces on this TP group's micro-batches.
        # per step at the run's mean micro-steps (packed steps have as many as their rows need); none in a group of one
        theory_all_gather_bytes=round(mean(r["micro_batches"] for r in log.rows) * (all_bytes + layer_bytes))
        * (dp > 1),
        theory_reduce_scatter_bytes=lora_slice * 4 if dp > 1 else 0,
        theory_comm_tp_bytes_per_step=comm.tp_all_reduce_theory(config, args, log.rows, tp, "comm_tp"),
        **comm.summarize(log.rows),
        **comm.summarize(log.rows, key="comm_tp"),
        comm_note=comm.NOTES["fsdp-tp-ft"],
    )
    rundir.finish(args, run_dir, summary, finished)


if __name__ == "__main__":
    ranks.launch(main)
