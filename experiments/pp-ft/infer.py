"""Summaries from the pipeline-parallel LoRA adapter for held-out AMI meeting spans, with ROUGE vs the base model.

    uv run python experiments/pp-ft/infer.py            # the latest runs/pp-ft run
    uv run python experiments/pp-ft/infer.py --smoke    # the latest CPU walkthrough run

Training split the model into stages, one or two per rank, and each stage trained the LoRA weights of its own
layers under stage-local names (the second stage's first layer is its `layers.0`). At the end rank 0 gathered
them, renamed each to its global layer index, and saved one stock PEFT adapter for the whole model. So inference
needs no pipeline: one process on one device rebuilds the base model as the training run built it (its
config.json: model, dtype, seed), loads the adapter with `PeftModel.from_pretrained`, and both the base and the
finetuned model summarize the same examples greedily.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel

from ftkit import data, generation, run


def main() -> None:
    p = generation.infer_parser(__doc__.splitlines()[0], experiment="pp-ft")
    args = p.parse_args()
    args.num_examples = args.num_examples or (4 if args.smoke else 20)
    args.max_new_tokens = args.max_new_tokens or (32 if args.smoke else 160)
    device = run.device_for(args)
    cfg = generation.run_config(args)

    tokenizer, formatter, splits, base = generation.load_for_inference(cfg, device)
    examples = generation.held_out(splits[args.split], args.num_examples)
    model = PeftModel.from_pretrained(base, cfg["adapter"]).eval()

    with model.disable_adapter():
        base_out = generation.summarize(model, tokenizer, formatter, examples, args.max_new_tokens, device)
    tuned_out = generation.summarize(model, tokenizer, formatter, examples, args.max_new_tokens, device)
    generation.report(examples, [ex.answer for ex in examples], base_out, tuned_out, Path(cfg["run_dir"]), args.split)


if __name__ == "__main__":
    torch.manual_seed(0)
    try:
        main()
    except (run.RunError, run.CheckpointError, data.DataError) as e:
        run.fail(str(e))
