"""Single-GPU QLoRA: finetune Qwen3-4B with LoRA on a frozen 4-bit NF4 base, on AMI meeting transcripts.

The baseline of the series. Every other experiment computes this same training step, split across GPUs:
    uv run python experiments/single-gpu-ft/train.py                                   # Qwen3-4B, one GPU
    uv run python experiments/single-gpu-ft/train.py --smoke                           # CPU, tiny Qwen3
    uv run python experiments/single-gpu-ft/train.py --quant none    # bf16 LoRA: the FSDP/TP/PP reference

One optimizer step = one global batch of --batch-size sequences, run as micro-batches (of --micro-batch-size
packed or padded rows, or one row of --micro-batch-tokens positions) whose gradients accumulate. The loss is the
sum of token losses divided by the target tokens of the *whole* global batch, so accumulation (and, later, any
split across GPUs) gives the gradient of the one big batch - not an average of per-micro-batch means, which would
weight short answers more.
"""

from __future__ import annotations

import safetensors.torch
import torch
from peft import set_peft_model_state_dict

from ftkit import (
    attention,
    batching,
    checkpoint,
    cli,
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


def parse_args():
    p = cli.common_parser(__doc__.splitlines()[0], experiment="single-gpu-ft")
    p.add_argument(
        "--quant",
        choices=["nf4", "none"],
        default="nf4",
        help="nf4: QLoRA (4-bit NF4 base, double quant); none: LoRA on a bf16/fp32 base",
    )
    return cli.resolve(p.parse_args())


def main() -> None:
    args = parse_args()
    device = ranks.device_for(args)
    dtype = cli.torch_dtype(args.dtype)
    run_dir, resume_from = rundir.resolve(args)
    models.fetch(args.model)  # the model's files (a download on a first run), or one clear line if it cannot be had

    # ---- data: AMI examples in Qwen3's chat format, loss only on the answer, length-grouped global batches,
    # packed into rows of up to --max-length positions (several examples each; --no-packing: one padded example per row)
    splits = data.load_splits(args.data, args.data_revision)
    tokenizer, train_set, val_set, train_stats = prepare.encode_data(args, splits)
    batches = fit.global_batches(args, train_set)
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=1)
    eval_batches = evaluation.micro_batches(val_set, args.eval_examples, args.micro_batch_size)

    # ---- model: frozen base (4-bit NF4 for QLoRA) + trainable LoRA on all seven projections
    model = models.load_model(
        args.model, quant=args.quant, dtype=dtype, device=device, seed=args.seed, vocab_size=len(tokenizer)
    )
    config = model.config
    # Frozen base, activation checkpointing (non-reentrant: works with frozen inputs and, later, with DDP). The
    # embedding, lm_head and norms stay in the compute dtype (bf16 on GPUs), as in the bf16-LoRA runs.
    model = lora.freeze_base(model, args.checkpointing)
    model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
    checkpoint.seed_dropout(args.seed, stream=0)  # the dropout masks' stream (each data-parallel rank has its own)
    compiled = compilation.compile_layers(model, args.compile)  # --compile: each decoder layer, in place (one graph)
    # The adapters compute in bf16 (under autocast) with fp32 weights: no fp32 copy of an activation, no fp32 GEMM.
    model = lora.adapters_compute_in(model, dtype)
    counts = models.parameter_counts(model)
    print(f"parameters: {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen")

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optim.adamw_cosine(trainable, args)

    # ---- resume: adapter, optimizer, scheduler and RNG; the data position is the step itself
    start_step = 0
    if resume_from is not None:
        state = checkpoint.read_state(resume_from, ("adapter/adapter_model.safetensors", "optimizer.pt", "rng.pt"))
        try:
            weights = safetensors.torch.load_file(resume_from / "adapter" / "adapter_model.safetensors")
        except Exception as e:
            raise errors.CheckpointError(f"{resume_from}/adapter: corrupt adapter ({e})") from e
        set_peft_model_state_dict(model, weights)
        opt = checkpoint.load_torch(resume_from / "optimizer.pt")
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        checkpoint.set_rng_state(checkpoint.load_torch(resume_from / "rng.pt"))
        start_step = state["step"]

    log = rundir.start_log(args, run_dir, device, train_stats, counts, accum, start_step, resume_from, config)

    def save_checkpoint(step: int) -> None:
        tmp = checkpoint.staging_dir(run_dir, step)
        model.save_pretrained(tmp / "adapter", save_embedding_layers=False)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        torch.save(checkpoint.rng_state(), tmp / "rng.pt")
        checkpoint.commit(tmp, step, {"seed": args.seed}, args.keep_checkpoints)

    # ---- train
    model.train()
    last_step = args.stop_after or args.max_steps
    with StepProfiler(args.profile_steps, run_dir, device, 0, start_step=start_step) as profiler:
        for step in range(start_step, last_step):
            metrics.reset_peak_memory(device)
            n_target = batches.n_target(step)  # target tokens of the whole global batch: the loss denominator
            loss_sum = torch.zeros((), device=device)
            with metrics.StepTimer(device) as timer:
                for mb in batches.micro_batches(step, args.micro_batch_size):
                    mb = batching.to_device(mb, device)
                    # The lm_head runs on the answer positions only: the loss needs no other logits. Packed rows: the
                    # examples' boundaries, worked out when the rows were collated, go to the attention kernel (varlen
                    # lengths on a GPU, a block-diagonal mask otherwise); padded rows need no mask (causal).
                    with lora.compute_autocast(device, dtype):
                        out = model(
                            **attention.model_inputs(mb, config),  # ids, positions, the examples' boundaries
                            logits_to_keep=mb["logit_positions"],
                            use_cache=False,
                        )
                        loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
                    del out  # the logits are freed by backward, not kept alive into the next forward
                    loss.backward()
                    loss_sum += loss.detach()
                clip = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable, clip)
                optimizer.step()
                lr = scheduler.get_last_lr()[0]  # the rate this step ran at (step() sets the next one's)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            # The step's one host sync: the device scalars the metrics need, copied together.
            loss_value, grad_norm = metrics.host_values(loss_sum, grad_norm)
            row = log.row(
                step=step + 1,
                loss=loss_value,
                grad_norm=grad_norm,
                lr=lr,
                target_tokens=n_target,
                lengths=batches.lengths(step),  # real tokens of the global batch, all ranks: known on the host
                seconds=timer.seconds,
                **batches.layout(step, args.micro_batch_size),  # micro-steps, and the share of positions padded
            )
            if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
                sums = evaluation.loss_sums(model, eval_batches, device, dtype)
                row["eval_loss"] = (sums[0] / sums[1]).item()
            log.log(row)
            if (step + 1) % args.save_every == 0 or step + 1 == args.stop_after:
                save_checkpoint(step + 1)
            profiler.step(step + 1)
    log.close()

    # ---- save: a stock PEFT adapter (adapter_config.json + adapter_model.safetensors)
    finished = last_step == args.max_steps
    if finished:
        model.save_pretrained(run_dir / "adapter", save_embedding_layers=False)
    summary = log.run_summary(
        last_step,
        predicted=metrics.predicted_memory(config, args, "single", quant=args.quant),
        note=metrics.memory_note(device),
        compile=compilation.compile_report(compiled),
    )
    rundir.finish(args, run_dir, summary, finished)


if __name__ == "__main__":
    ranks.launch(main)
