"""What a user would run instead: the same LoRA finetuning through Hugging Face's own stack (Trainer + PEFT).

    uv run python assets/hf_baseline.py --smoke                        # CPU, tiny Qwen3: padded batches
    uv run python assets/hf_baseline.py --smoke --collator flatten     # CPU: padding-free batches
    uv run python assets/hf_baseline.py --model qwen3-4b-shape         # one GPU: Qwen3-4B's shape, bf16
    uv run python assets/hf_baseline.py --model qwen3-4b-shape --tuned # one GPU: the Trainer at its best

The job of `experiments/single-gpu-ft/train.py --quant none`, step for step: the same examples in the same order
(this project's AMI loading, chat format and length-grouped global batches: optimizer step k trains on the
examples of the project's step k, longest first), the same base model and LoRA initialisation (`ftkit.models`:
rank, alpha, dropout, the seven projections), the same global batch (--batch-size sequences = --micro-batch-size
per forward x gradient accumulation), sequence length, optimizer (AdamW, --lr, linear warmup then cosine,
--weight-decay, --max-grad-norm) and steps. The step itself is the stock transformers `Trainer`, as the
transformers and PEFT docs set it up, with its defaults: SDPA attention, no compile, and one of

  --collator padded   DataCollatorForSeq2Seq: each micro-batch's examples right-padded to its longest, an
                      attention mask, labels -100 on the prompt and the padding (what most finetuning scripts use);
  --collator flatten  DataCollatorWithFlattening (transformers' padding-free collator): the micro-batch's examples
                      concatenated into one row, position_ids restarting at 0 at each example, no attention mask
                      and no seq_idx or flash-attention kwargs (its defaults); with no mask and no KV cache,
                      transformers 5.23 finds the examples from the position restarts
                      (masking_utils.find_packed_sequence_indices) and gives SDPA the block-diagonal causal mask.
                      Each example's first label is -100, so no example is trained to follow the one before.

That is the Trainer as most scripts run it (stock). --tuned runs it as a practitioner on an 80 GB card sets it,
so that "x HF" says how this project compares with Hugging Face at its best, not with its defaults (`tuned`,
recorded with the reason for each choice in summary.json's `tuned`):

  per-device batch    on CUDA, the largest per_device_train_batch_size dividing --batch-size whose step the
                      project's memory model (ftkit.memory.predict, the Trainer's layout: logits at every position,
                      PEFT's fp32 adapter inputs) times the planner's margin (plan.techniques.MEMORY_MARGIN) plus
                      its reserve fits in the GPU's memory, without activation checkpointing where one does (a
                      recomputed forward costs about a third more compute per step), with it only where none does;
                      gradient_accumulation_steps = --batch-size / that, so the global batch is unchanged. On CPU:
                      --micro-batch-size as given, no checkpointing (no GPU memory to fill);
  padding-free        DataCollatorWithFlattening(return_flash_attn_kwargs=True): one row per micro-batch, position_ids
                      restarting per example and the boundaries as cu_seq_lens_q/k, max_length_q/k, which a varlen
                      attention takes: flash_attention_2 where flash-attn is installed, else this project's varlen
                      kernel registered with transformers (ftkit.attention.VARLEN: torch's varlen_attn), on CUDA in
                      bf16/fp16; elsewhere SDPA with the block-diagonal mask transformers builds from position_ids;
  use_liger_kernel    where liger_kernel is installed (importlib.util.find_spec) and the device is CUDA (Triton);
  torch_compile       on CUDA unless --no-compile (the Trainer compiles the whole model); never on CPU.

It writes a run directory as the experiments do (config.json, metrics.jsonl, summary.json, adapter/), which
`assets/benchmark.py` reads: the "x HF" column is every configuration's tokens/s over this script's with --tuned
(over --collator padded's, stock, where the benchmark has no tuned run). Where the Trainer's step differs from the
project's is in summary.json (`differences`), and how it was timed (`timing_note`): this is a baseline whose step
we do not control, so a callback times it from outside.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import time

import torch
from transformers import (
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from ftkit import (
    attention,
    batching,
    cli,
    data,
    errors,
    evaluation,
    lora,
    memory,
    metrics,
    models,
    prepare,
    ranks,
    rundir,
)
from ftkit.plan import settings
from ftkit.plan.techniques import MEMORY_MARGIN

COLLATORS = {"padded": DataCollatorForSeq2Seq, "flatten": DataCollatorWithFlattening}


def parse_args():
    p = cli.common_parser(__doc__.splitlines()[0], experiment="hf-baseline")
    p.add_argument(
        "--collator",
        choices=list(COLLATORS),
        default=None,
        help="the layout, in place of the experiments' --no-packing: padded: DataCollatorForSeq2Seq (right-padded "
        "rows, attention mask); flatten: DataCollatorWithFlattening (one row per micro-batch, position_ids "
        "restarting per example, no mask) [padded; --tuned: flatten, with the varlen boundaries]",
    )
    p.add_argument(
        "--tuned",
        action="store_true",
        help="the Trainer as a practitioner on an 80 GB card sets it (the module's docstring): the per-device batch "
        "the memory model fits, padding-free batches with a varlen attention, Liger kernels where installed, "
        "torch.compile on CUDA, activation checkpointing only where the batch does not fit without it; "
        "--micro-batch-size, --no-grad-checkpointing and --no-compile, where given, override its choices",
    )
    args = p.parse_args()
    if "packing" in args.explicit_flags:
        raise errors.RunError("--no-packing: the Hugging Face baseline's layout is --collator (padded or flatten)")
    if args.tuned and args.collator == "padded":
        raise errors.RunError("--collator padded: --tuned runs padding-free batches (DataCollatorWithFlattening)")
    args.collator = args.collator or ("flatten" if args.tuned else "padded")
    if hasattr(args, "packing"):  # the experiments' flag, recorded as what this collator does
        args.packing = args.collator == "flatten"
    # The baseline runs once, start to end: it has no checkpoints to continue from, and no profiler of ours.
    refused = {"--resume": args.resume, "--stop-after": args.stop_after, "--profile-steps": args.profile_steps}
    for flag, given in refused.items():
        if given is not None:
            raise errors.RunError(f"{flag}: not for the Hugging Face baseline, which runs once from start to end")
    args = cli.resolve(args)
    if getattr(args, "compile", False) and not args.tuned:  # the experiments' --compile (on by default on CUDA)
        if "compile" in args.explicit_flags:
            raise errors.RunError(
                "--compile: the stock Hugging Face baseline runs the Trainer's default, no torch.compile (--tuned "
                "compiles on CUDA)"
            )
        args.compile = False  # recorded as what the baseline does
    return args


class CountingCollator:
    """The Trainer's collator, unchanged, counting on the host what each micro-batch it makes holds: rows, positions
    computed (padding included) and real tokens (the attention mask's ones; every position when flattened), in the
    order the Trainer consumes them."""

    def __init__(self, collate):
        self.collate, self.seen = collate, []

    def __call__(self, features):
        batch = self.collate(features)
        ids = batch["input_ids"]
        real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else ids.numel()
        self.seen.append((ids.shape[0], ids.numel(), real))
        return batch

    def take(self, n: int) -> list[tuple[int, int, int]]:
        """The counts of the next `n` micro-batches the Trainer consumed, in order (accelerate's data loader
        collates one micro-batch ahead, so the last one counted may already belong to the next step)."""
        seen, self.seen = self.seen[:n], self.seen[n:]
        return seen


class StepMeter(TrainerCallback):
    """Times each optimizer step of the Trainer from outside and writes the project's metrics rows.

    A step's time runs from the end of the previous step's logging (or the start of training) to `on_step_end`,
    after a CUDA synchronize: the Trainer collates all of a step's micro-batches before its first forward (before
    `on_step_begin`), so the collation, the forwards and backwards, the clipping and the optimizer step are inside,
    as they are inside the project's StepTimer; the Trainer's reading of the logged loss and the eval are not."""

    def __init__(self, log, batches, counter, device, eval_batches, dtype, args):
        self.log, self.batches, self.counter, self.device = log, batches, counter, device
        self.eval_batches, self.dtype, self.args = eval_batches, dtype, args
        self.items = None  # the num_items_in_batch the Trainer passed to the model's forward, last micro-step

    def record_items(self, module, args, kwargs):  # a forward pre-hook on the PEFT model
        if module.training:
            self.items = kwargs.get("num_items_in_batch")

    def _start(self) -> None:
        metrics.reset_peak_memory(self.device)
        self.t0 = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self._start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.t0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in (logs or {}):  # the Trainer's end-of-training summary, not a step
            return
        step = state.global_step  # 1-based; the project's batches are indexed from 0
        seen = self.counter.take(args.gradient_accumulation_steps)
        real = sum(n for *_, n in seen)
        if real != self.batches.n_tokens(step - 1):
            raise RuntimeError(f"step {step}: the Trainer's batches hold {real} real tokens, the project's step "
                               f"{self.batches.n_tokens(step - 1)}: not the same examples")  # fmt: skip
        items = self.items
        row = self.log.row(
            step=step,
            loss=logs["loss"],
            grad_norm=logs.get("grad_norm"),
            lr=logs["learning_rate"],
            target_tokens=self.batches.n_target(step - 1),
            lengths=self.batches.lengths(step - 1),
            seconds=self.seconds,
            micro_batches=len(seen),
            rows=sum(r for r, *_ in seen),
            padding_fraction=1 - real / sum(p for _, p, _ in seen),
            num_items_in_batch=None if items is None else int(items),
        )
        if step % self.args.eval_every == 0 or step == self.args.max_steps:
            sums = evaluation.loss_sums(kwargs["model"], self.eval_batches, self.device, self.dtype)
            row["eval_loss"] = (sums[0] / sums[1]).item()
        self.log.log(row)
        self._start()


# --tuned fits its per-device batch as the planner does: the memory model's bytes times its margin, plus its reserve
# (the CUDA context and what CUDA's libraries allocate for themselves), at most the GPU's memory.
RESERVE_BYTES = settings.Setting.reserve_bytes
FLATTEN_TUNED = "DataCollatorWithFlattening(return_flash_attn_kwargs=True)"


def device_batch(config, args, gpu_bytes: float) -> dict:
    """--tuned on CUDA: the per-device batch and activation checkpointing the memory model fits in `gpu_bytes`.

    The step predicted is the Trainer's: one process, the base in --dtype, LoRA with PEFT's fp32 adapter inputs,
    logits at every position (an over-estimate with Liger's fused cross-entropy, which holds none), each forward's
    rows at --max-length (an upper bound for the flattened row of as many examples). Tried: without activation
    checkpointing, every per-device batch dividing --batch-size from the largest down, then the same with
    checkpointing; the first that fits is taken. An explicit --micro-batch-size is the only size tried, an explicit
    --no-grad-checkpointing rules checkpointing out; where nothing fits, the smallest tried, said so."""
    shape = memory.ModelShape.from_config(config)

    def predicted(rows: int, checkpointing: bool) -> float:
        return memory.predict(
            shape,
            technique="single",
            quant="none",
            dtype=args.dtype,
            lora_rank=args.lora_rank,
            lora_dropout=args.lora_dropout,
            fp32_adapter_compute=True,
            micro_batch_size=rows,
            seq_len=args.max_length,
            grad_checkpointing=checkpointing,
        ).total

    given = "micro_batch_size" in args.explicit_flags
    sizes = [args.micro_batch_size] if given else [b for b in range(args.batch_size, 0, -1) if args.batch_size % b == 0]
    options = (False,) if "grad_checkpointing" in args.explicit_flags else (False, True)
    tried = [(rows, ckpt) for ckpt in options for rows in sizes]
    fits = [(rows, ckpt) for rows, ckpt in tried if predicted(rows, ckpt) * MEMORY_MARGIN + RESERVE_BYTES <= gpu_bytes]
    rows, ckpt = fits[0] if fits else tried[-1]
    need = predicted(rows, ckpt)
    said = (
        f"{rows} x {args.max_length} positions per forward, activation checkpointing {'on' if ckpt else 'off'}: "
        f"the memory model predicts {need / memory.GIB:.1f} GiB, x {MEMORY_MARGIN} + {RESERVE_BYTES / memory.GIB:.0f} "
        f"GiB reserve = {(need * MEMORY_MARGIN + RESERVE_BYTES) / memory.GIB:.1f} GiB of the GPU's "
        f"{gpu_bytes / memory.GIB:.1f} GiB"
    )
    if not fits:
        said += "; predicted not to fit, the smallest tried"
    elif given:
        said += "; --micro-batch-size as given"
    else:
        said += f"; the largest per-device batch dividing --batch-size {args.batch_size} that fits" + (
            " with checkpointing (none fits without)" if ckpt else " without checkpointing"
        )
    return {
        "per_device_train_batch_size": rows,
        "activation_checkpointing": ckpt,
        "memory_predicted_bytes": need,
        "required_bytes": need * MEMORY_MARGIN + RESERVE_BYTES,
        "gpu_memory_bytes": gpu_bytes,
        "said": said,
    }


def tuned_settings(args, device: torch.device, dtype: torch.dtype, config, gpu_bytes: float | None = None) -> dict:
    """What --tuned sets, each with why (summary.json's `tuned`), from the device, the dtype, the memory model and
    what is installed (importlib.util.find_spec: nothing is imported, and nothing here touches a GPU)."""
    why = {}
    if device.type == "cuda":
        fit = device_batch(config, args, gpu_bytes)
        rows, ckpt = fit["per_device_train_batch_size"], fit["activation_checkpointing"]
        why["per_device_train_batch_size"] = why["activation_checkpointing"] = fit.pop("said")
    else:
        fit, rows, ckpt = None, args.micro_batch_size, False
        why["per_device_train_batch_size"] = "not on CUDA: --micro-batch-size as given (no GPU memory to fill)"
        why["activation_checkpointing"] = "not on CUDA: off (no GPU memory to fit)"
    accum = batching.accumulation_steps(args.batch_size, rows, data_parallel=1)
    why["gradient_accumulation_steps"] = f"--batch-size {args.batch_size} / {rows} examples per forward"

    attn = models.attention_implementation(device, dtype)
    if attn == attention.VARLEN and importlib.util.find_spec("flash_attn") is not None:
        attn = "flash_attention_2"
        why["attn_implementation"] = (
            "flash-attn is installed: transformers' flash_attention_2, which takes the collator's cu_seq_lens_q/k "
            "and max_length_q/k (flash_attn_varlen_func)"
        )
    elif attn == attention.VARLEN:
        why["attn_implementation"] = (
            f"no flash-attn: this project's varlen kernel ({attention.VARLEN}, ftkit/attention.py: torch's "
            "varlen_attn), registered with transformers' attention interface; it takes the collator's cu_seq_lens_q "
            "and max_length_q, and transformers builds no mask for it"
        )
    else:
        why["attn_implementation"] = (
            "no varlen kernel here (CUDA in bf16/fp16 only): SDPA, with the block-diagonal causal mask transformers "
            "builds from the position_ids restarts (masking_utils.find_packed_sequence_indices); the collator's "
            "cu_seq_lens are passed and unused"
        )

    liger = device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None
    why["use_liger_kernel"] = (
        "liger_kernel is installed: the Trainer patches the model with Liger's Triton kernels (RMSNorm, RoPE, "
        "SwiGLU, and a fused linear cross-entropy that never holds the logits)"
        if liger
        else "not on CUDA: Liger's kernels are Triton, GPU only"
        if device.type != "cuda"
        else "liger_kernel is not installed (uv pip install liger-kernel)"
    )
    compiled = device.type == "cuda" and bool(args.compile)
    why["torch_compile"] = (
        "CUDA: the Trainer compiles the whole model (torch.compile, its default backend and mode; the first steps "
        "pay for compiling, and the flattened rows' changing length for dynamo's dynamic shapes)"
        if compiled
        else "--no-compile"
        if device.type == "cuda"
        else "not on CUDA: eager (the tuned baseline compiles on CUDA only)"
    )
    return {
        "per_device_train_batch_size": rows,
        "gradient_accumulation_steps": accum,
        "activation_checkpointing": ckpt,
        "collator": FLATTEN_TUNED,
        "attn_implementation": attn,
        "use_liger_kernel": liger,
        "torch_compile": compiled,
        "memory": fit,
        "why": why,
    }


def differences(trainer: Trainer, args) -> list[str]:
    """Where the Trainer's step differs from the project's (experiments/single-gpu-ft/train.py --quant none)."""
    targs = trainer.args
    version = importlib.metadata.version("transformers")
    optim = getattr(targs.optim, "value", targs.optim)
    if trainer.model_accepts_loss_kwargs:
        loss = (
            f"loss normalisation (transformers {version}): the Trainer counts the target tokens (labels[..., 1:] != "
            "-100) of all the optimizer step's micro-batches before the first runs and passes the count to the model "
            "as num_items_in_batch (the model accepts loss kwargs); each micro-batch's loss is its token-loss sum / "
            "that count, and the micro-steps' losses add up to the mean over the global batch's target tokens: the "
            "project's normalisation (each row's num_items_in_batch = target_tokens). Before transformers 4.46 "
            "(huggingface/transformers#34191, corrected further in later releases) it was the mean over each "
            "micro-batch's own target tokens / accumulation steps"
        )
    else:
        loss = (
            f"loss normalisation (transformers {version}): the model takes no loss kwargs, so each micro-batch's loss "
            "is the mean over its own target tokens, divided by the accumulation steps; the project divides the sum "
            "by the global batch's target tokens"
        )
    attn = trainer.model.config._attn_implementation
    if args.collator == "padded":
        layout = (
            "one example per row, right-padded to the micro-batch's longest, with an attention mask (SDPA gets an "
            "explicit mask where a micro-batch has padding)"
        )
    elif attn == "sdpa":
        layout = (
            "each micro-batch's examples concatenated into one row with position_ids restarting per example and "
            "no mask; transformers hands SDPA the block-diagonal causal mask of the whole row, so its kernel computes "
            "the scores of all pairs of the row's positions, masked ones included, where separate rows need each "
            "example's own only (a varlen kernel, with the collator's return_flash_attn_kwargs, skips them: --tuned "
            "on CUDA in bf16)"
        )
    else:
        layout = (
            "each micro-batch's examples concatenated into one row with position_ids restarting per example, and the "
            f"collator's cu_seq_lens_q/k and max_length_q/k, which {attn} takes: each example's own scores only, "
            "as the project's varlen path"
        )
    logits = (
        "logits at every position: the model runs the lm_head on every position of every row and the loss upcasts "
        "the [rows, positions, vocab] logits to fp32; the project runs the lm_head at the answer positions only "
        "(logits_to_keep)"
    )
    if targs.use_liger_kernel:
        logits = (
            "the lm_head at every position, through Liger's fused linear cross-entropy (chunks of positions, the "
            "logits never held whole); the project runs the lm_head at the answer positions only (logits_to_keep)"
        )
    compiled = (
        "the whole model compiled by the Trainer (torch_compile=True, default backend and mode); the project "
        "compiles each decoder layer (--compile)"
        if targs.torch_compile
        else "no torch.compile (torch_compile=False, the default)"
    )
    return [
        loss,
        logits,
        "layout: "
        + layout
        + f", {args.micro_batch_size} examples per forward and {targs.gradient_accumulation_steps} micro-steps per "
        "step; the project's layout is in its rows' micro_batches and padding_fraction",
        f"host syncs: logging_nan_inf_filter={targs.logging_nan_inf_filter} (the default) tests each micro-step's "
        "loss for NaN/Inf on the host, one wait for the GPU per micro-batch; logging_steps=1 (set here, for a loss "
        "per step) reads the loss and gradient norm once per step; the project reads its scalars once per step",
        f"optimizer: the Trainer's default optim={optim} (torch's fused AdamW, a few multi-tensor kernels per step), "
        "the same AdamW math and schedule (lr_scheduler_type=cosine with the same warmup) as the project's "
        "torch.optim.AdamW; weight decay is skipped for bias and norm weights, of which LoRA trains none",
        "precision: "
        + (
            "bf16=True, accelerate's autocast around the whole forward; PEFT keeps the adapter weights in fp32 and "
            "casts each projection's input to fp32 before autocast runs the adapter matmuls in bf16 (the project "
            "skips that cast: lora.adapters_compute_in)"
            if targs.bf16
            else "fp32 throughout, as the project's --dtype fp32"
        ),
        "LoRA dropout masks come from the Trainer's RNG (set_seed(--seed) when it starts), not the project's "
        "per-rank dropout stream: with --lora-dropout > 0 the losses differ step by step (the CPU walkthrough "
        "has dropout 0)",
        f"activation checkpointing={targs.activation_checkpointing} through the Trainer (non-reentrant), as the "
        f"project's --grad-checkpointing; {compiled}",
        "eval: the project's own eval (evaluation.loss_sums on the same held-out examples), on the adapter the "
        "Trainer trained; not Trainer.evaluate",
        "one process, one device (no torchrun): a baseline for the single-process step",
    ]


TIMING_NOTE = (
    "step_time_s: a TrainerCallback's wall clock from the end of the previous step's logging to on_step_end, after "
    "torch.cuda.synchronize on GPUs (the project's StepTimer records CUDA events instead; the Trainer's own per-step "
    "logging waits for the GPU at that point anyway). Inside: the collation of the step's micro-batches (the Trainer "
    "prefetches them before on_step_begin), forwards, backwards, clipping, optimizer and scheduler; outside: the "
    "Trainer's reading of the logged loss and the eval. tokens: the real (non-pad) tokens of the global batch, "
    "checked against what the collator made; micro_batches, rows and padding_fraction: counted from the collator's "
    "tensors; num_items_in_batch: what the Trainer passed to the model's forward"
)


def main() -> None:
    args = parse_args()
    device = ranks.device_for(args)
    dtype = cli.torch_dtype(args.dtype)
    run_dir, _ = rundir.resolve(args)
    models.fetch(args.model)

    # ---- data: the project's examples and global batches, in the order its step k trains on them
    splits = data.load_splits(args.data, args.data_revision)
    tokenizer, train_set, val_set, train_stats = prepare.encode_data(args, splits)
    tuned = None
    if args.tuned:  # what a practitioner sets, before anything is sized by --micro-batch-size
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        config = models.model_config(args.model, len(tokenizer))
        tuned = tuned_settings(args, device, dtype, config, gpu_bytes)
        args.micro_batch_size = tuned["per_device_train_batch_size"]  # recorded in config.json as what it ran
        args.grad_checkpointing, args.compile = tuned["activation_checkpointing"], tuned["torch_compile"]
        print(f"--tuned: {json.dumps({k: v for k, v in tuned.items() if k not in ('memory', 'why')})}")
    batches = batching.GlobalBatches(train_set, args.batch_size, args.seed)
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=1)
    examples = [
        {"input_ids": train_set[i].input_ids, "labels": train_set[i].labels}
        for step in range(args.max_steps)
        for i in batches.indices(step)
    ]
    eval_batches = evaluation.micro_batches(val_set, args.eval_examples, args.micro_batch_size)

    # ---- model: the same base and LoRA init as every technique's (PEFT's get_peft_model with lora.lora_config);
    # SDPA attention, as the Trainer's users get it by default (--tuned: a varlen one where there is one)
    attn = tuned["attn_implementation"] if tuned else "sdpa"
    model = models.load_model(
        args.model, quant="none", dtype=dtype, device=device, seed=args.seed, vocab_size=len(tokenizer), attn=attn
    )
    model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
    counts = models.parameter_counts(model)
    print(f"parameters: {counts['trainable']:,} trainable (LoRA), {counts['frozen']:,} frozen")

    # ---- the Hugging Face step: Trainer with its defaults, set to this job (--tuned: and to the GPU)
    collator = CountingCollator(
        DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=data.IGNORE_INDEX)
        if args.collator == "padded"
        else DataCollatorWithFlattening(return_flash_attn_kwargs=bool(tuned))
    )
    targs = TrainingArguments(
        output_dir=str(run_dir / "trainer"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        bf16=dtype == torch.bfloat16,
        activation_checkpointing=args.grad_checkpointing,
        use_liger_kernel=bool(tuned and tuned["use_liger_kernel"]),
        torch_compile=bool(tuned and tuned["torch_compile"]),
        train_sampling_strategy="sequential",  # the project's order (its global batches), not a reshuffle
        remove_unused_columns=False,
        label_names=["labels"],
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,  # the run's own progress bar (or JSON line per step) shows the steps
        seed=args.seed,
        use_cpu=device.type == "cpu",
    )
    trainer = Trainer(
        model=model, args=targs, train_dataset=examples, data_collator=collator, processing_class=tokenizer
    )
    trainer.remove_callback(PrinterCallback)

    technique = {
        "baseline": "Hugging Face transformers Trainer + PEFT LoRA, "
        + ("tuned as a practitioner on an 80 GB card sets it" if tuned else "stock defaults"),
        "hf_config": "tuned" if tuned else "stock",
        "tuned": tuned,
        "collator": args.collator,
        "collator_class": type(collator.collate).__name__,
        "attn_implementation": model.config._attn_implementation,
        "trainer": {
            "optim": getattr(targs.optim, "value", targs.optim),
            "lr_scheduler_type": getattr(targs.lr_scheduler_type, "value", targs.lr_scheduler_type),
            "per_device_train_batch_size": targs.per_device_train_batch_size,
            "gradient_accumulation_steps": targs.gradient_accumulation_steps,
            "bf16": targs.bf16,
            "activation_checkpointing": targs.activation_checkpointing,
            "logging_steps": targs.logging_steps,
            "logging_nan_inf_filter": targs.logging_nan_inf_filter,
            "train_sampling_strategy": targs.train_sampling_strategy,
            "model_accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
            "torch_compile": targs.torch_compile,
            "use_liger_kernel": targs.use_liger_kernel,
        },
    }
    log = rundir.start_log(args, run_dir, device, train_stats, counts, accum, 0, None, model.config, **technique)
    meter = StepMeter(log, batches, collator, device, eval_batches, dtype, args)
    model.register_forward_pre_hook(meter.record_items, with_kwargs=True)
    trainer.add_callback(meter)

    # ---- train
    trainer.train()
    log.close()
    shutil.rmtree(run_dir / "trainer", ignore_errors=True)  # the Trainer's output_dir: nothing saved there

    # ---- save: a stock PEFT adapter, and the summary the benchmark reads
    model.save_pretrained(run_dir / "adapter", save_embedding_layers=False)
    summary = log.run_summary(
        args.max_steps,
        predicted=metrics.predicted_memory(model.config, args, "single", quant="none"),
        note=metrics.memory_note(device),
        differences=differences(trainer, args),
        timing_note=TIMING_NOTE,
    )
    rundir.finish(args, run_dir, summary, finished=True)


if __name__ == "__main__":
    ranks.launch(main)
