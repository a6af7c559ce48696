"""Summaries from the single-GPU QLoRA adapter for held-out AMI meeting spans, with ROUGE vs the base model.

    uv run python experiments/single-gpu-ft/infer.py            # the latest runs/single-gpu-ft run
    uv run python experiments/single-gpu-ft/infer.py --smoke    # the latest CPU walkthrough run

The base model is rebuilt exactly as the training run built it (its config.json: model, 4-bit or not, dtype,
seed), the adapter is loaded with stock `PeftModel.from_pretrained`, and both the base and the finetuned model
summarize the same examples greedily (deterministic).
"""

from __future__ import annotations

from peft import PeftModel

from ftkit import generation


def finetuned(base, cfg: dict, args, device):
    """The run's adapter is a stock PEFT adapter: PEFT loads it onto the rebuilt base as it would any other."""
    return PeftModel.from_pretrained(base, cfg["adapter"]).eval()


if __name__ == "__main__":
    generation.infer_main(__doc__, "single-gpu-ft", finetuned)
