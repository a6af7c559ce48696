"""Per-step metrics, the run summary, FLOPs and MFU, memory and hardware readings.

MFU convention (stated in every summary): model FLOPs per step / (step time x peak bf16 dense FLOP/s x devices).
For LoRA the frozen base needs no weight gradients, so a real (non-pad) token costs about
    4 * N_frozen   (forward 2N + input-gradient 2N through the frozen matmuls)
  + 6 * N_lora     (forward, input and weight gradients of the adapters)
  + attention      (QK^T and AV: 4 * L * d * s per token forward for full attention, halved for the causal
                    mask, x3 for forward + backward: 6 * L * d * s, with s the sequence length)
where N counts the matmul parameters (the tied lm_head included, the embedding lookup not). Activation
checkpointing's recomputed forward is not counted (PaLM's MFU, Chowdhery et al. 2022, arXiv 2204.02311, App. B).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch

MFU_CONVENTION = (
    "model FLOPs per real token = 4*N_frozen + 6*N_lora + 6*layers*heads*head_dim*seq_len (causal attention, "
    "fwd+bwd); N = matmul parameters incl. lm_head; checkpoint recompute not counted; "
    "MFU = FLOPs / (step time * peak dense bf16 FLOP/s * devices)"
)

# Dense bf16 tensor-core peak, FLOP/s, from NVIDIA's datasheets (without sparsity). Matched on
# torch.cuda.get_device_name(); the most specific name first.
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
]


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((f for key, f in PEAK_BF16_FLOPS if key in name), None)


def matmul_params(config) -> int:
    """Parameters that take part in matmuls, from the model config (logical counts, so a 4-bit base counts
    the same as a bf16 one): the seven projections per layer and the lm_head."""
    h, hd = config.hidden_size, config.head_dim
    attn = h * config.num_attention_heads * hd * 2 + h * config.num_key_value_heads * hd * 2
    mlp = 3 * h * config.intermediate_size
    return config.num_hidden_layers * (attn + mlp) + config.vocab_size * h


def step_flops(seq_lens: list[int], config, n_lora: int) -> float:
    """Model FLOPs of one optimizer step over sequences of the given real lengths (see the module doc)."""
    per_token = 4 * matmul_params(config) + 6 * n_lora
    d = config.num_attention_heads * config.head_dim
    return float(sum(s * per_token + 6 * config.num_hidden_layers * d * s * s for s in seq_lens))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        # Writing 5 to clear_refs resets the kernel's peak-RSS mark (VmHWM) for this process (proc(5)).
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak bytes since the last reset: CUDA allocated/reserved, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return {
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device),
        }
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return {"peak_rss": int(line.split()[1]) * 1024}
    except OSError:
        pass
    scale = 1 if platform.system() == "Darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}


def hardware(device: torch.device, world_size: int) -> dict:
    info = {
        "device": device.type,
        "world_size": world_size,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory=props.total_memory, cuda=torch.version.cuda)
    return info


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "flash-attn"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


class MetricsLog:
    """`metrics.jsonl` (one object per optimizer step) and a progress bar, on rank 0 only."""

    def __init__(self, run_dir: Path, rank: int, total_steps: int, start_step: int = 0, progress: bool = True):
        self.rank, self.rows = rank, []
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = None
        if rank == 0 and progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, row: dict) -> None:
        self.rows.append(row)
        if self.rank != 0:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.bar is not None:
            shown = {k: row[k] for k in ("loss", "eval_loss", "tokens_per_s") if k in row}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
            self.bar.update(1)
        else:
            print(json.dumps(row), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def summary(self) -> dict:
        """Aggregates over the steps this process ran (the first step, which warms up, is kept out of medians
        when there are others)."""
        rows = self.rows[1:] if len(self.rows) > 1 else self.rows
        if not rows:
            return {}
        out = {
            "steps_run": len(self.rows),
            "final_loss": self.rows[-1]["loss"],
            "median_step_time_s": statistics.median(r["step_time_s"] for r in rows),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        }
        if all(r.get("mfu") is not None for r in rows):
            out["median_mfu"] = statistics.median(r["mfu"] for r in rows)
        mem_keys = [k for k in self.rows[0] if k.startswith("peak_")]
        out.update({f"max_{k}": max(r[k] for r in self.rows) for k in mem_keys})
        evals = [r["eval_loss"] for r in self.rows if "eval_loss" in r]
        if evals:
            out["final_eval_loss"] = evals[-1]
        return out


class StepTimer:
    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.t0
