"""Under torchrun (2 ranks, gloo): why fsdp-ft runs a 4-bit base's decoder layers eager. The tiny Qwen3 in NF4 with
LoRA, as fsdp-ft builds it, its layers compiled (`compilation.compile_layers` with no eager_because, the backend
FTKIT_COMPILE_BACKEND names) and sharded by the script's own `shard_model`; then one training forward. Rank 0 writes
what happened to OUT (a JSON file): the error dynamo stopped with, or none if the forward ran.

    torchrun --nproc_per_node=2 tests/fsdp_4bit_compile.py OUT
"""

from __future__ import annotations

import json
import runpy
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ftkit import compilation, lora, models, ranks  # noqa: E402


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    script = runpy.run_path(str(ROOT / "experiments" / "fsdp-ft" / "train.py"))
    device = torch.device("cpu")
    with ranks.rank0_first():  # rank 0 builds the tiny checkpoint in the cache, then every rank quantizes it
        model = models.load_model("tiny", quant="nf4", dtype=torch.float32, device=device, seed=0)
    lora.checkpoint_activations(model)
    model = lora.apply_lora(model, 8, 16.0, 0.0, seed=0)
    compilation.compile_layers(model, True)  # what --compile would do without the script's eager_because
    args = SimpleNamespace(
        param_dtype="fp32",
        reduce_dtype="fp32",
        output_dtype=None,
        cpu_offload=False,
        wrap_class="Qwen3DecoderLayer",
        reshard_after_forward=True,
        prefetch=1,
    )
    script["shard_model"](model, args, device, dist.get_world_size())
    model.train()
    ids = torch.arange(64).reshape(1, 64) + 10 * dist.get_rank()
    try:
        model(input_ids=ids).logits.sum().backward()
        error = None
    except Exception as e:  # dynamo's Unsupported (or whatever stopped it), with the frames it names
        error = {"type": type(e).__name__, "text": "".join(traceback.format_exception(e))[-6000:]}
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"error": error}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
