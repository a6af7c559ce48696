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

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from ftkit import data, generation, run


def main() -> None:
    p = generation.infer_parser(__doc__.splitlines()[0], experiment="tp-sp-ft")
    p.add_argument("--merged", action="store_true", help="use <run>/merged (train.py --merge) instead of the adapter")
    args = p.parse_args()
    args.num_examples = args.num_examples or (4 if args.smoke else 20)
    args.max_new_tokens = args.max_new_tokens or (32 if args.smoke else 160)
    device = run.device_for(args)
    cfg = generation.run_config(args)
    merged_dir = Path(cfg["run_dir"]) / "merged"
    if args.merged and not (merged_dir / "config.json").exists():
        raise run.RunError(f"no merged model at {merged_dir}: train with --merge, or drop --merged")

    tokenizer, formatter, splits, base = generation.load_for_inference(cfg, device)
    examples = generation.held_out(splits[args.split], args.num_examples)
    base_out = generation.summarize(base, tokenizer, formatter, examples, args.max_new_tokens, device)
    if args.merged:
        model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=base.dtype, device_map={"": device}).eval()
        model.config.use_cache = True
    else:
        model = PeftModel.from_pretrained(base, cfg["adapter"]).eval()
    tuned_out = generation.summarize(model, tokenizer, formatter, examples, args.max_new_tokens, device)
    generation.report(examples, [ex.answer for ex in examples], base_out, tuned_out, Path(cfg["run_dir"]), args.split)


if __name__ == "__main__":
    torch.manual_seed(0)
    try:
        main()
    except (run.RunError, run.CheckpointError, data.DataError) as e:
        run.fail(str(e))
