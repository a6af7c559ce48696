"""Summaries of held-out whole meetings from the context-parallel LoRA adapter, with ROUGE vs the base model.

    uv run python experiments/cp-ft/infer.py            # the latest runs/cp-ft run
    uv run python experiments/cp-ft/infer.py --smoke    # the latest CPU walkthrough run

Context parallelism splits the training sequences, not the model: every rank held the same adapter, and rank 0
saved it as an ordinary PEFT adapter. Inference is one process on one device with the model's own attention
(a whole meeting's prompt and its summary need no gradients, and fit one GPU), on the run's --task: whole meetings.
"""

from __future__ import annotations

from peft import PeftModel

from ftkit import generation


def finetuned(base, cfg: dict, args, device):
    """The run's adapter is a stock PEFT adapter: PEFT loads it onto the rebuilt base as it would any other."""
    return PeftModel.from_pretrained(base, cfg["adapter"]).eval()


if __name__ == "__main__":
    generation.infer_main(__doc__, "cp-ft", finetuned)
