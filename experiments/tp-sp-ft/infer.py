"""Summaries from the TP+SP LoRA run, reassembled (and merged), for held-out AMI meeting spans, with ROUGE.

    uv run python experiments/tp-sp-ft/infer.py                   # the latest runs/tp-sp-ft run, its adapter
    uv run python experiments/tp-sp-ft/infer.py --smoke --merged  # the merged model a --merge run wrote

train.py all-gathered the sharded adapters and concatenated them along the dim each was split on (B's rows of a
column-parallel layer, A's columns of a row-parallel one) under PEFT's names for the unsharded model, so
inference is one process on one device with stock `PeftModel.from_pretrained`. With --merged the finetuned side
is instead the plain transformers checkpoint in <run>/merged (base + LoRA merged by train.py --merge).
"""

from __future__ import annotations

from pathlib import Path

from peft import PeftModel
from transformers import AutoModelForCausalLM

from ftkit import errors, generation


def add_flags(p) -> None:
    p.add_argument("--merged", action="store_true", help="use <run>/merged (train.py --merge) instead of the adapter")


def check(args, cfg: dict) -> None:
    merged_dir = Path(cfg["run_dir"]) / "merged"
    if args.merged and not (merged_dir / "config.json").exists():
        raise errors.RunError(f"no merged model at {merged_dir}: train with --merge, or drop --merged")


def finetuned(base, cfg: dict, args, device):
    """The reassembled adapter through stock PEFT, or the merged checkpoint as a plain transformers model."""
    if not args.merged:
        return PeftModel.from_pretrained(base, cfg["adapter"]).eval()
    model = AutoModelForCausalLM.from_pretrained(
        Path(cfg["run_dir"]) / "merged", dtype=base.dtype, device_map={"": device}
    ).eval()
    model.config.use_cache = True
    return model


if __name__ == "__main__":
    generation.infer_main(__doc__, "tp-sp-ft", finetuned, add_flags, check)
