"""Per-step metrics, the run summary, FLOPs and MFU, memory and hardware readings.

MFU convention (stated in every summary): model FLOPs per step / (step time x peak bf16 dense FLOP/s x devices),
the FLOPs the step needs. For LoRA the frozen base needs no weight gradients, so a real (non-pad) token costs about
    4 * N_frozen   (forward 2N + input-gradient 2N through the frozen projections)
  + 6 * N_lora     (forward, input and weight gradients of the adapters)
  + attention      (QK^T and AV: 4 * L * d * s per token forward for full attention, halved for the causal
                    mask, x3 for forward + backward: 6 * L * d * s, with s the example's length)
and the frozen lm_head 4 * V * h at the positions the loss needs only (the answer tokens: the scripts compute
logits there alone, `logits_to_keep`). N counts the projections' parameters (the embedding lookup is no matmul).
Activation checkpointing's recomputed forward is not counted: it is work the step repeats, not work it needs
(as in PaLM's MFU, Chowdhery et al. 2022, arXiv 2204.02311, App. B). `ftkit.realscale` holds the count to within
5% of torch's FlopCounterMode at Qwen3-4B's shape (tests/test_realscale.py).

This is not PaLM's count, 6N + 12 * L * H * Q * T per token (N every matmul parameter, all trained; attention
unmasked). `palm_step_flops` gives it for the same tokens: with a frozen base it credits 2N per token of weight
gradients never computed, the lm_head's 6 * V * h at every token, and twice the causal attention, so its MFU reads
higher (`tests/test_metrics.py` states the factor at the reference configuration).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from ftkit import hardware, ranks

MFU_CONVENTION = (
    "model FLOPs per real token = 4*N_frozen + 6*N_lora + 6*layers*heads*head_dim*seq_len (causal attention, "
    "fwd+bwd), N = the projections' parameters, plus the frozen lm_head's 4*vocab*hidden at the answer positions "
    "only (where the step computes logits); checkpoint recompute not counted; not PaLM's 6N + 12*L*H*Q*T "
    "(ftkit/metrics.py palm_step_flops); MFU = FLOPs / (step time * peak dense bf16 FLOP/s * devices)"
)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 tensor-core peak FLOP/s of this GPU, from the datasheets (`ftkit/hardware.py`, which matches the
    whole device name); None off CUDA or for a GPU not in the table (`mfu_note` says why)."""
    if device.type != "cuda":
        return None
    entry = hardware.gpu_for_device_name(torch.cuda.get_device_name(device))
    return entry.bf16_flops if entry else None


def mfu_note(device: torch.device) -> str | None:
    """Why this run reports no MFU (its rows' `mfu` and the summary's `peak_flops` are null), naming the device;
    None where it reports one."""
    if device.type != "cuda":
        return f"MFU is reported on CUDA GPUs only (this run: {device.type})"
    return hardware.no_peak_reason(torch.cuda.get_device_name(device))


def matmul_params(config) -> int:
    """Parameters that take part in matmuls, from the model config (logical counts, so a 4-bit base counts
    the same as a bf16 one): the seven projections per layer and the lm_head."""
    h, hd = config.hidden_size, config.head_dim
    attn = h * config.num_attention_heads * hd * 2 + h * config.num_key_value_heads * hd * 2
    mlp = 3 * h * config.intermediate_size
    return config.num_hidden_layers * (attn + mlp) + config.vocab_size * h


def step_flops(seq_lens: list[int], config, n_lora: int, logit_positions: int | None = None) -> float:
    """Model FLOPs of one optimizer step over sequences of the given real lengths (see the module doc): the MFU
    convention, which counts the lm_head at every token. With `logit_positions`, the lm_head at that many positions
    instead (the scripts compute logits at the answer positions only: `logits_to_keep`)."""
    lm_head = config.vocab_size * config.hidden_size
    per_token = 4 * (matmul_params(config) - lm_head) + 6 * n_lora
    d = config.num_attention_heads * config.head_dim
    positions = sum(seq_lens) if logit_positions is None else logit_positions
    layers = sum(s * per_token + 6 * config.num_hidden_layers * d * s * s for s in seq_lens)
    return float(layers + 4 * lm_head * positions)


def palm_step_flops(seq_lens: list[int], config) -> float:
    """PaLM's model FLOPs for the same sequences (Chowdhery et al. 2022, App. B): 6N + 12 * L * H * Q * T per token,
    N every matmul parameter (the lm_head included) as if all were trained, attention without the causal halving.
    For comparing this project's MFU with reports that use PaLM's convention."""
    d = config.num_attention_heads * config.head_dim
    return float(sum(s * (6 * matmul_params(config) + 12 * config.num_hidden_layers * d * s) for s in seq_lens))


def step_row(
    *,
    step: int,
    loss: float,
    grad_norm: float,
    lr: float,
    target_tokens: int,
    lengths: list[int],
    config,
    n_lora: int,
    seconds: float,
    peak: float | None,
    devices: int,
    device: torch.device,
    **technique,
) -> dict:
    """One optimizer step's metrics row: the loss, the real (non-pad) tokens of the global batch and their rate,
    MFU by the module's convention over `devices` GPUs, what the technique adds, and the peak memory."""
    tokens = sum(lengths)
    flops = step_flops(lengths, config, n_lora, logit_positions=target_tokens)  # the lm_head where the loss needs it
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "target_tokens": target_tokens,
        "tokens": tokens,
        "step_time_s": seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": flops / (seconds * peak * devices) if peak else None,
        **technique,
        **peak_memory(device),
    }


def release_cached_memory(device: torch.device) -> None:
    """Once, after a rank that loaded the whole model kept only its slice (tp-ft, tp-sp-ft, pp-ft, fsdp-tp-ft): the
    freed weights' blocks go back to the driver. The caching allocator would otherwise keep them reserved for the
    whole run - `peak_reserved` at least the whole bf16 model on every rank - and out of reach of what NCCL and
    cuBLAS allocate outside it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


def kv_cache_bytes(cache) -> int:
    """Bytes a transformers KV cache (`past_key_values`) holds: every layer's keys and values."""
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
        if isinstance(t, torch.Tensor)
    )


def on_one_device(*scalars: torch.Tensor) -> torch.Tensor:
    """A step's scalars as one fp64 vector on the first one's device, wherever each of them was computed: with
    `fsdp-ft --cpu-offload` the gradient norm comes back on the CPU (the gradients live there) beside the loss on
    the GPU, and torch.stack/cat refuse tensors on two devices. fp64 holds every fp32 value exactly."""
    device = scalars[0].device
    return torch.stack([s.detach().reshape(()).to(device, torch.float64) for s in scalars])


def host_values(*scalars: torch.Tensor) -> list[float]:
    """The step's device scalars as Python floats in one copy to the host: one wait for the GPU per optimizer
    step, after the step's work is queued, instead of one per scalar."""
    return on_one_device(*scalars).tolist()


class HostSyncCounter:
    """Counts the calls, made from this project's own code (experiments/ and ftkit/), that copy a tensor's value to
    the host: .item(), .tolist(), bool(), float(), int(). On CUDA each one makes the host wait for the GPU to
    finish everything queued before it, so one inside the micro-batch loop stalls the pipeline of kernel launches.
    On CPU nothing waits, but the calls are the same: counting them there is how the tests keep the GPU path to
    at most one wait per optimizer step. Library code (transformers, peft, torch) is not counted.

    While active it wraps those five methods on torch.Tensor (not every op, as a TorchFunctionMode would, so a
    counted run is not slowed down)."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__")
    OURS = (str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "experiments"))

    def __init__(self):
        self.count = 0
        self._originals: dict[str, object] = {}

    def _wrap(self, method):
        def counted(tensor, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(self.OURS):
                self.count += 1
            return method(tensor, *args, **kwargs)

        return counted

    def __enter__(self):
        for name in self.NAMES:
            self._originals[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(self._originals[name]))
        return self

    def __exit__(self, *exc):
        for name, method in self._originals.items():
            setattr(torch.Tensor, name, method)
        self._originals.clear()


class MetricsLog:
    """`metrics.jsonl` (one object per optimizer step) and a progress bar, on rank 0 only.

    With FTKIT_COUNT_HOST_SYNCS=1 in the environment (the tests set it), each row also gets `host_syncs`: the
    HostSyncCounter's count since the previous row, i.e. over one optimizer step with its metrics (and the eval
    or checkpoint that came with the step before)."""

    def __init__(self, run_dir: Path, rank: int, total_steps: int, start_step: int = 0, progress: bool = True):
        self.rank, self.rows, self.restart = rank, [], ranks.restart_count()
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = None
        self.syncs = None
        if os.environ.get("FTKIT_COUNT_HOST_SYNCS") == "1":
            self.syncs = HostSyncCounter()
            self.syncs.__enter__()
        if rank == 0 and progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, row: dict) -> None:
        if self.restart:
            row["restart"] = self.restart  # the steps run after torchrun restarted the worker group
        if self.syncs is not None:
            row["host_syncs"], self.syncs.count = self.syncs.count, 0
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
        if self.syncs is not None:
            self.syncs.__exit__(None, None, None)
            self.syncs = None
        if self.bar is not None:
            self.bar.close()

    def summary(self) -> dict:
        """Aggregates over the steps this process ran (the first step, which warms up, is kept out of medians
        when there are others)."""
        rows = self.rows[1:] if len(self.rows) > 1 else self.rows
        if not rows:
            return {"steps_run": 0}
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


class RunLog(MetricsLog):
    """A run's MetricsLog that also holds what its step rows and its summary take from the run as a whole: the
    run's config.json, the model config and the adapter size (FLOPs), the devices and their peak FLOP/s (MFU)."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        args,
        start_step: int,
        *,
        run_config: dict,
        model_config,
        n_lora: int,
        devices: int,
        device: torch.device,
    ):
        super().__init__(run_dir, rank, total_steps=args.max_steps, start_step=start_step, progress=args.progress)
        self.run_dir, self.run_config, self.model_config, self.n_lora = run_dir, run_config, model_config, n_lora
        self.devices, self.device, self.peak = devices, device, peak_flops(device)
        self.mfu_note = mfu_note(device)
        if rank == 0 and self.mfu_note and device.type == "cuda":
            print(f"note: {self.mfu_note}", file=sys.stderr, flush=True)  # once per run; summary.json keeps it

    def row(self, **measured) -> dict:
        """`step_row` for this run: `measured` is what the step measured (step, loss, ..., the technique's)."""
        return step_row(
            config=self.model_config,
            n_lora=self.n_lora,
            peak=self.peak,
            devices=self.devices,
            device=self.device,
            **measured,
        )

    def run_summary(self, last_step: int, predicted: dict, note: str, **technique) -> dict:
        """`run_summary` for this run."""
        return run_summary(
            self.run_config,
            self,
            run_dir=self.run_dir,
            last_step=last_step,
            peak=self.peak,
            mfu_note=self.mfu_note,
            predicted=predicted,
            note=note,
            **technique,
        )


class StepTimer:
    """The time of a block of work on `device`. On CPU, wall-clock. On CUDA the host only queues kernels, so a
    wall-clock would measure the launches: CUDA events are recorded on the stream at the start and the end,
    and `seconds` waits for the end event (the one wait, which the step's metrics need anyway)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.end.record()
        else:
            self.elapsed = time.perf_counter() - self.t0

    @property
    def seconds(self) -> float:
        if self.device.type == "cuda":
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.elapsed


def memory_note(device: torch.device, extra: str = "") -> str:
    """What the summary's predicted and measured memory are."""
    measured = (
        "CUDA peak allocated (peak_reserved: what the caching allocator held at its peak, the allocated bytes plus "
        "its cached free blocks; NCCL's buffers and the CUDA context are outside it)"
        if device.type == "cuda"
        else "process peak RSS, which also counts Python, libraries and data, so it is not comparable with the "
        "model's GPU bytes"
    )
    predicted = "predicted: the memory model (ftkit/memory.py) at micro-batch x --max-length"
    return f"{predicted}; measured on rank 0: {extra}{measured}"


def run_config(args, machine: dict, data_stats: dict, counts: dict, accum: int, **technique) -> dict:
    """config.json: the resolved flags, versions, hardware, data statistics and parameter counts of a run, and the
    torchrun launch (which attempt) that wrote it."""
    return {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": hardware.versions(),
        "hardware": machine,
        "data": data_stats,
        "parameters": counts,
        "accumulation_steps": accum,
        **ranks.launch_info(),
        **technique,
    }


def predicted_memory(config, args, technique: str, **setting) -> dict:
    """The memory model's bytes (ftkit/memory.py) for this run's model and flags; `setting`: what the technique
    adds (quant, world_size, reshard_after_forward, pp_schedule, ...). Logits are counted at every position, an
    upper bound: the scripts compute them at the answer positions only. FSDP's accumulation steps come from the
    flags (with more than one, its gradients accumulate unsharded)."""
    from ftkit.batching import accumulation_steps
    from ftkit.lora import checkpoint_every
    from ftkit.memory import ModelShape, predict

    if technique == "fsdp":
        dp = setting.get("world_size", 1) // setting.get("tp", 1)
        setting["accumulation_steps"] = accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=dp)

    return predict(
        ModelShape.from_config(config),
        technique=technique,
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        lora_dropout=args.lora_dropout,
        micro_batch_size=args.micro_batch_size,
        seq_len=getattr(args, "micro_batch_tokens", None) or args.max_length,  # a token budget: one row of that many
        grad_checkpointing=args.grad_checkpointing,
        checkpoint_every=checkpoint_every(getattr(args, "checkpointing", None) or "all") or 1,
        **setting,
    ).as_dict()


def run_summary(
    run_config: dict, log: MetricsLog, *, run_dir: Path, last_step: int, peak: float | None, predicted: dict,
    note: str, mfu_note: str | None = None, **technique
) -> dict:  # fmt: skip
    """summary.json: what every run reports (status, the run's config.json, medians and peaks, the MFU
    convention, the GPU's peak or why there is none, the memory prediction), then what the technique adds
    (`technique`: comm theory, bubble, ...)."""
    args = run_config["args"]
    finished = last_step == args["max_steps"]
    return {
        "status": "completed" if finished else f"stopped after step {last_step} (--stop-after); continue with --resume",
        "run_dir": str(run_dir),
        "config": args,
        **{k: v for k, v in run_config.items() if k != "args"},
        **log.summary(),
        **technique,
        "mfu_convention": MFU_CONVENTION,
        "peak_flops": peak,
        "mfu_note": mfu_note,
        "memory_predicted": predicted,
        "memory_note": note,
    }


class SavedActivations:
    """Bytes autograd saves for backward while some modules run (distinct storages, parameters excluded): what a
    region of the model (a decoder layer, its norms) really keeps, to check the memory model's
    `layer_activation_bytes` against. Wrap the forwards in `first_forward(tokens)`: the first one is measured
    (`measured`: bytes per region, and the `tokens` it ran on), the later ones run untouched."""

    def __init__(self, model, regions: dict[str, list[torch.nn.Module]]):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.active: set[str] = set()
        self.saved: dict[str, dict[int, int]] = {name: {} for name in regions}
        self.measured: dict[str, int] = {}
        self.handles = []
        for name, modules in regions.items():
            for m in modules:
                self.handles.append(m.register_forward_pre_hook(lambda *_, n=name: self.active.add(n)))
                self.handles.append(m.register_forward_hook(lambda *_, n=name: self.active.discard(n)))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            for name in self.active:
                self.saved[name][storage.data_ptr()] = storage.nbytes()
        return t  # kept alive by the graph, so its address is not reused by another saved tensor

    def bytes(self) -> dict[str, int]:
        for h in self.handles:
            h.remove()
        return {name: sum(s.values()) for name, s in self.saved.items()}

    @contextlib.contextmanager
    def first_forward(self, tokens: int):
        if self.measured:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield
        self.measured = {**self.bytes(), "tokens": tokens}
