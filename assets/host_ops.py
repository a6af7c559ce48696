"""The host's work per micro-batch of single-gpu-ft's training step: aten ops dispatched (eager) or kernels launched by
the compiled decoder layers, counted on this CPU; the planner's host term (ftkit/plan/hosts.py) is these counts times a
cost per op calibrated on the committed H100 profile.

    uv run python assets/host_ops.py          # every configuration below; writes devlogs/runs/plan-host/host-ops.json
    uv run python assets/host_ops.py --check  # the committed file's counts against the H100 profiles' op counts
    uv run python assets/host_ops.py --tables # the planner with these counts against the H100 runs, and its predictions

Each count runs in its own process, with the ftkit of the code it counts on the path: the commits the two H100
sessions ran (`git archive`, so the step is the one the profiles recorded) or this working tree. The model is
Qwen3's architecture at a small width (hidden 64, 32 query and 8 key/value heads of 8, intermediate 128, vocabulary
4096) and a chosen number of decoder layers, built, frozen, checkpointed and given its LoRA adapters by the
scripts' own ftkit calls, in bf16 under the scripts' autocast; the op count of a step does not depend on the width
(the number of ops is what the code does per module, not per element). It counts with torch.profiler on the CPU, as
the H100 profile counted on CUDA, what CUDA would dispatch:

- every `aten::` event, nested ones included (`aten::linear` and the `aten::t`, `aten::matmul`, `aten::mm` under it),
  as the profile's "# of Calls" counts them;
- not the events CUDA does not dispatch: what the CPU runs inside an op that is one kernel on CUDA (the matmuls,
  dropout and its backward, SDPA's CPU kernel, bitsandbytes' ops, the `_foreach_` ops), and the dtype casts the
  CPU's elementwise ops make (CUDA's TensorIterator casts inside the kernel);
- dropout as CUDA runs it (`torch.native_dropout`, one fused kernel), and bitsandbytes' 4-bit matmul as its CUDA
  kernel runs it past 1,536 rows (the absmax dequantized, the weight dequantized, `F.linear`: the committed runs'
  micro-batches are 2 rows of up to 2,048).

Per micro-batch: the first of a step (no gradient yet) and a later one (its LoRA gradients accumulate: one more
`add_` per adapter weight); per step: the gradient clipping and AdamW (foreach) and zero_grad. `--check` compares
the eager counts of the H100 sessions' code with the counts their profiles recorded
(devlogs/runs/single-gpu-ft-gpu/profile-*-step2-ops.txt): the ops the profile lists must come out equal.

Compiled (`--compile`, this tree's `compilation.compile_layers`, inductor): the decoder layers run as compiled graphs
and this CPU's inductor generates C++ kernels where CUDA's would be Triton ones, so the count of launches is a
prediction for CUDA, labelled so: the compiled graphs' kernels (counted with inductor's per-kernel profiling) and
extern calls (matmuls, SDPA, as aten events), plus the eager ops outside the layers (embedding, final norm, lm_head,
loss, backward's engine).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "devlogs" / "runs" / "plan-host" / "host-ops.json"
PROFILES = ROOT / "devlogs" / "runs" / "single-gpu-ft-gpu"
# The commits whose code the H100 sessions ran (devlogs/single-gpu-ft.md): the first session (2026-11-22, adapters in
# fp32, PEFT's cast) and the second (2026-11-23, adapters in bf16 under autocast). Both passed the padding mask.
SOURCES = {"h100-session1": "3564941", "h100-session2": "3d2ae74", "tree": None}
PROFILE_OF = {
    "h100-session1": "profile-lora-bf16-fp32-adapters-step2-ops.txt",
    "h100-session2": "profile-lora-bf16-step2-ops.txt",
}
SMALL = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=32, num_key_value_heads=8, head_dim=8, vocab_size=4096
)
# Ops that are one kernel on CUDA: what the CPU dispatches inside them is not counted.
ONE_KERNEL = (
    "aten::mm",  # on the CPU it resolves conjugates and copies operands for BLAS; cuBLAS takes them as they are
    "aten::bmm",
    "aten::addmm",
    "aten::native_dropout",
    "aten::native_dropout_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "bitsandbytes::",
    "aten::_foreach_",
)
# Elementwise ops whose CPU kernels cast a mixed-dtype operand with a nested aten::to; CUDA's cast in the kernel.
ELEMENTWISE = {
    f"aten::{op}"
    for op in (
        "mul mul_ add add_ div div_ sub sub_ pow rsqrt mean neg cat where masked_fill masked_fill_ sum addcmul_ "
        "addcdiv_ lerp_ clamp sqrt"
    ).split()
}
# The per-layer configurations counted in this tree (layers 2 and 3 give the per-layer count and the rest).
TREE_CONFIGS = [
    dict(layout=layout, quant=quant, grad_checkpointing=ckpt, compile=False)
    for layout in ("padded", "packed")
    for quant in ("none", "nf4")
    for ckpt in (True, False)
] + [dict(layout="packed", quant=quant, grad_checkpointing=True, compile=True) for quant in ("none", "nf4")]


# ---------------------------------------------------------------------------------------------- one count


def _cuda_like(events) -> collections.Counter:
    """Event names, with the events CUDA would not dispatch (see the module doc) counted as "(cpu only)"."""
    c = collections.Counter()
    for e in events:
        drop, child, parent = False, e, e.cpu_parent
        while parent is not None:
            if parent.name.startswith(ONE_KERNEL) and not e.name.startswith("bitsandbytes::"):
                drop = True
                break
            if child.name == "aten::to" and parent.name in ELEMENTWISE:
                drop = True
                break
            child, parent = parent, parent.cpu_parent
        c["(cpu only)" if drop else e.name] += 1
    return c


def _summary(c: collections.Counter) -> dict:
    kernels = sum(v for k, v in c.items() if re.match(r"(graph_\d+_)?cpp_fused|cpp_fused", k))
    return {
        "aten_ops": sum(v for k, v in c.items() if k.startswith("aten::")),
        "custom_ops": sum(v for k, v in c.items() if k.startswith("bitsandbytes::")),
        "compiled_kernels": kernels,
        "cpu_only": c["(cpu only)"],
        "by_name": {k: v for k, v in sorted(c.items()) if k.startswith(("aten::", "bitsandbytes::")) and v},
    }


def count(spec: dict) -> dict:
    """One configuration's counts (run in a process whose ftkit is the code counted)."""
    from unittest import mock

    import torch
    from torch.profiler import ProfilerActivity, profile

    from ftkit import batching, compilation, data, lora, models

    torch.manual_seed(0)
    dtype, dev = torch.bfloat16, torch.device("cpu")
    with mock.patch.dict(models.QWEN3_4B_CONFIG, {**SMALL, "num_hidden_layers": spec["layers"]}):
        model = models.load_model(models.QWEN3_4B_SHAPE, quant=spec["quant"], dtype=dtype, device=dev, seed=0)
    model = lora.freeze_base(model, spec["grad_checkpointing"])
    model = lora.apply_lora(model, 16, 32.0, 0.05, 0)
    if hasattr(lora, "adapters_compute_in"):  # the first session's code computed the adapters in fp32
        model = lora.adapters_compute_in(model, dtype)
    if spec["compile"]:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # each generated kernel a profiler event
        compilation.compile_layers(model, True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)  # foreach: CUDA's default
    model.train()

    def example(n: int) -> data.Encoded:
        ids = list(range(5, 5 + n))
        return data.Encoded(ids, [data.IGNORE_INDEX] * (n - 8) + ids[-8:], False)

    if spec["layout"] == "packed":  # 2 rows of 64: two examples in the first, one in the second
        mb = batching.collate_packed([[example(40), example(20)], [example(32)]], 64)
    else:
        mb = batching.collate([example(40), example(32)])
    autocast = lora.compute_autocast(dev, dtype) if hasattr(lora, "compute_autocast") else contextlib.nullcontext()

    def micro():
        kwargs = dict(input_ids=mb["input_ids"], logits_to_keep=mb["logit_positions"])
        if spec["layout"] == "masked":  # the H100 sessions' call: the padding mask passed
            kwargs["attention_mask"] = mb["attention_mask"]
        else:  # this tree's call (experiments/single-gpu-ft/train.py)
            kwargs.update(position_ids=mb.get("position_ids"), use_cache=False)
        with autocast:
            out = model(**kwargs)
            loss = batching.token_loss_sum(out.logits, mb["targets"]) / 100
        del out
        loss.backward()

    def step():
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def dropout(input, p=0.5, training=True, inplace=False):  # CUDA's F.dropout: one fused kernel
        return torch.native_dropout(input, p, True)[0] if training and p > 0 else input

    class Gemm4bit:  # bitsandbytes' CUDA gemm_4bit past 1,536 rows (backends/cuda/ops.py, _dequant_linear_fallback)
        def default(self, A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, **nested):
            ops = torch.ops.bitsandbytes
            if absmax_8bit is not None:
                absmax = ops.dequantize_blockwise(absmax_8bit, absmax, nested["absmax_code"], 256, torch.float32)
                absmax = absmax + nested["absmax_offset"]
            weight = ops.dequantize_4bit(B, absmax, blocksize, quant_type, shapeB, A.dtype)
            return torch.nn.functional.linear(A, weight, bias)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.nn.functional, "dropout", dropout))
        if spec["quant"] == "nf4":
            stack.enter_context(mock.patch.object(torch.ops.bitsandbytes, "gemm_4bit", Gemm4bit()))
        for _ in range(2):  # warm up (and compile)
            micro()
            step()
        profiles = {}
        for part, fn in (("first", micro), ("later", micro), ("step", step)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            profiles[part] = _summary(_cuda_like(prof.events()))
    return {**spec, **profiles}


# ------------------------------------------------------------------------------------------------ driver


def run_one(spec: dict, source: str | None) -> dict:
    """`count(spec)` in a fresh process, with the ftkit of `source` (a commit) or of this tree."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if source is not None:
            archive = subprocess.run(["git", "archive", source, "ftkit"], cwd=ROOT, check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            env["PYTHONPATH"] = tmp
        out = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(spec)], env=env, capture_output=True, text=True
        )
    if out.returncode:  # recorded, with the error's last line: e.g. a configuration this code cannot compile
        return {**spec, "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def profile_calls(path: Path) -> dict[str, int]:
    """The aten ops of a committed torch.profiler table and their "# of Calls" (the table lists the top 25 rows by
    CUDA time, so not every op)."""
    calls = {}
    for line in path.read_text().splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0].startswith("aten::") and cells[-1].isdigit():
            calls[cells[0]] = int(cells[-1])
    return calls


# SDPA's CUDA kernels (cuDNN's on the H100) and the CPU's, which the count ran
CPU_NAME = {
    "aten::_cudnn_attention_forward": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_cudnn_attention_backward": "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}


def per_step(counts: dict, name: str, micro_batches: int) -> int:
    """An op's count over a step of `micro_batches` micro-batches: the first, the later ones, the step's own."""
    return (
        counts["first"]["by_name"].get(name, 0)
        + (micro_batches - 1) * counts["later"]["by_name"].get(name, 0)
        + counts["step"]["by_name"].get(name, 0)
    )


def check(result: dict) -> list[str]:
    """Each H100 session's eager count beside its profile's calls, per listed op (8 micro-batches in step 2)."""
    lines = []
    for source, name in PROFILE_OF.items():
        counts = next(c for c in result["h100"] if c["source"] == source and c["quant"] == "none")
        for op, calls in profile_calls(PROFILES / name).items():
            counted = per_step(counts, CPU_NAME.get(op, op), 8)
            lines.append(f"{source} {op}: profile {calls}, counted {counted} ({counted - calls:+d})")
    return lines


def h100_setting(**kw):
    from ftkit import hardware
    from ftkit.plan import settings

    gpu = hardware.gpu("h100-sxm")
    link = hardware.LINKS["nvlink4"]
    return settings.Setting(
        config=settings.model_config("Qwen/Qwen3-4B"),
        gpu=gpu,
        gpus=1,
        nodes=1,
        link=link,
        inter_node_link=link,
        memory_bytes=gpu.memory_bytes,
        host="h100-vm",
        **kw,
    )


H100_RUNS = {  # the committed H100 runs, the code each ran, and what it is to the planner
    "gpu-4b-shape-lora-bf16": ("h100-session2", "calibrates the seconds per op (its step 2)"),
    "gpu-4b-shape-qlora-nf4": ("h100-session2", "a check"),
    "gpu-4b-shape-lora-bf16-fp32-adapters": ("h100-session1", "a check"),
    "gpu-4b-shape-qlora-nf4-fp32-adapters": ("h100-session1", "calibrates the 4-bit pass's extra"),
}


def host_tables() -> str:
    """Two markdown tables: the planner against the committed H100 runs (each run's flags, batches and code's op
    count, the calibrated host), and its predictions for the layouts at the reference configuration on that host."""
    import statistics

    from ftkit.plan import hosts, layouts, settings, techniques, timing

    runs = ROOT / "devlogs" / "runs" / "single-gpu-ft"
    lines = [
        "| run | code | ops per micro-batch (counted) | predicted: host s per step | GPU s per step | median step s "
        "| measured median step s | predicted / measured | the run is |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, (source, role) in H100_RUNS.items():
        summary = json.loads((runs / run / "summary.json").read_text())
        c = summary["config"]
        s = h100_setting(  # each run's own batches, in the tiny tokenizer's tokens it ran (before issue 42)
            **settings.run_flags(c), layout="masked", steps=summary["steps_run"], ops_source=source, tokenizer="tiny"
        )
        steps = [timing.step_time(s, "single", {}, c["quant"], st) for st in layouts.layout_steps(s, 1)][1:]
        predicted = statistics.median(p["step_time_s"] for p in steps)
        measured = summary["median_step_time_s"]
        host, gpu = (statistics.median(p[k] for p in steps) for k in ("host_s", "compute_s"))
        lines.append(
            f"| `{run}` | {source} ({SOURCES[source]}) | {hosts.H100_OPS_PER_MICRO[source, c['quant']]:,} | "
            f"{host:.2f} | {gpu:.2f} | {predicted:.2f} | {measured:.2f} | {predicted / measured:.2f} | {role} |"
        )
    lines += [
        "",
        "| layout | decoder layers | quant | host ops per micro-batch | micro-batches per step (median) | padding "
        "| host ops per 1,000 real tokens | predicted: host s | GPU s | step s (median) | tokens/s | bound by |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout, compiled, mfu in (
        ("masked", False, None),
        ("padded", False, None),
        ("packed", False, None),
        ("packed", True, None),
        ("packed", True, 0.4),
    ):
        for quant in ("none", "nf4"):
            source = "h100-session2" if layout == "masked" else "tree"  # masked: the H100 runs' code
            s = h100_setting(layout=layout, compile=compiled, mfu=mfu, ops_source=source)
            r = techniques.evaluate(s, "single", {}, quant)
            layers = ("compiled" if compiled else "eager") + (f", kernels at {mfu:.0%} (assumed)" if mfu else "")
            name = "masked (the H100 runs' code)" if layout == "masked" else layout
            lines.append(
                f"| {name} | {layers} | {quant} | {r['host_ops_per_micro_batch']:,} | {r['micro_batches']:g} | "
                f"{r['padding_fraction']:.1%} | {r['host_ops_per_1000_tokens']:,.0f} | {r['host_s']:.2f} | "
                f"{r['compute_s']:.2f} | {r['step_time_s']:.2f} | "
                f"{r['tokens_per_s']:,.0f} | {r['bound']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--check", action="store_true", help="the committed counts against the H100 profiles")
    p.add_argument("--tables", action="store_true", help="the planner against the H100 runs, and its predictions")
    args = p.parse_args()
    if args.tables:
        print(host_tables(), end="")
        return
    if args.one:
        print(json.dumps(count(json.loads(args.one))))
        return
    if args.check:
        print("\n".join(check(json.loads(OUT.read_text()))))
        return
    import torch

    result = {
        "what": "aten ops dispatched per micro-batch of single-gpu-ft's step as CUDA would dispatch them (eager), or "
        "kernels + ops launched with compiled decoder layers (inductor's C++ kernels on this CPU standing in for "
        "CUDA's Triton ones: a prediction); counted by assets/host_ops.py with torch.profiler on a CPU",
        "torch": torch.__version__,
        "small_config": SMALL,
        "h100": [],
        "tree": [],
    }
    for source in ("h100-session1", "h100-session2"):  # the code the H100 profiles recorded, 36 layers
        for quant in ("none", "nf4"):
            spec = dict(layers=36, layout="masked", quant=quant, grad_checkpointing=True, compile=False)
            result["h100"].append({"source": source, "commit": SOURCES[source], **run_one(spec, SOURCES[source])})
            print(source, quant, result["h100"][-1].get("later", result["h100"][-1].get("error")), flush=True)
    for config in TREE_CONFIGS:
        for layers in (2, 3):
            counted = run_one(dict(layers=layers, **config), None)
            for part in ("first", "later", "step"):  # the totals only: the op names are checked for the H100 code
                counted.get(part, {}).pop("by_name", None)
            result["tree"].append(counted)
            print(config, layers, result["tree"][-1].get("later", result["tree"][-1].get("error")), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(check(result)))


if __name__ == "__main__":
    main()
