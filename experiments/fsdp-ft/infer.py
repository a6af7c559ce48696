"""Summaries from the FSDP LoRA adapter for held-out AMI meeting spans, with ROUGE vs the base model.

    uv run python experiments/fsdp-ft/infer.py            # the latest runs/fsdp-ft run
    uv run python experiments/fsdp-ft/infer.py --smoke    # the latest CPU walkthrough run

FSDP trains shards, but the script gathers the adapter onto rank 0 at the end and saves it as an ordinary PEFT
adapter: inference is one process on one device (bf16 on a GPU, fp32 on the CPU), the same as the single-GPU
experiment's. The base model is rebuilt exactly as the training run built it (its config.json: model, dtype,
seed; 4-bit NF4 for a --quant nf4 run), the adapter is loaded with stock `PeftModel.from_pretrained`, and both
the base and the finetuned model summarize the same examples greedily.
"""

from __future__ import annotations

from peft import PeftModel

from ftkit import generation


def finetuned(base, cfg: dict, args, device):
    """The run's adapter is a stock PEFT adapter: PEFT loads it onto the rebuilt base as it would any other."""
    return PeftModel.from_pretrained(base, cfg["adapter"]).eval()


if __name__ == "__main__":
    generation.infer_main(__doc__, "fsdp-ft", finetuned)
