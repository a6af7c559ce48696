"""The step this command measures: a synthetic batch of full-length sequences (`synthetic_batch`), and the scripts'
training step restated from them (`TrainingStep`: the micro-step's forward and backward, the optimizer step)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ftkit import batching, data, lora, optim
from ftkit.realscale import RealScaleError
from ftkit.realscale.configuration import Setup


def synthetic_micro_batch(micro_batch_size: int, length: int, answer: int, vocab: int) -> dict:
    """Full-length sequences whose last `answer` tokens are the answer, collated as the scripts collate AMI
    examples (`batching.collate`), so `logit_positions` and `targets` are built the same way. Token ids are random."""
    if not 0 < answer < length:
        raise RealScaleError(f"--answer-tokens must be in 1..{length - 1} (--max-length {length}), got {answer}")
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(micro_batch_size):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        labels = [data.IGNORE_INDEX] * (length - answer) + ids[length - answer :]
        items.append(data.Encoded(input_ids=ids, labels=labels, trimmed=False))
    return batching.collate(items)


@dataclasses.dataclass
class Batch:
    """The micro-batch every micro-step runs (pp: the global batch, which the schedule cuts; cp: this rank's chunks
    of it), the global batch's target tokens (the loss's denominator), and the mask the model is given."""

    mb: dict
    n_target: int
    attention_mask: torch.Tensor | None
    unmasked: bool  # no mask, and transformers must be told it needs none (`stand_ins.causal_mask_skipped`)


def synthetic_batch(s: Setup, vocab: int) -> Batch:
    args = s.args
    # pp-ft feeds the schedule the whole global batch, which it cuts into micro-batches itself.
    rows = args.batch_size if s.pp else args.micro_batch_size
    mb = synthetic_micro_batch(rows, args.max_length, s.opts.answer_tokens, vocab)
    if s.pp:  # pp-ft's `padded`: input ids padded to --max-length, the target packing [rows, 2, k] (positions, tokens)
        mb["input_ids"] = torch.nn.functional.pad(mb["input_ids"], (0, args.max_length - mb["input_ids"].shape[1]))
        mb["target"] = torch.stack([mb["logit_positions"], mb["targets"]], dim=1)
    if s.technique == "tp-sp":  # as tp-sp-ft pads: sequence parallelism splits the sequence into equal parts
        mb = batching.pad_to_multiple(mb, s.world)
    if s.technique == "cp":  # cp-ft's own `shard`: this rank's two chunks, their positions and answer positions
        mb = s.script.shard(mb, s.world, s.rank)
        return Batch(mb, int((mb["targets"] != data.IGNORE_INDEX).sum()) * s.accum, None, False)
    # The global batch's target tokens (pp's batch is the global one).
    n_target = int((mb["targets"] != data.IGNORE_INDEX).sum()) * (1 if s.pp else s.accum * s.dp)

    padded = not bool(mb["attention_mask"].all())
    attention_mask = mb["attention_mask"] if padded else None
    # pp-ft's Stage calls the decoder layers with no mask itself (causal attention alone): nothing to stand in for.
    unmasked = not padded and not s.pp
    return Batch(mb, n_target, attention_mask, unmasked)


class TrainingStep:
    """The script's optimizer step, restated: `runs` micro-steps (pp: one schedule.step over the pipeline's
    micro-batches), the script's clip, AdamW's step and zero_grad. `model` is what the script trains: pp's stage
    (with its PipelineStage and schedule), ddp's wrapper."""

    def __init__(self, s: Setup, model, batch: Batch, stage=None, schedule=None):
        self.s, self.model, self.batch, self.stage, self.schedule = s, model, batch, stage, schedule
        self.ddp = hasattr(model, "no_sync")
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.replicated = s.script.replicated_lora(model) if s.technique == "tp-sp" else []
        self.optimizer = torch.optim.AdamW(self.trainable, lr=s.args.lr, weight_decay=s.args.weight_decay)

    def micro_step(self, sync: bool) -> None:
        s, model, mb, n_target = self.s, self.model, self.batch.mb, self.batch.n_target
        kwargs = dict(
            input_ids=mb["input_ids"], attention_mask=self.batch.attention_mask, logits_to_keep=mb["logit_positions"]
        )
        if s.pp:  # pp-ft's step: the schedule runs every micro-batch's forward and backward, under autocast
            inputs = [mb["input_ids"]] if self.stage.is_first else []
            with lora.compute_autocast(s.device, s.dtype):
                target = mb["target"] if self.stage.is_last else None
                self.schedule.step(*inputs, target=target, losses=[], return_outputs=False)
            return
        if s.technique == "fsdp":  # experiments/fsdp-ft/train.py's micro-step: FSDP2 casts, no autocast
            model.set_requires_gradient_sync(sync)
            out = model(**kwargs)
            loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
            del out
            (loss * s.world).backward()
            return
        if s.technique == "cp":  # cp-ft's: its forward_loss on this rank's chunks (autocast, no mask: its attention's)
            loss = s.script.forward_loss(model, mb, s.device, s.dtype) / n_target
            loss.backward()
            return
        if s.technique == "tp-sp":  # tp-sp-ft's: bf16 base, its linears cast the adapters; the same loss everywhere
            out = model(**kwargs)
            loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
            del out
            loss.backward()
            return
        # single-gpu-ft / ddp-ft / tp-ft: the adapters compute in bf16 under autocast; DDP accumulates under
        # no_sync; TP runs the whole batch on every rank (dp 1)
        with model.no_sync() if self.ddp and not sync else contextlib.nullcontext():
            with lora.compute_autocast(s.device, s.dtype):
                out = model(**kwargs)
                loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
            del out
            (loss * s.dp).backward()

    def optimizer_step(self) -> None:
        import torch.distributed as dist

        s, args, trainable = self.s, self.s.args, self.trainable
        if s.technique == "cp":  # cp-ft sums the ranks' gradients first (then clips the whole gradient, below)
            s.script.all_reduce_grads(trainable)
        if s.technique == "tp":  # the scripts' own clips: each mixes sharded and replicated gradients
            s.script.clip_grads(trainable, args.max_grad_norm)
        elif s.technique == "tp-sp":  # tp-sp-ft also sums the replicated LoRA gradients' shares first
            s.script.sync_replicated_grads(self.replicated, dist.group.WORLD)
            optim.clip_grads_over_ranks(trainable, args.max_grad_norm, dist.group.WORLD, self.replicated)
        elif s.pp:  # each rank holds its stages' share of the gradients
            optim.clip_grads_over_ranks(trainable, args.max_grad_norm)
        else:
            torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm if args.max_grad_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not getattr(args, "gradient_as_bucket_view", False))

    def optimizer_step_of_micro_steps(self, tracker=None) -> None:
        calls = 1 if self.s.pp else self.s.runs  # one schedule.step runs the pipeline's micro-batches
        for j in range(calls):
            self.micro_step(sync=j == calls - 1)
            if tracker is not None:
                # Per-module stats are kept for one forward/backward (FSDPMemTracker refuses a second); the
                # peak over the whole run is kept.
                tracker.reset_mod_stats()
        self.optimizer_step()
