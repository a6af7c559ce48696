"""What the LoRA adapters cost in one Qwen3-4B decoder layer, by the dtype they compute in.

    uv run python assets/lora_layer_bench.py            # a CUDA GPU: Qwen3-4B's layer, micro-batch 2 x 2048
    uv run python assets/lora_layer_bench.py --smoke    # any machine: a tiny layer, to check the script runs

One decoder layer of Qwen3-4B's shape (bf16, random weights), PEFT LoRA r=16 on its seven projections with the
reference dropout 0.05, forward + backward of a micro-batch, timed with CUDA events. Variants:

- `fp32-adapters` (the scripts today): peft casts each projection's input to the adapters' fp32, so every
  LoRA'd projection makes an fp32 copy of its input, drops it out in fp32, runs two fp32 matmuls, and adds
  an fp32 update into the bf16 output (promoted to fp32, cast back);
- `fp32-adapters-tf32`: the same with TF32 matmuls allowed (`torch.backends.cuda.matmul.allow_tf32`);
- `autocast-bf16`: adapters still fp32 (the optimizer's master weights), peft's input cast switched off
  (`peft.helpers.disable_input_dtype_casting`) and the forward under `torch.autocast(bf16)`: the adapter
  matmuls run in bf16 on the bf16 activations;
- `no-adapters`: the frozen layer alone, the floor.

Prints one JSON object per variant: milliseconds per forward + backward (median of --repeats), the peak
memory, and the ratio to `no-adapters`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from peft import inject_adapter_in_model
from peft.helpers import disable_input_dtype_casting
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from ftkit.lora import lora_config
from ftkit.models import QWEN3_4B_CONFIG, TINY_CONFIG

VARIANTS = ("fp32-adapters", "fp32-adapters-tf32", "autocast-bf16", "no-adapters")


def build(config: Qwen3Config, variant: str, device: torch.device, dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = Qwen3DecoderLayer(config, layer_idx=0).to(device=device, dtype=torch.bfloat16)
    layer.requires_grad_(False)
    if variant != "no-adapters":
        # peft's LoRA weights are created in fp32 beside the bf16 base, as get_peft_model does for the scripts.
        layer = inject_adapter_in_model(lora_config(16, 32.0, dropout), layer)
        for name, p in layer.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
                p.requires_grad_(True)
                torch.nn.init.normal_(p, std=0.02)  # lora_B is zero at init; any non-zero values do here
    return layer


def time_variant(args, config: Qwen3Config, variant: str, device: torch.device) -> dict:
    layer = build(config, variant, device, args.lora_dropout)
    rotary = Qwen3RotaryEmbedding(config).to(device)
    x = torch.randn(args.micro_batch_size, args.max_length, config.hidden_size, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)  # a checkpointed layer's input: backward computes its gradient
    positions = torch.arange(args.max_length, device=device)[None].expand(args.micro_batch_size, -1)
    cos_sin = rotary(x, positions)
    cuda = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = variant == "fp32-adapters-tf32"
    autocast = variant == "autocast-bf16"

    def step() -> None:
        casting = disable_input_dtype_casting(layer) if autocast else contextlib.nullcontext()
        with casting, torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = layer(x, position_embeddings=cos_sin, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()

    times = []
    for i in range(args.warmup + args.repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            step()
            elapsed = (time.perf_counter() - t0) * 1e3
        if i == args.warmup - 1 and cuda:
            torch.cuda.reset_peak_memory_stats()
        if i >= args.warmup:
            times.append(elapsed)
    row = {"variant": variant, "ms_fwd_bwd": statistics.median(times), "ms_spread": max(times) - min(times)}
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    torch.backends.cuda.matmul.allow_tf32 = False
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny layer on the CPU (checks the script, times nothing)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--max-length", type=int, default=None, help="[2048; smoke: 128]")
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    args.max_length = args.max_length or (128 if args.smoke else 2048)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark times a GPU; add --smoke to check the script on the CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    config = Qwen3Config(**(TINY_CONFIG if args.smoke else QWEN3_4B_CONFIG), attn_implementation="sdpa")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (--smoke: not a measurement)"
    print(json.dumps({"device": where, "torch": torch.__version__, "layer": "Qwen3-4B" if not args.smoke else "tiny"}))
    rows = [time_variant(args, config, v, device) for v in VARIANTS]
    floor = rows[-1]["ms_fwd_bwd"]
    for row in rows:
        print(json.dumps({**row, "x_no_adapters": row["ms_fwd_bwd"] / floor}))


if __name__ == "__main__":
    main()
