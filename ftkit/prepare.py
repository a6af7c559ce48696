"""What every train.py does before its first step, in the order that keeps the process group's timeout away: the
ranks up to their process group (`start_ranks`), the examples encoded (`encode_data`) and, in the scripts that
build the whole model on every rank before they keep their part, the LoRA model (`load_lora_model`)."""

from __future__ import annotations

import argparse

import torch

from ftkit import data, lora, models, ranks


def start_ranks(args: argparse.Namespace, tp: int | None = None) -> tuple[torch.device, dict]:
    """A torchrun process (one per GPU) up to its process group, in the order that keeps the group's timeout away:
    this rank's device (on CPU, its share of the cores); the model's files downloaded (~8 GB of weights on a first
    run) before the group exists, so that no rank waits in a collective meanwhile, where the group's 30-minute timeout
    would end the run; with `tp`, a tensor-parallel degree that does not deal out whole heads refused from the
    config (`check_tp_degree`), on every rank alike, before the data, the group or any weight; the data splits
    (a hub dataset downloads too); then the group (`init_process_group`). Returns (device, splits)."""

    device = ranks.device_for(args, ranks.torchrun_local_rank())
    ranks.share_cpu_cores(device)
    models.fetch(args.model)
    if tp is not None:
        ranks.check_tp_degree(models.model_config(args.model), tp)
    splits = data.load_splits(args.data, args.data_revision)
    ranks.init_process_group(device)
    return device, splits


def encode_data(args: argparse.Namespace, splits: dict) -> tuple:
    """(tokenizer, encoded train examples, encoded val examples, the train set's EncodeStats): the examples in
    Qwen3's chat format with the loss on the answer only, cut to --max-length, in --tokenizer's tokens. Rank 0 builds
    the tokenizer's cache first (the tiny one is trained on the run's own AMI text); the line it prints says which
    tokenizer and what was kept."""

    choice = models.recorded_tokenizer(vars(args))  # a run recorded before --tokenizer, rebuilt: the one it used
    with ranks.rank0_first():
        tokenizer = models.load_tokenizer(args.model, data.corpus(splits["train"]), choice)
    splits = data.task_examples(splits, getattr(args, "task", "all"))  # a run's config from before --task: all
    formatter = data.ChatFormatter(tokenizer, args.max_length)
    train_set, train_stats = formatter.encode_all(splits["train"])
    val_set, _ = formatter.encode_all(splits["val"])
    name = models.tokenizer_name(args.model, choice)
    ranks.print0(f"train, {name} tokenizer ({len(tokenizer):,} tokens): {train_stats.describe()}")
    return tokenizer, train_set, val_set, train_stats


def load_lora_model(args: argparse.Namespace, dtype: torch.dtype, device: torch.device, vocab_size: int):
    """The whole bf16 (--dtype) base on this rank's `device`, built by rank 0 first (it fills the caches), with
    --checkpointing's non-reentrant checkpointing of the decoder layers it chooses, and PEFT's LoRA from --seed: the
    same weights and adapter init on every rank, as the single-GPU run's. The start of the scripts in which every
    rank builds the whole model and then keeps its part (tp-ft, tp-sp-ft, pp-ft, fsdp-tp-ft)."""

    with ranks.rank0_first():
        model = models.load_model(
            args.model, quant="none", dtype=dtype, device=device, seed=args.seed, vocab_size=vocab_size
        )
    if args.grad_checkpointing:
        lora.checkpoint_activations(model, checkpointing=args.checkpointing)
    return lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
