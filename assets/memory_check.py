"""A single-gpu-ft run's measured CUDA peak per step beside the memory model's prediction for that step's batch.

    uv run python assets/memory_check.py devlogs/runs/single-gpu-ft/gpu-4b-shape-lora-bf16 [--data PATH]

The summary's `memory_predicted` is an upper bound: micro-batches at full --max-length, logits at every position.
This rebuilds the run's own global batches from its config (same data, tokenizer, seed), and for each step predicts
with the step's widest micro-batch and its most answer positions (`logit_positions`: the lm_head runs on those
only), then prints it beside the step's `peak_allocated` from metrics.jsonl. The data are the run's unless --data
points at another copy of the same data (a run measured on another machine records that machine's path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ftkit import batching, data, models, prepare
from ftkit.memory import ModelShape, predict

GIB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="a run directory (or a devlog run folder) with summary.json, metrics.jsonl")
    p.add_argument("--data", default=None, help="where this machine has the run's data [the run's --data]")
    p.add_argument(
        "--fp32-adapters",
        action="store_true",
        help="the run computed its LoRA adapters in fp32 (PEFT's default; the scripts before they computed them in "
        "bf16 with lora.adapters_compute_in): the memory model's fp32_adapter_compute branch",
    )
    opts = p.parse_args()
    summary = json.loads((opts.run / "summary.json").read_text())
    if summary["config"].get("experiment") != "single-gpu-ft":
        raise SystemExit(f"{opts.run}: a single-gpu-ft run is needed (the prediction here is the one-device one)")
    args = argparse.Namespace(**summary["config"])
    args.data = opts.data or args.data
    rows = [json.loads(line) for line in (opts.run / "metrics.jsonl").read_text().splitlines()]
    measured = {r["step"]: r["peak_allocated"] for r in rows if r.get("peak_allocated")}
    if not measured:
        raise SystemExit(f"{opts.run}: no CUDA peak in metrics.jsonl (a CPU run reports RSS, which this cannot check)")

    with contextlib.redirect_stdout(sys.stderr):  # stdout is the table alone
        splits = data.load_splits(args.data, args.data_revision)
        _, train_set, _, _ = prepare.encode_data(args, splits)
    batches = batching.GlobalBatches(train_set, args.batch_size, args.seed)
    shape = ModelShape.from_config(models.model_config(args.model, vocab_size=None))
    print("| step | widest micro-batch | answer positions (k) | predicted GiB | measured GiB | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for step in sorted(measured):
        mbs = list(batches.micro_batches(step - 1, args.micro_batch_size))
        width = max(mb["input_ids"].shape[1] for mb in mbs)
        k = max(mb["logit_positions"].shape[1] for mb in mbs)
        total = predict(
            shape,
            quant=args.quant,
            dtype=args.dtype,
            lora_rank=args.lora_rank,
            lora_dropout=args.lora_dropout,
            micro_batch_size=args.micro_batch_size,
            seq_len=width,
            grad_checkpointing=args.grad_checkpointing,
            logit_positions=k,
            fp32_adapter_compute=opts.fp32_adapters,
        ).total
        got = measured[step]
        print(f"| {step} | {width} | {k} | {total / GIB:.3f} | {got / GIB:.3f} | {got / total:.3f} |")


if __name__ == "__main__":
    main()
