"""DDP QLoRA: finetune Qwen3-4B with LoRA on a frozen 4-bit NF4 base, one replica per GPU, gradients all-reduced.

The single-GPU step, split across GPUs: every rank holds the whole model and runs its share of the global batch,
and DistributedDataParallel averages the LoRA gradients over the ranks during backward:
    uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py                    # Qwen3-4B, 2 GPUs, NCCL
    uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py --smoke            # CPU, gloo
    uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py --smoke --sync-every-micro-step  # a misconfiguration

One optimizer step = one global batch of --batch-size sequences, packed into rows of up to --max-length and run
as micro-batches of --micro-batch-size rows per rank (with --no-packing, --batch-size / (--micro-batch-size x
ranks) of them) whose gradients accumulate locally (`no_sync`) and are all-reduced once. The loss
is the sum of token losses divided by the target tokens of the *whole* global batch, on every rank, so the
averaged gradient is the gradient of the one big batch - not an average of per-rank means, which would weight
the rank with the short answers more. The flags under "misconfigurations" reproduce common ways to set DDP up
worse than it should be; each run's summary records what they send and cost.
"""

from __future__ import annotations

import contextlib
import os

import safetensors.torch
import torch
import torch.distributed as dist
from peft import set_peft_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from ftkit import (
    attention,
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
    p = cli.common_parser(__doc__.splitlines()[0], experiment="ddp-ft")
    p.add_argument(
        "--quant",
        choices=["nf4", "none"],
        default="nf4",
        help="nf4: QLoRA (4-bit NF4 base, double quant); none: LoRA on a bf16/fp32 base",
    )
    g = p.add_argument_group("DDP")
    g.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="gradient bucket size in MiB: each bucket is all-reduced as soon as its gradients are ready "
        "[DDP's default: 25, with a 1 MiB first bucket]",
    )
    g.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="make .grad views into the buckets: saves a copy of the gradients in memory and a copy per step",
    )
    g.add_argument(
        "--static-graph",
        action="store_true",
        help="promise DDP the same graph every step: it records the first and stops checking; lets reentrant "
        "checkpointing work with --find-unused-parameters; refused with accumulation (a PyTorch bug)",
    )
    m = p.add_argument_group("misconfigurations (devlogs/ddp-ft.md measures what each costs; none changes the math)")
    m.add_argument(
        "--sync-every-micro-step",
        action="store_true",
        help="all-reduce after every micro-batch instead of once per optimizer step (no no_sync)",
    )
    m.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="search the autograd graph after every syncing forward (the step's last micro-batch) for parameters "
        "without gradients (there are none)",
    )
    m.add_argument(
        "--reentrant-checkpointing",
        action="store_true",
        help="the old reentrant activation checkpointing, which runs a backward inside the backward; DDP refuses it "
        "with --find-unused-parameters unless --static-graph",
    )
    args = cli.resolve(p.parse_args())
    if args.bucket_cap_mb is not None and args.bucket_cap_mb <= 0:
        raise errors.RunError(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    return args


def main() -> None:
    args = parse_args()
    # ---- process group: torchrun starts one process per GPU and tells each its rank (RANK, LOCAL_RANK,
    # WORLD_SIZE) and where rank 0 listens (MASTER_ADDR/PORT).
    ranks.torchrun_local_rank()  # launched by torchrun, or stopped with the command that launches it
    world = int(os.environ["WORLD_SIZE"])
    # Flags that do not fit the world size are refused before joining the group, on every rank alike: a rank that
    # left during the group's setup would leave the others with a connection error instead of this message.
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=world)
    if args.static_graph and accum > 1 and not args.sync_every_micro_step:
        # DDP(static_graph=True) fails an internal assert in the first backward under no_sync(), a regression
        # still open in this PyTorch (pytorch/pytorch#143580; the fix, PR #187732, reports that with the assert
        # removed it stops all-reducing after the first step).
        raise errors.RunError(
            f"--static-graph does not work with gradient accumulation (no_sync) in PyTorch (pytorch/pytorch#143580);"
            f" here accumulation is {accum}: pass --batch-size {args.micro_batch_size * world} or drop --static-graph"
        )
    # The downloads come first (`prepare.start_ranks`), then the group, "cpu:gloo,cuda:nccl" on GPUs: NCCL for
    # CUDA tensors, gloo for CPU ones (a metric, a pickled object).
    device, splits = prepare.start_ranks(args)
    rank = dist.get_rank()
    dtype = cli.torch_dtype(args.dtype)
    # Rank 0 names the run directory (its clock, its checks) and every rank uses that one.
    run_dir, resume_from = ranks.on_rank0(rundir.resolve, args)

    # ---- data: AMI examples in Qwen3's chat format, loss only on the answer, length-grouped global batches.
    # Every rank builds the same global batches (a function of seed and step) and takes its own share of each.
    tokenizer, train_set, val_set, train_stats = prepare.encode_data(args, splits)
    # Packed: rows of up to --max-length holding several examples each (--no-packing: one padded example per row).
    batches = fit.global_batches(args, train_set)
    eval_batches = evaluation.micro_batches(val_set, args.eval_examples, args.micro_batch_size, rank, world)

    # ---- model: frozen base (4-bit NF4 for QLoRA) + trainable LoRA on all seven projections, on this rank's device
    with ranks.rank0_first():
        model = models.load_model(
            args.model, quant=args.quant, dtype=dtype, device=device, seed=args.seed, vocab_size=len(tokenizer)
        )
    config = model.config
    # Non-reentrant checkpointing recomputes a layer inside the one backward pass, so DDP's per-parameter hooks
    # fire once, in order. The reentrant kind runs a nested backward per layer (--reentrant-checkpointing).
    model = lora.freeze_base(model, args.checkpointing, reentrant=args.reentrant_checkpointing)
    model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
    checkpoint.seed_dropout(args.seed, stream=rank)  # each rank's examples differ, and so do its dropout masks
    compiled = compilation.compile_layers(model, args.compile)  # --compile: each decoder layer, in place, before DDP
    model = lora.adapters_compute_in(model, dtype)  # bf16 compute (autocast), fp32 weights: as single-gpu-ft
    counts = models.parameter_counts(model)
    ranks.print0(f"parameters: {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen")

    # ---- DDP: at construction rank 0's parameters and buffers are broadcast, so the replicas start identical.
    # DDP registers a hook on every trainable parameter; the LoRA gradients are packed into buckets, and each
    # bucket is all-reduced as soon as its last gradient is computed, while backward goes on with the earlier
    # layers: communication overlaps computation (Li et al. 2020, "PyTorch Distributed", arXiv 2006.15704).
    # The frozen 4-bit base has no gradients and sends nothing. Its only buffers are RoPE frequencies, constant,
    # so there is nothing to re-broadcast before every forward (forward_sync_buffers=False).
    model = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
        find_unused_parameters=args.find_unused_parameters,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        static_graph=args.static_graph,
        **comm.ddp_no_forward_buffer_sync(),  # forward_sync_buffers=False (broadcast_buffers on torch 2.11)
    )
    # The comm hook does what DDP's built-in reducer does (average each bucket with one all-reduce) and records
    # each bucket's bytes and time for the metrics (ftkit/comm.py).
    recorder = comm.CommRecorder(device)
    comm.register_ddp_hook(model, recorder)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optim.adamw_cosine(trainable, args)

    # ---- resume: adapter, optimizer, scheduler and each rank's RNG; the data position is the step itself.
    # Every rank reads the checkpoint rank 0 wrote, so a multi-node run needs the run directory on shared storage.
    # The replicas are whole, so any number of ranks can continue a run (only the dropout RNG streams then differ).
    start_step = 0
    if resume_from is not None:
        state = checkpoint.read_state(resume_from, ("adapter/adapter_model.safetensors", "optimizer.pt"))
        try:
            weights = safetensors.torch.load_file(resume_from / "adapter" / "adapter_model.safetensors")
        except Exception as e:
            raise errors.CheckpointError(f"{resume_from}/adapter: corrupt adapter ({e})") from e
        set_peft_model_state_dict(model.module, weights)
        opt = checkpoint.load_torch(resume_from / "optimizer.pt")
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        checkpoint.restore_rng(resume_from, state, rank, world)
        start_step = state["step"]

    log = rundir.start_log(args, run_dir, device, train_stats, counts, accum, start_step, resume_from, config)

    def save_checkpoint(step: int) -> None:
        # The replicas are identical, so rank 0 saves the adapter and optimizer; only the RNG differs per rank.
        rng = [None] * world if rank == 0 else None
        dist.gather_object(checkpoint.rng_state(), rng, dst=0)
        if rank == 0:
            tmp = checkpoint.staging_dir(run_dir, step)
            model.module.save_pretrained(tmp / "adapter", save_embedding_layers=False)
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
            for r, state in enumerate(rng):
                torch.save(state, tmp / f"rng-rank{r}.pt")
            checkpoint.commit(tmp, step, {"seed": args.seed, "world_size": world}, args.keep_checkpoints)
        dist.barrier()  # no rank goes on (or exits, with --stop-after) before the checkpoint is complete

    # ---- train
    model.train()
    last_step = args.stop_after or args.max_steps
    with StepProfiler(args.profile_steps, run_dir, device, rank, start_step=start_step) as profiler:
        for step in range(start_step, last_step):
            metrics.reset_peak_memory(device)
            # Target tokens of the whole global batch, all ranks together: the loss denominator. Every rank
            # computes the same number from the same global batch, without a collective.
            n_target = batches.n_target(step)
            loss_sum = torch.zeros((), device=device)
            micro_batches = batches.micro_batches(step, args.micro_batch_size, rank=rank, world=world)
            with metrics.StepTimer(device) as timer:
                for j, mb in enumerate(micro_batches):
                    mb = batching.to_device(mb, device)
                    # Accumulate locally and all-reduce once, in the last micro-batch's backward: no_sync()
                    # switches the reducer off for both the forward and the backward of the micro-batches before.
                    sync = j == len(micro_batches) - 1 or args.sync_every_micro_step
                    with contextlib.nullcontext() if sync else model.no_sync():
                        # The lm_head at the answer positions only; packed rows kept apart by the kernel's boundaries.
                        with lora.compute_autocast(device, dtype):
                            out = model(
                                **attention.model_inputs(mb, config),  # ids, positions, the examples' boundaries
                                logits_to_keep=mb["logit_positions"],
                                use_cache=False,
                            )
                            loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
                        del out  # the logits are freed by backward, not kept alive into the next forward
                        # DDP *averages* the gradients over the ranks. This rank's loss is its share of the global
                        # loss, so the gradient we want is the *sum* over ranks: scale by the world size.
                        (loss * world).backward()
                    loss_sum += loss.detach()
                # The gradients are identical on every rank now, so is their norm: clipping needs no collective.
                clip = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable, clip)
                optimizer.step()
                lr = scheduler.get_last_lr()[0]  # the rate this step ran at (step() sets the next one's)
                scheduler.step()
                # Gradients as bucket views are zeroed in place: set to None, the next backward would allocate
                # new .grad tensors and DDP would copy them into the buckets again, which is what the views avoid.
                optimizer.zero_grad(set_to_none=not args.gradient_as_bucket_view)
            # The global loss is the sum of the ranks' shares: one small all-reduce on the device, then the
            # step's one host sync for every device scalar the metrics need.
            dist.all_reduce(loss_sum)
            global_loss, grad_norm = metrics.host_values(loss_sum, grad_norm)
            step_comm = recorder.take()
            row = log.row(
                step=step + 1,
                loss=global_loss,
                grad_norm=grad_norm,
                lr=lr,
                target_tokens=n_target,
                lengths=batches.lengths(step),  # real tokens of the global batch, all ranks: known on the host
                seconds=timer.seconds,
                comm=step_comm,
                **batches.layout(step, args.micro_batch_size, rank, world),  # micro-steps, share of positions padded
            )
            if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
                # Each rank evaluates its share of the held-out set on the bare model (no DDP hooks); sum them.
                sums = evaluation.loss_sums(model.module, eval_batches, device, dtype)
                dist.all_reduce(sums)
                row["eval_loss"] = (sums[0] / sums[1]).item()
            log.log(row)
            if (step + 1) % args.save_every == 0 or step + 1 == args.stop_after:
                save_checkpoint(step + 1)
            profiler.step(step + 1)
    log.close()

    # ---- save: a stock PEFT adapter (adapter_config.json + adapter_model.safetensors), from rank 0's replica
    finished = last_step == args.max_steps
    if rank != 0:
        return
    if finished:
        model.module.save_pretrained(run_dir / "adapter", save_embedding_layers=False)
    summary = log.run_summary(
        last_step,
        predicted=metrics.predicted_memory(config, args, "ddp", quant=args.quant, world_size=world),
        note=metrics.memory_note(device),
        compile=compilation.compile_report(compiled),
        # What theory says DDP sends per optimizer step: the trainable gradients, once (once per micro-step with
        # --sync-every-micro-step), in bytes of the buffer; a ring all-reduce puts 2(N-1)/N of that on the wire.
        trainable_grad_bytes=comm.nbytes(trainable),
        syncs_per_step=accum if args.sync_every_micro_step else 1,
        **comm.summarize(log.rows),
        comm_note=comm.NOTES["ddp-ft"],
    )
    rundir.finish(args, run_dir, summary, finished)


if __name__ == "__main__":
    ranks.launch(main)
