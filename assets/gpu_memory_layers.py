"""What a GPU allocates beyond the memory model: single-gpu-ft's optimizer step at Qwen3-4B's widths with a few
decoder layers, on real tensors, its CUDA peak beside `ftkit/memory.py`'s prediction for the same shape.

    python assets/gpu_memory_layers.py [--layers 1 2] [--micro-steps 2]     # needs a CUDA GPU; JSON lines out

The model is built as `ftkit.realscale` builds it from the script's own code (bf16 base, PEFT LoRA on all seven
projections, adapters computing in bf16 under autocast, checkpointing on), with random weights; each case runs two
optimizer steps of `--micro-steps` micro-batches and reports the second step's peak (AdamW's state exists by
then). Cases: every row full length (transformers leaves the causal mask to SDPA), and the second row half
padding (a 4-D mask is built and SDPA gets it). The difference between two layer counts is what one more decoder
layer costs; the rest is what the model-wide terms (embedding, lm_head, loss, optimizer) cost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch

from ftkit import batching, cli, data, lora, metrics, models
from ftkit.realscale import builders, command, configuration, step

GIB = 2**30


def micro_batch(width: int, answer: int, vocab: int, padded: bool, micro_batch_size: int) -> dict:
    """`realscale.step.synthetic_micro_batch`'s full-length rows; with `padded`, the last row is half as long (right-
    padded by `batching.collate`, as the scripts' batches are)."""
    mb = step.synthetic_micro_batch(micro_batch_size, width, answer, vocab)
    if not padded:
        return mb
    items = [
        data.Encoded(input_ids=ids[:n].tolist(), labels=labels[:n].tolist(), trimmed=False)
        for ids, labels, n in zip(mb["input_ids"], mb["labels"], [width] * (micro_batch_size - 1) + [width // 2])
    ]
    for item in items[-1:]:  # the short row's answer: its own last `answer` tokens
        item.labels[:] = [data.IGNORE_INDEX] * (len(item.labels) - answer) + item.input_ids[-answer:]
    return batching.collate(items)


def measure(layers: int, padded: bool, opts: argparse.Namespace) -> dict:
    script = cli.load_experiment("single-gpu-ft")
    args = configuration.script_args(script, command.parse_args(["--technique", "single", "--quant", "none"]))
    device, dtype = torch.device("cuda"), cli.torch_dtype(args.dtype)
    model, _ = builders.build("single", script, args, 1, device, layers)
    builders.materialise(model, device)
    with torch.no_grad():  # values do not change what is allocated; finite ones keep the step well defined
        for p in model.parameters():
            p.normal_(0, 0.02)
    config = model.config
    mb = batching.to_device(micro_batch(args.max_length, opts.answer_tokens, config.vocab_size, padded, 2), device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    n_target = int((mb["targets"] != data.IGNORE_INDEX).sum()) * opts.micro_steps
    peaks = []
    for _ in range(2):  # single-gpu-ft's step (experiments/single-gpu-ft/train.py), its metrics left out
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(opts.micro_steps):
            with lora.compute_autocast(device, dtype):
                out = model(
                    input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], logits_to_keep=mb["logit_positions"]
                )
                loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
            del out
            loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    predicted = metrics.predicted_memory(config, args, "single", quant="none", logit_positions=mb["targets"].shape[1])
    del model, optimizer, trainable, mb
    torch.cuda.empty_cache()
    return {
        "layers": layers,
        "padded": padded,
        "width": args.max_length,
        "micro_batch_size": 2,
        "answer_positions": opts.answer_tokens,
        "peak_step1_bytes": peaks[0],
        "peak_bytes": peaks[1],
        "predicted_bytes": int(predicted["total"]),
        "excess_bytes": peaks[1] - int(predicted["total"]),
        "attention": models.attention_implementation(device, dtype),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="decoder layer counts to run [1 2]")
    p.add_argument("--micro-steps", type=int, default=2, help="micro-batches per optimizer step [2]")
    p.add_argument("--answer-tokens", type=int, default=200, help="answer positions per row (the lm_head's) [200]")
    opts = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this measures a CUDA allocator's peak: run it on a machine with a CUDA GPU")
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON lines alone
        rows = [measure(n, padded, opts) for padded in (False, True) for n in opts.layers]
    for row in rows:
        print(json.dumps(row))
    for padded in (False, True):
        by = {r["layers"]: r for r in rows if r["padded"] == padded}
        lo, hi = min(by), max(by)
        if hi > lo:
            per = (by[hi]["peak_bytes"] - by[lo]["peak_bytes"]) / (hi - lo)
            model = (by[hi]["predicted_bytes"] - by[lo]["predicted_bytes"]) / (hi - lo)
            print(json.dumps({"padded": padded, "per_layer_measured": per, "per_layer_predicted": model}))


if __name__ == "__main__":
    main()
