"""FSDP LoRA: finetune Qwen3-4B with LoRA on a frozen bf16 (or 4-bit) base, every weight sharded over the GPUs (FSDP2).

The single-GPU step (with --quant none), split across GPUs: every rank runs its share of the global batch, as in
DDP, but holds only 1/N of every parameter. Each decoder layer is an FSDP unit: its shards are all-gathered just
before the layer runs and freed after it, and its gradients are reduce-scattered so that each rank keeps the
gradient of its own shard (ZeRO-3, Rajbhandari et al. 2020, arXiv 1910.02054; FSDP, Zhao et al. 2023, arXiv
2304.11277):
    uv run torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py                    # Qwen3-4B, 2 GPUs, NCCL
    uv run torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py --smoke            # CPU
    uv run torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py --quant nf4        # QLoRA, the 4-bit base sharded
    uv run torchrun --nproc_per_node=2 experiments/fsdp-ft/train.py --smoke --wrap-class LlamaDecoderLayer  # a trap

One optimizer step = one global batch of --batch-size sequences, run as --batch-size / (--micro-batch-size x
ranks) micro-batches per rank whose gradients accumulate unsharded (no reduce-scatter on the inner micro-steps)
and are reduce-scattered once. The loss is the sum of token losses divided by the target tokens of the *whole*
global batch, on every rank, so the reduced gradient is the gradient of the one big batch. The flags under
"silent failures" reproduce FSDP setups that run without an error and cost memory or precision; each run's
summary measures the symptom.
"""

from __future__ import annotations

from statistics import mean

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

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
    p = cli.common_parser(__doc__.splitlines()[0], experiment="fsdp-ft")
    p.add_argument(
        "--quant",
        choices=["none", "nf4"],
        default="none",
        help="none: LoRA on a bf16/fp32 base; nf4: QLoRA, the 4-bit base sharded as uint8 bytes (every rank "
        "quantizes the checkpoint itself)",
    )
    g = p.add_argument_group("FSDP2")
    g.add_argument(
        "--wrap-class",
        default="Qwen3DecoderLayer",
        help="the module class that becomes an FSDP unit of its own; the root unit takes everything else",
    )
    g.add_argument(
        "--param-dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="dtype the shards are all-gathered and computed in (the adapters' fp32 master copy stays fp32) "
        "[default: --dtype]",
    )
    g.add_argument(
        "--reduce-dtype", choices=["bf16", "fp32"], default="fp32", help="dtype of the gradient reduce-scatter"
    )
    g.add_argument(
        "--output-dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="cast each unit's outputs to this dtype [default: no cast]",
    )
    g.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        help="keep each layer unsharded from its forward to its backward (ZeRO-2-like: one all-gather per "
        "micro-step instead of two, the whole model unsharded at the end of forward)",
    )
    g.add_argument(
        "--prefetch",
        type=int,
        default=1,
        help="layers whose all-gather is issued ahead of the one running; 1: FSDP2's implicit prefetch",
    )
    g.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep the shards, gradients and optimizer step on the CPU; copy to the GPU per unit",
    )
    m = p.add_argument_group("silent failures (each runs without an error; the summary measures the symptom)")
    m.add_argument(
        "--adapters-in-base-dtype",
        action="store_true",
        help="cast the LoRA adapters to the base dtype before sharding, so the optimizer updates bf16 weights",
    )
    m.add_argument(
        "--use-cache",
        action="store_true",
        help="leave the KV cache on in training (with checkpointing transformers drops it; without, every layer's "
        "keys and values are kept in a cache the step never reads: memory, the same logits)",
    )
    m.add_argument(
        "--count-lost-updates",
        action="store_true",
        help="measure the symptom of --adapters-in-base-dtype each step: the adapter elements the optimizer step "
        "left unchanged (costs a copy of every trainable shard per step; on by itself with that flag)",
    )
    args = cli.resolve(p.parse_args())
    if args.quant == "nf4":  # FSDP2 would treat a float storage of the 4-bit bytes as numbers: refused before the load
        models.check_4bit_storage(models.bnb_config(cli.torch_dtype(args.dtype)))
    if args.quant == "nf4" and args.cpu_offload:
        raise errors.RunError(
            "--quant nf4 --cpu-offload: not supported yet. The 4-bit shards would go to the host, each layer's "
            "quantization state (not a parameter) stays on the GPU; no GPU run has checked that, and a CPU test "
            "cannot. Drop --cpu-offload: a 4-bit base's shards are a quarter of bf16's already."
        )
    if args.prefetch < 1:
        raise errors.RunError(f"--prefetch must be at least 1 (FSDP2's implicit prefetch), got {args.prefetch}")
    args.param_dtype = args.param_dtype or args.dtype
    args.count_lost_updates = args.count_lost_updates or args.adapters_in_base_dtype
    return args


def fsdp_units(model, wrap_class: str) -> list[torch.nn.Module]:
    """The modules that become FSDP units of their own, by class name as in FSDP1's transformer_auto_wrap_policy.
    A name that matches nothing is not an error to FSDP: the root unit then holds the whole model."""
    return [m for m in model.modules() if type(m).__name__ == wrap_class]


def shard_model(model, args, device: torch.device, world: int) -> list[torch.nn.Module]:
    """FSDP2: one unit per decoder layer (--wrap-class), then the root (embeddings, final norm, the tied lm_head);
    returns the layer units. `model` is built and PEFT-wrapped, on any device (the meta device included: sharding
    only splits shapes). ftkit.realscale runs this same function on fake tensors at Qwen3-4B's shape."""
    # Sharding after PEFT wrapping puts each layer's frozen base weights and its trainable LoRA matrices in one unit:
    # FSDP2 shards each parameter on its own (a DTensor per parameter), so mixed requires_grad is fine, and it
    # only demands one dtype among the *trainable* parameters of a unit (the fp32 adapters; the frozen bf16 base
    # may differ). MixedPrecisionPolicy's roles: param_dtype is what the all-gather sends and the layer
    # computes in, reduce_dtype what the gradient reduce-scatter sends, output_dtype a cast of each unit's
    # outputs; the optimizer always steps the sharded originals (fp32 adapters).
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(
        param_dtype=cli.torch_dtype(args.param_dtype),
        reduce_dtype=cli.torch_dtype(args.reduce_dtype),
        output_dtype=cli.torch_dtype(args.output_dtype) if args.output_dtype else None,
    )
    fsdp_kwargs = {"mesh": mesh, "mp_policy": policy}
    if args.cpu_offload:
        # Pinned host memory lets the copies overlap compute on a GPU; in --smoke (the same code path, the CPU both
        # sides) there is no GPU to pin for.
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    units = fsdp_units(model, args.wrap_class)
    if not units:
        ranks.print0(
            f"warning: no module of class {args.wrap_class}: the root unit holds (and all-gathers) the whole model"
        )
    for unit in units:
        fully_shard(unit, reshard_after_forward=args.reshard_after_forward, **fsdp_kwargs)
    # The root, left at FSDP2's default for it: not resharded after forward, since backward starts with it (the
    # lm_head) right away. With reshard_after_forward=True it would be all-gathered twice per micro-step.
    fully_shard(model, **fsdp_kwargs)
    if args.prefetch > 1:
        # Issue the all-gathers of the next k layers while this one runs (forward) or of the previous k (backward):
        # more overlap, k+1 layers unsharded at once instead of 2.
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + args.prefetch])
            unit.set_modules_to_backward_prefetch(units[max(0, i - args.prefetch) : i][::-1])
    return units


def main() -> None:
    args = parse_args()
    # ---- process group: torchrun starts one process per GPU and tells each its rank (RANK, LOCAL_RANK,
    # WORLD_SIZE) and where rank 0 listens (MASTER_ADDR/PORT). The downloads come first (`prepare.start_ranks`),
    # then the group, "cpu:gloo,cuda:nccl" on GPUs: NCCL for CUDA tensors, gloo for CPU ones (a metric, an
    # offloaded grad norm).
    device, splits = prepare.start_ranks(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=world)
    dtype = cli.torch_dtype(args.dtype)
    # Rank 0 names the run directory (its clock, its checks) and every rank uses that one.
    run_dir, resume_from = ranks.on_rank0(rundir.resolve, args)

    # ---- data: AMI examples in Qwen3's chat format, loss only on the answer, length-grouped global batches.
    # Every rank builds the same global batches (a function of seed and step) and takes its own share of each.
    tokenizer, train_set, val_set, train_stats = prepare.encode_data(args, splits)
    # Packed: rows of up to --max-length holding several examples each (--no-packing: one padded example per row).
    batches = fit.global_batches(args, train_set)
    # An evaluation forward all-gathers every unit, a collective: every rank must run as many micro-batches.
    eval_batches = evaluation.micro_batches(val_set, args.eval_examples, args.micro_batch_size, rank, world, even=True)

    # ---- model: rank 0 loads the real weights into CPU memory, the other ranks build it on the meta device (no
    # storage); after sharding, rank 0 broadcasts the weights and each rank keeps its shard: no GPU ever holds the
    # whole model, and only rank 0's host memory holds it, once. The attention kernel is the training device's.
    # QLoRA (--quant nf4): bitsandbytes quantizes as it loads, and a meta model cannot become Linear4bit layers, so
    # every rank quantizes the checkpoint itself (the same bytes everywhere) and sharding keeps its 1/N of them.
    attn = models.attention_implementation(device, dtype)
    with ranks.rank0_first():
        model = models.load_model(
            args.model,
            quant=args.quant,
            dtype=dtype,
            device=device if args.quant == "nf4" else torch.device("cpu" if rank == 0 else "meta"),
            seed=args.seed,
            vocab_size=len(tokenizer),
            attn=attn,
        )
    config = model.config
    if args.use_cache:
        config.use_cache = True
    if args.grad_checkpointing:
        # Non-reentrant: transformers checkpoints each layer's forward, not its __call__, so FSDP2's hooks stay
        # outside the checkpoint and the recomputation in backward does not all-gather the layer a third time.
        lora.checkpoint_activations(model, checkpointing=args.checkpointing)
    model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
    checkpoint.seed_dropout(args.seed, stream=rank)  # each rank's examples differ, and so do its dropout masks
    # --compile: each decoder layer, in place, before FSDP2; eager on a 4-bit base, saying why (cli.eager_because)
    compiled = compilation.compile_layers(model, args.compile, eager_because=cli.eager_because(args))
    if args.adapters_in_base_dtype:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype)
    counts = models.parameter_counts(model)
    ranks.print0(f"parameters: {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen")
    broadcast = args.quant == "none"  # nf4: every rank holds the weights already
    full_weights = model.state_dict() if rank == 0 and broadcast else {}

    # ---- FSDP2 (shard_model, above): every parameter becomes this rank's 1/N shard (a DTensor), on the meta
    # device too, where only the shapes are split.
    units = shard_model(model, args, device, world)
    if broadcast:
        if rank != 0:
            # Storage for the shards (and the RoPE buffers, recomputed below): offloaded shards live in host memory.
            model.to_empty(device="cpu" if args.cpu_offload else device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full_weights, options=options)
        del full_weights
        # The RoPE frequencies are a non-persistent buffer: not in the state dict, so compute them on every rank.
        inner = model.base_model.model.model
        inner.rotary_emb = type(inner.rotary_emb)(config).to(device)

    # What each rank now holds: its shard of every parameter, and what one unit needs unsharded at once.
    param_bytes = comm.nbytes([p.to_local() for p in model.parameters()])
    unit_bytes = [comm.gathered_bytes(u.parameters(), cli.torch_dtype(args.param_dtype)) for u in [*units, model]]
    unit_bytes[-1] -= sum(unit_bytes[:-1])  # the root unit: what no layer unit took
    ranks.print0(
        f"FSDP units: {len(units)} x {args.wrap_class} + root; per-rank parameter shards: {param_bytes:,} bytes"
    )

    recorder = comm.CommRecorder(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optim.adamw_cosine(trainable, args)
    # ---- resume: the sharded adapter + optimizer state (each rank reads its own pieces with
    # torch.distributed.checkpoint), the scheduler and each rank's RNG; the data position is the step itself.
    start_step = checkpoint.load_sharded(resume_from, model, optimizer, scheduler, any_world=True)  # 0 without --resume

    log = rundir.start_log(args, run_dir, device, train_stats, counts, accum, start_step, resume_from, config)

    # ---- train
    model.train()
    last_step = args.stop_after or args.max_steps
    kv_cache_bytes = 0
    with StepProfiler(args.profile_steps, run_dir, device, rank, start_step=start_step) as profiler:
        for step in range(start_step, last_step):
            metrics.reset_peak_memory(device)
            n_target = batches.n_target(step)  # the global batch's target tokens: the same on every rank, no collective
            loss_sum = torch.zeros((), device=device)
            micro_batches = batches.micro_batches(step, args.micro_batch_size, rank=rank, world=world)
            with metrics.StepTimer(device) as timer, comm.recording(recorder):
                for j, mb in enumerate(micro_batches):
                    mb = batching.to_device(mb, device)
                    # Accumulate the unsharded gradients locally and reduce-scatter once, in the last micro-batch's
                    # backward (FSDP2's no_sync). The all-gathers still happen on every micro-batch.
                    model.set_requires_gradient_sync(j == len(micro_batches) - 1)
                    # The lm_head at the answer positions only; packed rows kept apart by the kernel's boundaries.
                    out = model(
                        **attention.model_inputs(mb, config),  # ids, positions, the examples' boundaries
                        logits_to_keep=mb["logit_positions"],
                        use_cache=args.use_cache,
                    )
                    if args.use_cache and out.past_key_values is not None:
                        kv_cache_bytes = metrics.kv_cache_bytes(out.past_key_values)
                    loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
                    del out  # the logits (and a KV cache) are freed by backward, not kept into the next forward
                    # FSDP2's reduce-scatter *averages* the gradients over the ranks (it divides by the world size,
                    # as DDP does; set_gradient_divide_factor would change that). This rank's loss is its share of
                    # the global loss, so the gradient we want is the *sum* over ranks: scale by the world size.
                    (loss * world).backward()
                    loss_sum += loss.detach()
                # Each rank holds only its shard of each gradient: clip_grad_norm_ sums the squares of the local
                # shards and all-reduces them (DTensor's own collective), so the norm is the global one.
                clip = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable, clip)
                before = [p.to_local().detach().clone() for p in trainable] if args.count_lost_updates else None
                lr_used = optimizer.param_groups[0]["lr"]
                optimizer.step()  # on the shards: each rank updates its 1/N of the adapters and of AdamW's moments
                # Adapter elements with a gradient that the step left bit-identical: an update below half the
                # spacing of the weight's dtype is rounded away (the symptom of --adapters-in-base-dtype: bf16 keeps
                # 8 bits). Warmup's first step has lr 0 and updates nothing by design: not counted.
                lost = torch.zeros((), device=device)
                if before is not None and lr_used > 0:
                    for p, b in zip(trainable, before):
                        lost += ((p.to_local() == b) & (p.grad.to_local() != 0)).sum()
                lr = scheduler.get_last_lr()[0]  # the rate this step ran at (step() sets the next one's)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step_comm = recorder.take()
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            # The global loss (and lost updates) are sums of the ranks' shares: one small all-reduce on the device,
            # then the step's one host sync for every device scalar the metrics need.
            totals = torch.stack([loss_sum, lost])
            dist.all_reduce(totals)
            global_loss, lost, grad_norm = metrics.host_values(*totals, grad_norm)
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
            if args.count_lost_updates:
                row["lost_update_fraction"] = lost / counts["trainable"]
            if args.use_cache:
                row["kv_cache_bytes"] = kv_cache_bytes
            if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
                # Each rank evaluates its share of the held-out set, through FSDP (the forward all-gathers); sum.
                sums = evaluation.loss_sums(model, eval_batches, device)
                model.reshard()  # FSDP2 keeps the root unsharded after a forward without backward: free it
                dist.all_reduce(sums)
                row["eval_loss"] = (sums[0] / sums[1]).item()
            log.log(row)
            if (step + 1) % args.save_every == 0 or step + 1 == args.stop_after:
                # Every rank writes its own shards (torch.distributed.checkpoint); storage all ranks see.
                checkpoint.save_sharded(run_dir, step + 1, model, optimizer, scheduler, args)
            profiler.step(step + 1)
    log.close()

    # ---- save: a stock PEFT adapter (adapter_config.json + adapter_model.safetensors), gathered onto rank 0's CPU
    # (a collective: every rank takes part) and written there
    finished = last_step == args.max_steps
    if finished:
        checkpoint.save_fsdp_adapter(run_dir / "adapter", model)
    if rank != 0:
        return
    theory = comm.fsdp_theory(  # per micro-step: a step all-gathers as often as it has micro-steps
        sum(unit_bytes),
        sum(unit_bytes[:-1]),
        1,
        args.reshard_after_forward,
        counts["trainable"] * cli.torch_dtype(args.reduce_dtype).itemsize,
        world,
    )
    summary = log.run_summary(
        last_step,
        predicted=metrics.predicted_memory(
            config, args, "fsdp", quant=args.quant, world_size=world, reshard_after_forward=args.reshard_after_forward
        ),
        note=metrics.memory_note(device, "param_shard_bytes (exact) and "),
        compile=compilation.compile_report(compiled),
        fsdp_units=len(units) + 1,
        # Measured on rank 0 after sharding: the bytes of its parameter shards, and the largest unit that is
        # all-gathered at once (in --param-dtype).
        param_shard_bytes=param_bytes,
        largest_unit_bytes=max(unit_bytes),
        # What theory says FSDP2 sends, bytes of the full (gathered) buffers (`comm.fsdp_theory`): the all-gathers
        # per micro-step, and per step at the run's mean micro-steps (packed steps have as many as their rows need)
        theory_all_gather_bytes_per_micro_step=theory["all_gather"],
        theory_all_gather_bytes=round(theory["all_gather"] * mean(r["micro_batches"] for r in log.rows)),
        theory_reduce_scatter_bytes=theory["reduce_scatter"],
        **comm.summarize(log.rows),
        comm_note=comm.NOTES["fsdp-ft"],
        lost_updates_note="lost_update_fraction per step only with --count-lost-updates or "
        "--adapters-in-base-dtype (it copies every trainable shard each step)",
    )
    if args.use_cache:
        summary["kv_cache_bytes"] = kv_cache_bytes
    rundir.finish(args, run_dir, summary, finished)


if __name__ == "__main__":
    ranks.launch(main)
