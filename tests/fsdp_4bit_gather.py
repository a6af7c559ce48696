"""Under torchrun (2 ranks, gloo): the tiny Qwen3 quantized to NF4 as fsdp-ft --quant nf4 loads it, sharded by the
script's own `shard_model`, then each unit all-gathered (`unshard`): every 4-bit weight must come back as the bytes
it was quantized to, with its quantization state beside it. Rank 0 writes what it compared to OUT (a JSON file).

    torchrun --nproc_per_node=2 tests/fsdp_4bit_gather.py OUT
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ftkit import lora, models, ranks  # noqa: E402


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    script = runpy.run_path(str(ROOT / "experiments" / "fsdp-ft" / "train.py"))
    device = torch.device("cpu")
    with ranks.rank0_first():  # rank 0 builds the tiny checkpoint in the cache, then every rank quantizes it
        model = models.load_model("tiny", quant="nf4", dtype=torch.float32, device=device, seed=0)
    model = lora.apply_lora(model, 8, 16.0, 0.0, seed=0)
    quantized = {  # each 4-bit weight's bytes and its quantization state (absmax per block, code, shape)
        name: (module, module.weight.detach().clone(), module.weight.quant_state)
        for name, module in model.named_modules()
        if hasattr(module._parameters.get("weight"), "quant_state")  # the Linear4bit itself, not PEFT's wrapper
    }
    args = SimpleNamespace(
        param_dtype="fp32",
        reduce_dtype="fp32",
        output_dtype=None,
        cpu_offload=False,
        wrap_class="Qwen3DecoderLayer",
        reshard_after_forward=True,
        prefetch=1,
    )
    units = script["shard_model"](model, args, device, dist.get_world_size())
    sharded = {name: module.weight.to_local().numel() for name, (module, _, _) in quantized.items()}
    compared = {}
    for unit in units:
        unit.unshard()
        for name, (module, before, state) in quantized.items():
            if any(module is m for m in unit.modules()):
                weight = module.weight
                # Where Linear4bit.forward finds the state: on the weight, else on the module (bitsandbytes'
                # fix_4bit_weight_quant_state_from_module); never in the all-gather.
                found = getattr(weight, "quant_state", None) or getattr(module, "quant_state", None)
                compared[name] = {
                    "dtype": str(weight.dtype),
                    "bytes": weight.numel(),
                    "shard_bytes": sharded[name],
                    "equal": bool(torch.equal(weight.detach(), before)),
                    "same_quant_state": found is not None and torch.equal(found.absmax, state.absmax),
                }
        unit.reshard()
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"world": dist.get_world_size(), "weights": compared}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
