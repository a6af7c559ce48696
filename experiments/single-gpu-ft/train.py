"""Single-GPU QLoRA: finetune Qwen3-4B with LoRA on a frozen 4-bit NF4 base, on AMI meeting transcripts.

The baseline of the series. Every other experiment computes this same training step, split across GPUs:
    uv run python experiments/single-gpu-ft/train.py                                   # Qwen3-4B, one GPU
    uv run python experiments/single-gpu-ft/train.py --smoke --data ../shared/data/qmsum-ami   # CPU, tiny Qwen3
    uv run python experiments/single-gpu-ft/train.py --quant none    # bf16 LoRA: the FSDP/TP/PP reference

One optimizer step = one global batch of --batch-size sequences, run as --batch-size / --micro-batch-size
micro-batches whose gradients accumulate. The loss is the sum of token losses divided by the target tokens
of the *whole* global batch, so accumulation (and, later, any split across GPUs) gives the gradient of the
one big batch - not an average of per-micro-batch means, which would weight short answers more.
"""

from __future__ import annotations

import safetensors.torch
import torch
from peft import prepare_model_for_kbit_training, set_peft_model_state_dict
from transformers import get_cosine_schedule_with_warmup

from ftkit import data, metrics, models, run
from ftkit.memory import ModelShape, predict


def parse_args():
    p = run.common_parser(__doc__.splitlines()[0], experiment="single-gpu-ft")
    p.add_argument(
        "--quant",
        choices=["nf4", "none"],
        default="nf4",
        help="nf4: QLoRA (4-bit NF4 base, double quant); none: LoRA on a bf16/fp32 base",
    )
    return run.resolve(p.parse_args())


def main() -> None:
    args = parse_args()
    device = run.device_for(args)
    dtype = run.torch_dtype(args.dtype)
    run_dir, resume_from = run.resolve_run_dir(args)

    # ---- data: AMI examples in Qwen3's chat format, loss only on the answer, length-grouped global batches
    splits = data.load_splits(args.data, args.data_revision)
    tokenizer = models.load_tokenizer(args.model, data.corpus(splits["train"]))
    formatter = data.ChatFormatter(tokenizer, args.max_length)
    train_set, train_stats = formatter.encode_all(splits["train"])
    val_set, _ = formatter.encode_all(splits["val"])
    print(f"train: {train_stats.describe()}")
    batches = data.GlobalBatches(train_set, args.batch_size, args.seed)
    accum = data.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=1)
    eval_batches = run.eval_micro_batches(val_set, args.eval_examples, args.micro_batch_size)

    # ---- model: frozen base (4-bit NF4 for QLoRA) + trainable LoRA on all seven projections
    model = models.load_model(
        args.model, quant=args.quant, dtype=dtype, device=device, seed=args.seed, vocab_size=len(tokenizer)
    )
    config = model.config
    checkpointing = {"use_reentrant": False}  # non-reentrant: works with frozen inputs and, later, with DDP
    if args.quant == "nf4":
        # Casts the non-quantized params (norms, embeddings) to fp32 for stable training, as QLoRA does.
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=args.grad_checkpointing,
            gradient_checkpointing_kwargs=checkpointing,
        )
    elif args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    model = models.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
    counts = models.parameter_counts(model)
    print(f"parameters: {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen")

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    # ---- resume: adapter, optimizer, scheduler and RNG; the data position is the step itself
    start_step = 0
    if resume_from is not None:
        state = run.read_checkpoint_state(resume_from, ("adapter/adapter_model.safetensors", "optimizer.pt", "rng.pt"))
        try:
            weights = safetensors.torch.load_file(resume_from / "adapter" / "adapter_model.safetensors")
        except Exception as e:
            raise run.CheckpointError(f"{resume_from}/adapter: corrupt adapter ({e})") from e
        set_peft_model_state_dict(model, weights)
        opt = run.load_torch(resume_from / "optimizer.pt")
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        run.set_rng_state(run.load_torch(resume_from / "rng.pt"))
        start_step = state["step"]
        print(f"resumed from {resume_from} at step {start_step}")

    run.init_run_dir(
        run_dir,
        args,
        {
            "args": run.args_dict(args),
            "versions": metrics.versions(),
            "hardware": metrics.hardware(device, world_size=1),
            "data": train_stats.as_dict(),
            "parameters": counts,
            "accumulation_steps": accum,
        },
        resume_step=start_step if resume_from is not None else None,
    )
    log = metrics.MetricsLog(run_dir, rank=0, total_steps=args.max_steps, start_step=start_step, progress=args.progress)
    peak = metrics.peak_flops(device)

    def save_checkpoint(step: int) -> None:
        tmp = run.staging_dir(run_dir, step)
        model.save_pretrained(tmp / "adapter")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        torch.save(run.rng_state(), tmp / "rng.pt")
        run.commit_checkpoint(tmp, step, {"seed": args.seed}, args.keep_checkpoints)

    # ---- train
    model.train()
    last_step = args.stop_after or args.max_steps
    for step in range(start_step, last_step):
        metrics.reset_peak_memory(device)
        n_target = batches.n_target(step)  # target tokens of the whole global batch: the loss denominator
        loss_sum = torch.zeros((), device=device)
        seq_lens: list[int] = []
        with metrics.StepTimer(device) as timer:
            for mb in batches.micro_batches(step, args.micro_batch_size):
                mb = {k: v.to(device) for k, v in mb.items()}
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
                loss = data.token_loss_sum(logits, mb["labels"]) / n_target
                loss.backward()
                loss_sum += loss.detach()
                seq_lens += mb["attention_mask"].sum(1).tolist()
            clip = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        flops = metrics.step_flops(seq_lens, config, counts["trainable"])
        row = {
            "step": step + 1,
            "loss": loss_sum.item(),
            "lr": scheduler.get_last_lr()[0],
            "grad_norm": grad_norm.item(),
            "target_tokens": n_target,
            "tokens": sum(seq_lens),
            "step_time_s": timer.seconds,
            "tokens_per_s": sum(seq_lens) / timer.seconds,
            "mfu": flops / (timer.seconds * peak) if peak else None,
            **metrics.peak_memory(device),
        }
        if (step + 1) % args.eval_every == 0 or step + 1 == args.max_steps:
            sums = run.eval_loss_sums(model, eval_batches, device)
            row["eval_loss"] = (sums[0] / sums[1]).item()
        log.log(row)
        if (step + 1) % args.save_every == 0 or step + 1 == args.stop_after:
            save_checkpoint(step + 1)
    log.close()

    # ---- save: a stock PEFT adapter (adapter_config.json + adapter_model.safetensors)
    finished = last_step == args.max_steps
    if finished:
        model.save_pretrained(run_dir / "adapter")
    shape = ModelShape.from_config(config)
    predicted = predict(
        shape,
        technique="single",
        quant=args.quant,
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.max_length,
        grad_checkpointing=args.grad_checkpointing,
    ).as_dict()
    summary = {
        "status": "completed" if finished else f"stopped after step {last_step} (--stop-after); continue with --resume",
        "run_dir": str(run_dir),
        "config": run.args_dict(args),
        "versions": metrics.versions(),
        "hardware": metrics.hardware(device, world_size=1),
        "data": train_stats.as_dict(),
        "parameters": counts,
        **log.summary(),
        "mfu_convention": metrics.MFU_CONVENTION,
        "peak_flops": peak,
        "memory_predicted": predicted,
        "memory_note": "predicted: the memory model (ftkit/memory.py) at micro-batch x --max-length; measured: "
        + (
            "CUDA peak allocated"
            if device.type == "cuda"
            else "process peak RSS, which also counts Python, "
            "libraries and data, so it is not comparable with the model's GPU bytes"
        ),
    }
    run.write_summary(run_dir, summary)
    print(f"run directory: {run_dir}" + (f"\nadapter: {run_dir / 'adapter'}" if finished else ""))


if __name__ == "__main__":
    try:
        main()
    except (run.RunError, data.DataError, run.CheckpointError) as e:
        run.fail(str(e))
