"""Summaries from the tensor-parallel LoRA adapter for held-out AMI meeting spans, with ROUGE vs the base model.

    uv run python experiments/tp-ft/infer.py            # the latest runs/tp-ft run
    uv run python experiments/tp-ft/infer.py --smoke    # the latest CPU walkthrough run

Training split every adapter across the ranks; train.py gathered the shards (`DTensor.full_tensor()`) and saved
them under PEFT's own names for the unsharded model, so inference is one process on one device: the base model
is rebuilt exactly as the training run built it (its config.json), the adapter is loaded with stock
`PeftModel.from_pretrained`, and both the base and the finetuned model summarize the same examples greedily.
"""

from __future__ import annotations

from peft import PeftModel

from ftkit import generation


def finetuned(base, cfg: dict, args, device):
    """The run's adapter is a stock PEFT adapter: PEFT loads it onto the rebuilt base as it would any other."""
    return PeftModel.from_pretrained(base, cfg["adapter"]).eval()


if __name__ == "__main__":
    generation.infer_main(__doc__, "tp-ft", finetuned)
