"""Summaries from the FSDP x TP LoRA adapter for held-out AMI meeting spans, with ROUGE vs the base model.

    uv run python experiments/fsdp-tp-ft/infer.py            # the latest runs/fsdp-tp-ft run
    uv run python experiments/fsdp-tp-ft/infer.py --smoke    # the latest CPU walkthrough run

Training split every adapter over a 2-D mesh (TP slices, each sharded again by FSDP); train.py gathered the
pieces onto rank 0 and saved them as an ordinary PEFT adapter under the unsharded model's names: inference is one
process on one device (bf16 on a GPU, fp32 on the CPU), the same as the single-GPU experiment's. The base model
is rebuilt exactly as the training run built it (its config.json: model, dtype, seed; never 4-bit), the adapter
is loaded with stock `PeftModel.from_pretrained`, and both the base and the finetuned model summarize the same
examples greedily.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel

from ftkit import data, generation, run


def main() -> None:
    p = generation.infer_parser(__doc__.splitlines()[0], experiment="fsdp-tp-ft")
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
