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

from peft import PeftModel

from ftkit import generation


def finetuned(base, cfg: dict, args, device):
    """The run's adapter is a stock PEFT adapter: PEFT loads it onto the rebuilt base as it would any other."""
    return PeftModel.from_pretrained(base, cfg["adapter"]).eval()


if __name__ == "__main__":
    generation.infer_main(__doc__, "pp-ft", finetuned)
