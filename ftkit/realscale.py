"""Qwen3-4B at real scale without a GPU: one rank's training step on fake tensors, its memory and FLOPs tracked.

    uv run python -m ftkit.realscale --technique fsdp --world 8 --json
    uv run python -m ftkit.realscale --technique fsdp --quant nf4 --world 2 --json
    uv run python -m ftkit.realscale --technique single --no-grad-checkpointing
    uv run python -m ftkit.realscale --technique pp --world 2 --schedule gpipe --json
    uv run python -m ftkit.realscale --technique pp --world 2 --pp-stage last --json

Under `FakeTensorMode` a tensor has a shape, a dtype and a device but no storage, and the `fake` process-group
backend lets this one process play one rank (rank 0; with pp, --pp-stage's) of a world of --world ranks (its
collectives return at once). So the real step runs here at Qwen3-4B's exact shape (`qwen3-4b-shape`): the model
built by `ftkit.models` as the scripts build it, parallelised by the scripts' own code (FSDP2 through
experiments/fsdp-ft/train.py's `shard_model`; a pipeline stage through experiments/pp-ft/train.py's `Stage`,
schedule and loss), two optimizer steps of the scripts' default configuration (their own parsers give the flags and
defaults), on a synthetic batch of full-length sequences. Measured on that rank:

- peak bytes by category, from PyTorch's memory trackers (`MemTracker`; `FSDPMemTracker` for FSDP), beside
  `ftkit.memory`'s prediction for the same configuration (as the scripts' summaries call it, at the batch's
  answer positions);
- FLOPs per optimizer step from `torch.utils.flop_counter.FlopCounterMode` (SDPA counted for the pairs its causal
  mask keeps, as the GPU's causal kernels compute them), without activation checkpointing's recompute
  (`flops_counted`, what the MFU convention counts) and with it, beside `ftkit.metrics.step_flops` with the
  lm_head at every token (`flops_convention`, the MFU convention until 2026-11-25), by component, and with the
  lm_head at the positions the step computes logits at (`flops_convention_at_logits`: the MFU convention since);
- the fraction of matmul FLOPs (matmuls and attention) whose operands are bf16;
- bytes per collective kind in the counted step, recorded as the script records them (`ftkit.comm`), beside the
  script's own theory for the same micro-steps (ddp, fsdp, tp, tp-sp; pp: the stage's sends).

Pipeline parallelism (pp, --schedule gpipe or 1f1b, the two the memory model predicts): this process plays the rank
that holds --pp-stage's stage and runs pp-ft's schedule over the whole global batch (one micro-batch per
--micro-batch-size rows). first: rank 0, the embedding and the first 1/--world of the decoder layers; under 1F1B it
keeps min(m, p) micro-batches in flight, the most of any stage; it sends each micro-batch's output forward. last:
the last rank, the last 1/--world of the layers, the final norm and the lm_head (its own copy of the tied
embedding), and pp-ft's loss on the answer positions; it sends each micro-batch's input gradient back. The peak is
compared with the memory model's prediction for that stage (`pp_stage`); the busier of the two, the one pp-ft's
summary states, is reported beside it.

QLoRA (--quant nf4, single-gpu-ft's and ddp-ft's default, an option of fsdp-ft's): the projections are bitsandbytes
`Linear4bit` layers, made by transformers' own quantizer and quantized by bitsandbytes' own `quantize_4bit`
(`quantize_fake`), and each 4-bit matmul dequantizes its weight to bf16 as bitsandbytes' CUDA kernel does at these
row counts. Under FSDP the packed codes (uint8, the shape bitsandbytes stores) are sharded by the script's
`shard_model` and gathered as bytes; the quantization constants stay on the module, whole on every rank.

These are tracked on fake tensors at Qwen3-4B's shape: they exclude the CUDA context, NCCL buffers and allocator
fragmentation, and the tensors live on the CPU device (faking CUDA fails at FSDP2's CUDA streams), so CPU-only
choices (the SDPA kernel, autocast's CPU op lists) stand in for CUDA's; `stand_ins` in the output lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch

from ftkit import batching, cli, comm, data, errors, hardware, lora, memory, metrics, models, optim, ranks

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "single": "single-gpu-ft",
    "ddp": "ddp-ft",
    "fsdp": "fsdp-ft",
    "tp": "tp-ft",
    "tp-sp": "tp-sp-ft",
    "pp": "pp-ft",
}
# The pipeline schedules the memory model predicts (`pp_schedule`), each holding one stage per rank.
PP_SCHEDULES = ("gpipe", "1f1b")
TENSOR_PARALLEL = ("tp", "tp-sp")  # every rank runs every sequence
# How each script records its collectives (ftkit/comm.py), so this command records what the script's summary
# reports: FSDP2's and tp-sp-ft's through torch.distributed's functions, tp-ft's DTensor redistributions as
# functional collectives.
RECORDING = {"fsdp": comm.recording, "tp": comm.recording_functional, "tp-sp": comm.recording}
LABEL = (
    "tracked on fake tensors at Qwen3-4B's shape; excludes the CUDA context, NCCL buffers and allocator fragmentation"
)
# The answer positions per sequence of the synthetic batch (the lm_head runs on those only): the most the
# committed H100 runs on AMI met in a micro-batch was 200 (devlogs/runs/single-gpu-ft-gpu/memory-check-*.md).
ANSWER_TOKENS = 256
# The common flags this command passes on to the script's own parser (a flag not given takes the script's default).
PASSED_ON = ("micro_batch_size", "max_length", "batch_size", "lora_rank", "lora_alpha", "lora_dropout")


class RealScaleError(RuntimeError):
    """A configuration this command cannot run; the message says why."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--technique", required=True, choices=list(SCRIPTS))
    p.add_argument(
        "--world",
        type=int,
        default=1,
        help="ranks; this process plays rank 0 (with pp: the pipeline depth, and the rank of --pp-stage)",
    )
    p.add_argument(
        "--pp-stage",
        choices=["first", "last"],
        default=None,
        help="pp: the stage this process runs and compares with the memory model's prediction for it: first (rank "
        "0: the embedding, the most micro-batches in flight) or last (the last rank: the final norm, the lm_head "
        "and the loss) [default: first]",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help=f"pp: the pipeline schedule, one of {', '.join(PP_SCHEDULES)} (those the memory model predicts) "
        "[default: the script's own]",
    )
    g = p.add_argument_group("the scripts' common flags [default: the script's own default for Qwen3-4B]")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--max-length", type=int, default=None, help="tokens per sequence; every sequence is this long")
    g.add_argument("--batch-size", type=int, default=None, help="global batch; sets the accumulation steps")
    g.add_argument("--lora-rank", type=int, default=None)
    g.add_argument("--lora-alpha", type=float, default=None)
    g.add_argument("--lora-dropout", type=float, default=None)
    g.add_argument(
        "--quant",
        choices=["none", "nf4"],
        default=None,
        help="base weights: bf16, or 4-bit NF4 (QLoRA: single-gpu-ft's and ddp-ft's default, fsdp-ft's --quant nf4; "
        "the other scripts train on a bf16 base)",
    )
    g.add_argument("--no-grad-checkpointing", dest="grad_checkpointing", action="store_false")
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=ANSWER_TOKENS,
        help="answer (loss) positions at the end of each synthetic sequence, where the lm_head runs",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="only this many of Qwen3-4B's decoder layers, every width exact: a quicker check of every term (the "
        "time goes by layers) [default: all 36]",
    )
    p.add_argument("--steps", type=int, default=2, help="optimizer steps tracked")
    p.add_argument(
        "--micro-steps",
        type=int,
        default=None,
        help="run only this many (at least 2) of each optimizer step's accumulation micro-steps, for a quicker run; "
        "the FLOPs are scaled to the whole step, and the peak is the same (every micro-step after the first "
        "accumulates into the same gradients; labelled in the output) [default: all]",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    opts = p.parse_args(argv)
    if opts.technique == "pp":
        if opts.world < 2:
            raise RealScaleError(f"--world {opts.world}: a pipeline needs at least 2 ranks (stages)")
        if opts.schedule is not None and opts.schedule not in PP_SCHEDULES:
            raise RealScaleError(
                f"--schedule {opts.schedule} is not run by ftkit.realscale: the memory model predicts "
                f"{' and '.join(PP_SCHEDULES)} only, and the other schedules give each rank two stages"
            )
        if opts.micro_steps is not None:
            raise RealScaleError(
                "--micro-steps: a pipeline step is one schedule.step over all its micro-batches, and the "
                "schedule's micro-batch count sets the activations in flight; set --batch-size instead"
            )
        opts.pp_stage = opts.pp_stage or "first"
    elif opts.schedule is not None or opts.pp_stage is not None:
        raise RealScaleError("--schedule and --pp-stage are pipeline flags: --technique pp")
    if opts.world < 1 or (opts.technique == "single" and opts.world != 1):
        raise RealScaleError(f"--world {opts.world}: single runs on one device (--world 1); the others take 1 or more")
    if opts.technique in TENSOR_PARALLEL:
        ranks.check_tp_degree(models.model_config(models.QWEN3_4B_SHAPE), opts.world)
    if opts.layers is not None and not 1 <= opts.layers <= models.QWEN3_4B_CONFIG["num_hidden_layers"]:
        raise RealScaleError(f"--layers must be in 1..{models.QWEN3_4B_CONFIG['num_hidden_layers']}, got {opts.layers}")
    if opts.micro_steps is not None and opts.micro_steps < 2:
        raise RealScaleError("--micro-steps must be at least 2: the second is the first to run with gradients held")
    if opts.steps < 2:
        raise RealScaleError("--steps must be at least 2: the first step creates the optimizer state")
    return opts


def script_args(script, opts: argparse.Namespace) -> argparse.Namespace:
    """The flags the script would run with: its own parser and defaults (`cli.resolve`), given this command's."""
    argv = ["train.py", "--model", models.QWEN3_4B_SHAPE, "--no-progress"]
    for key in PASSED_ON:
        if getattr(opts, key) is not None:
            argv += [f"--{key.replace('_', '-')}", str(getattr(opts, key))]
    if not opts.grad_checkpointing:
        argv.append("--no-grad-checkpointing")
    if opts.schedule is not None:
        argv += ["--schedule", opts.schedule]
    if opts.technique == "pp":
        argv.append("--no-packing")  # the padded layout pp-ft runs (it notes so, on stdout, when asked to pack)
    if opts.technique in (*TENSOR_PARALLEL, "pp"):
        if opts.quant == "nf4":
            raise RealScaleError(
                f"--quant nf4: experiments/{SCRIPTS[opts.technique]}/train.py trains LoRA on a bf16 base (no QLoRA)"
            )
    elif opts.quant is not None:
        argv += ["--quant", opts.quant]
    with mock.patch.object(sys, "argv", argv):
        args = script.parse_args()
    return args


def configure(opts: argparse.Namespace) -> tuple:
    """The script, its flags and the rank this process plays; every refusal (the script's own included) raised
    here, before any model is built. pp: the script's refusal of stages that do not split the layers evenly."""
    script = cli.load_experiment(SCRIPTS[opts.technique])
    args = script_args(script, opts)
    rank = 0
    if opts.technique == "pp":
        layers = opts.layers or models.QWEN3_4B_CONFIG["num_hidden_layers"]
        n_stages, _ = script.stage_layout(layers, opts.world, args.schedule)
        if opts.pp_stage == "last":  # pp-ft's last_rank: the rank that holds the last stage
            rank = next(
                r for r in range(opts.world) if n_stages - 1 in script.rank_stages(r, opts.world, args.schedule)
            )
    return script, args, rank


def refusal(argv: list[str]) -> str | None:
    """Why this command refuses `argv`, or None if it would run it."""
    try:
        configure(parse_args(argv))
    except (RealScaleError, errors.RunError, errors.DataError) as e:
        return str(e)
    return None


def synthetic_micro_batch(micro_batch_size: int, length: int, answer: int, vocab: int) -> dict:
    """Full-length sequences whose last `answer` tokens are the answer, collated as the scripts collate AMI
    examples (`batching.collate`), so `logit_positions` and `targets` are built the same way. Token ids are random."""
    if not 0 < answer < length:
        raise RealScaleError(f"--answer-tokens must be in 1..{length - 1} (--max-length {length}), got {answer}")
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(micro_batch_size):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        labels = [data.IGNORE_INDEX] * (length - answer) + ids[length - answer :]
        items.append(data.Encoded(input_ids=ids, labels=labels, trimmed=False))
    return batching.collate(items)


def causal_pairs(s_q: int, s_k: int) -> int:
    """Query-key pairs a causal mask keeps (SDPA's is_causal: query i sees keys 0..i): the lower triangle with its
    diagonal, s(s+1)/2 of s x s when s_q == s_k."""
    if s_q <= s_k:
        return s_q * (s_q + 1) // 2
    return s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k


def causal_sdpa_formulas() -> dict:
    """FLOP formulas for PyTorch's SDPA ops (forward and backward, every backend) that count a causal call's kept
    query-key pairs only. FlopCounterMode's own formulas count the whole s x s whatever is_causal says; the causal
    kernels the scripts run on a GPU (flash, memory-efficient, cuDNN; flash-attn's) skip the tiles above the
    diagonal, so they do about half of it (the diagonal's tiles, computed whole, add about tile / s: 3% of the
    attention FLOPs for 64-row tiles at s = 2048). For FlopCounterMode (`custom_mapping`) and `MatmulDtypes`."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    ops = [
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_cudnn_attention,
    ]
    ops += [getattr(aten, f"{op.__name__}_backward") for op in ops]

    def causal(op):
        whole = flop_registry[op]
        names = [a.name for a in op.default._schema.arguments]

        def formula(*args, out_val=None, **kwargs):
            flops = whole(*args, out_val=out_val, **kwargs)
            bound = {**dict(zip(names, args)), **kwargs}
            if not bound.get("is_causal"):
                return flops
            s_q, s_k = bound["query"].shape[-2], bound["key"].shape[-2]
            return flops * causal_pairs(s_q, s_k) // (s_q * s_k)

        formula._get_raw = True  # FlopCounterMode passes the tensors themselves (and is_causal) to a raw formula
        return formula

    return {op: causal(op) for op in ops}


class MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """FLOPs of every op FlopCounterMode has a formula for (matmuls, attention), by the dtype of its two operands
    (the first two floating tensors of two or more dims: a and b of mm, the bias of addmm skipped; query and key of
    attention, grad_out and query of its backward), and by component: the lm_head (an operand with the vocabulary
    as a dim), attention (SDPA), and the rest (projections and adapters). FLOPs of activation checkpointing's
    recomputed forward are kept apart (`recompute`): ops that run inside backward with grad mode on (the autograd
    engine runs the backward functions with it off; torch.utils.checkpoint recomputes under enable_grad), and a
    4-bit layer's forward matmul there (bitsandbytes' autograd Function runs it with grad mode off,
    `DequantisingGemm4bit`).

    A DTensor op (tp-ft's sharded projections) is seen here, as by FlopCounterMode, at its logical (whole-tensor)
    shape, before DTensor runs it on the local shards: its FLOPs are counted on the local shards, this rank's
    work."""

    def __init__(self, vocab: int, formulas: dict):
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry, self.vocab = {**flop_registry, **formulas}, vocab
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.by_component: dict[str, int] = defaultdict(int)
        self.recompute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func._overloadpacket)
        if formula is not None:
            args, kwargs, local_out = torch.utils._pytree.tree_map_only(
                DTensor, lambda t: t.to_local(), (args, kwargs, out)
            )
            flops = formula(*args, **kwargs, out_val=local_out)
            if torch._C._current_graph_task_id() != -1 and (torch.is_grad_enabled() or GEMM_4BIT.in_forward):
                self.recompute += flops
                return out
            flat = torch.utils._pytree.tree_leaves((args, kwargs))
            operands = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2][:2]
            dtypes = "x".join(sorted({str(t.dtype).removeprefix("torch.") for t in operands}))
            self.by_dtype[dtypes] += flops
            if "attention" in func._overloadpacket.__name__:
                self.by_component["attention"] += flops
            elif any(self.vocab in t.shape for t in operands):
                self.by_component["lm_head"] += flops
            else:
                self.by_component["projections_and_adapters"] += flops
        return out


def build(technique: str, script, args, world: int, device: torch.device, layers: int | None = None):
    """The model as the script builds it, on the meta device (shapes only), and for FSDP sharded by the script's
    own `shard_model`, for TP by its own `lora_aware_plan`, for TP+SP by its own `parallelize`; (model, parameter
    counts: the whole model's)."""
    dtype = cli.torch_dtype(args.dtype)
    shape = {} if layers is None else {"num_hidden_layers": layers}
    with mock.patch.dict(models.QWEN3_4B_CONFIG, shape):
        model = models.load_model(
            args.model, quant="none", dtype=dtype, device=torch.device("meta"), seed=args.seed, attn="sdpa"
        )
    if technique == "fsdp":  # as experiments/fsdp-ft/train.py: (a 4-bit base,) checkpointing, PEFT, then FSDP2
        if args.quant == "nf4":
            quantize_meta(model, dtype)
        if args.grad_checkpointing:
            lora.checkpoint_activations(model)
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        counts = models.parameter_counts(model)
        if args.quant == "nf4":
            pack_meta(model)  # the script shards the loaded (quantized) weights: their packed uint8 codes
        script.shard_model(model, args, device, world)
    elif technique == "tp":  # as experiments/tp-ft/train.py: checkpointing, PEFT, then each layer's plan
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        if args.grad_checkpointing:
            lora.checkpoint_activations(model)
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        model = lora.adapters_compute_in(model, dtype)
        counts = models.parameter_counts(model)
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
        for layer in model.base_model.model.model.layers:
            parallelize_module(layer, mesh, script.lora_aware_plan())
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    elif technique == "pp":  # as experiments/pp-ft/train.py (prepare.load_lora_model): checkpointing, PEFT; its stages
        # are cut from the model once it has storage (`pipeline`), as the script cuts them from the loaded model
        if args.grad_checkpointing:
            lora.checkpoint_activations(model)
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        model = lora.adapters_compute_in(model, dtype)
        counts = models.parameter_counts(model)
    elif technique == "tp-sp":  # as experiments/tp-sp-ft/train.py: checkpointing, PEFT, then its parallel linears
        import torch.distributed as dist

        if args.grad_checkpointing:
            lora.checkpoint_activations(model)
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        counts = models.parameter_counts(model)
        script.parallelize(model, world, 0, dist.group.WORLD, args.sequence_parallel)
    else:  # as experiments/single-gpu-ft and ddp-ft/train.py
        if args.quant == "nf4":
            quantize_meta(model, dtype)
        model = lora.freeze_base(
            model, args.grad_checkpointing, reentrant=getattr(args, "reentrant_checkpointing", False)
        )
        model = lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.seed)
        model = lora.adapters_compute_in(model, dtype)
        counts = models.parameter_counts(model)
    return model, counts


def quantize_meta(model, dtype: torch.dtype) -> None:
    """The meta model's projections made bitsandbytes `Linear4bit` layers by transformers' own quantizer, as
    `from_pretrained(quantization_config=models.bnb_config(dtype))` makes them before loading the weights (the
    lm_head stays bf16); `quantize_fake` gives them their 4-bit weights."""
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(models.bnb_config(dtype))
    quantizer.preprocess_model(model, device_map={"": "cpu"}, dtype=dtype)
    quantizer.postprocess_model(model)


def settings_4bit(w) -> dict:
    """A `Params4bit`'s quantization settings, kept on its layer: replacing the parameter (`to_empty`, `pack_meta`)
    drops them."""
    return dict(
        blocksize=w.blocksize,
        compress_statistics=w.compress_statistics,
        quant_type=w.quant_type,
        quant_storage=w.quant_storage,
    )


def pack_meta(model) -> None:
    """Each meta `Linear4bit`'s weight as bitsandbytes stores it once quantized, for FSDP2 to shard as fsdp-ft shards
    the loaded 4-bit base: the packed codes, two per byte in uint8 (`bnb_4bit_quant_storage`'s default), shape
    [out * in / 2, 1], a frozen plain parameter. The layer's settings are kept for `quantize_fake`, which gives the
    layer its quantization constants once there is storage."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            settings = module.settings_4bit = settings_4bit(module.weight)
            storage = settings["quant_storage"]
            packed = (module.out_features * module.in_features + 1) // (2 * storage.itemsize)
            weight = torch.empty(packed, 1, dtype=storage, device="meta")
            module.weight = torch.nn.Parameter(weight, requires_grad=False)


def quantize_fake(model) -> list[torch.Tensor]:
    """Each `Linear4bit`'s weight quantized by bitsandbytes' own `quantize_4bit` from a fake bf16 weight, with the
    layer's settings (NF4, double quantization, blocksize 64), so the packed weight and its quantization constants
    have the shapes and dtypes bitsandbytes gives a loaded checkpoint. Call inside FakeTensorMode: bitsandbytes
    registers fake kernels for its 4-bit ops. The packed weight is a plain frozen parameter carrying its
    `quant_state`, which `Linear4bit.forward` reads (a `Params4bit` cannot wrap a fake tensor); the layer keeps the
    state too (`module.quant_state`), as bitsandbytes' quantization leaves it. A weight FSDP2 has sharded already
    (`pack_meta`) stays: the packed codes must have its shape, and the state is the module's only, whole on every
    rank (`fsdp_quant_state`). Returns the constants' tensors (absmax codes, their fp32 absmax, code book and
    offset), which live beside the parameter."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor import DTensor

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if layers:  # double quantization's 8-bit code book, which bitsandbytes computes from values once and caches
        with unset_fake_temporarily():
            bnb.functional.name2qmap.setdefault("dynamic", bnb.functional.create_dynamic_map())
    constants = []
    for module in layers:
        settings = module.settings_4bit
        # the checkpoint's weight, in the dtype the scripts load it in (their compute dtype)
        weight = torch.empty(module.out_features, module.in_features, dtype=module.compute_dtype)
        packed, state = bnb.functional.quantize_4bit(weight, **settings)
        module.quant_state = state
        if isinstance(module.weight, DTensor):  # sharded by FSDP2: its packed codes, as bitsandbytes packs them
            if module.weight.shape != packed.shape or module.weight.dtype != packed.dtype:
                raise RealScaleError(
                    f"sharded 4-bit weight {tuple(module.weight.shape)} {module.weight.dtype}, bitsandbytes packs "
                    f"{tuple(packed.shape)} {packed.dtype}"
                )
        else:
            module.weight = torch.nn.Parameter(packed, requires_grad=False)
            module.weight.quant_state = state
        constants += [state.absmax, state.offset, state.state2.absmax, state.state2.code]
    return constants


def quantization_report(model, constants: list[torch.Tensor]) -> dict:
    """The 4-bit base's bytes per quantized weight as bitsandbytes stores them (packed codes and constants), beside
    the memory model's NF4_BYTES_PER_PARAM."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    params = sum(m.in_features * m.out_features for m in layers)
    packed = sum(comm.nbytes([m.weight]) for m in layers)
    constant_bytes = comm.nbytes(constants)
    return {
        "quantized": {
            "linear_params": params,
            "packed_bytes": packed,
            "constants_bytes": constant_bytes,
            "bytes_per_param": (packed + constant_bytes) / params,
            "model_bytes_per_param": memory.NF4_BYTES_PER_PARAM,
        }
    }


def materialise(model, device: torch.device) -> list[torch.Tensor]:
    """Storage (fake, inside FakeTensorMode) for every parameter and buffer, and the RoPE frequencies, a
    non-persistent buffer that to_empty leaves uninitialised, recomputed as the scripts do; a 4-bit base's
    projections quantized (`quantize_fake`), whose constants it returns."""
    import bitsandbytes as bnb

    for module in model.modules():  # to_empty replaces a Params4bit with a plain tensor: keep its settings
        if isinstance(module, bnb.nn.Linear4bit) and not hasattr(module, "settings_4bit"):
            module.settings_4bit = settings_4bit(module.weight)
    model.to_empty(device=device)
    # to_empty gives each module its own new tensor, so a parameter two modules share (the tied embedding and
    # lm_head) comes out as two: tie them again, as loading ties them. (FSDP2 keeps one shard for a shared one.)
    model.base_model.model.tie_weights()
    inner = model.base_model.model.model
    inner.rotary_emb = type(inner.rotary_emb)(inner.config).to(device)
    return quantize_fake(model)


def pipeline(script, model, args, world: int, device: torch.device, microbatches: int, denominator: int):
    """This rank's stage of experiments/pp-ft/train.py, cut from the model by the script's own `stage_layout`,
    `rank_stages` and `Stage`, in a PipelineStage, and the script's schedule (`SCHEDULES`) over it with pp-ft's loss
    function, built as the script builds them; (the Stage module, the PipelineStage, the schedule). Call after
    `materialise`: the Stage keeps the model's rotary embedding, which materialise replaces with one whose
    frequencies are computed.

    The PipelineStage is the script's own (`pipeline_stage`), given its metadata (input_args, output_args), so no
    shapes are inferred: that would exchange them with the neighbour stages over the group, and the fake group
    delivers nothing.

    Once an output's send completes, the stage drops its reference to it (backward starts from its autograd node),
    but only for an output whose type is exactly torch.Tensor; a FakeTensor, a subclass, would be kept until its
    backward, one [micro, seq, hidden] tensor per micro-batch in flight that a run on the GPU frees. Here it is
    judged as the plain tensor it stands for (the later checks, DDP and a dw_builder, do not apply: this stage has
    neither). The last stage sends no output: it keeps each one, as on the GPU, for the step's merged output."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor

    config = model.config
    n_stages, per_stage = script.stage_layout(config.num_hidden_layers, world, args.schedule)
    [sid] = script.rank_stages(dist.get_rank(), world, args.schedule)  # GPipe, 1F1B: one stage a rank (PP_SCHEDULES)
    module = script.Stage(model.base_model.model, sid * per_stage, per_stage, first=sid == 0, last=sid == n_stages - 1)
    stage = script.pipeline_stage(module.train(), sid, n_stages, device, args, config)
    releasable = stage._output_slot_is_releasable

    def releasable_as_a_plain_tensor(output) -> tuple[bool, str]:
        if type(output) is FakeTensor and not stage.is_last:
            return True, ""
        return releasable(output)

    stage._output_slot_is_releasable = releasable_as_a_plain_tensor

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # pp-ft's loss_fn (a closure in its main), restated: the lm_head at the answer positions of the last
        # stage's output, the token-loss sum over the global batch's target tokens.
        logits = module.logits(hidden, target[:, 0])
        return batching.token_loss_sum(logits, target[:, 1]) / denominator

    schedule = script.SCHEDULES[args.schedule](stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return module, stage, schedule


def measure(opts: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    technique, world = opts.technique, opts.world
    pp = technique == "pp"
    script, args, rank = configure(opts)
    device = torch.device("cpu")
    dtype = cli.torch_dtype(args.dtype)
    # TP splits the layers, PP the depth, not the batch; PP's accumulation steps are the pipeline's micro-batches
    dp = 1 if technique in ("single", *TENSOR_PARALLEL, "pp") else world
    accum = batching.accumulation_steps(args.batch_size, args.micro_batch_size, data_parallel=dp)
    stand_ins: list[str] = [
        "tensors on the CPU device under FakeTensorMode (faking CUDA fails at FSDP2's CUDA streams): attention is "
        "PyTorch SDPA's CPU flash kernel (the scripts' choice on a GPU without flash-attn is SDPA's CUDA kernels), "
        "and autocast applies its CPU op lists",
        f"a synthetic batch: {args.micro_batch_size} x {args.max_length} random tokens per micro-batch, every "
        f"sequence full length, the last {opts.answer_tokens} positions the answer (loss and lm_head)",
        (
            "the training loop's step (the script's schedule.step under autocast, optim.clip_grads_over_ranks, AdamW "
            "step, zero_grad) is restated here from the script, and so is its loss function (pp-ft's loss_fn, a "
            "closure in its main: the last stage's lm_head at the answer positions, token_loss_sum over the global "
            "batch's target tokens), given to the schedule without the script's timer around it"
            + (" and called by it on the last stage only" if opts.pp_stage == "first" else "")
            + "; the step's timers, learning-rate schedule, metrics and evaluation are left out"
            if pp
            else "the training loop's step (forward, token_loss_sum, backward, AdamW step, zero_grad) is restated "
            "here from the script, the TP scripts' gradient sync and clip called from them; the learning-rate "
            "schedule, metrics and evaluation are left out"
        ),
    ]
    if technique != "single" and not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    started = time.perf_counter()
    model, counts = build(technique, script, args, world, device, opts.layers)
    config = model.config
    # pp-ft feeds the schedule the whole global batch, which it cuts into micro-batches itself.
    rows = args.batch_size if pp else args.micro_batch_size
    mb = synthetic_micro_batch(rows, args.max_length, opts.answer_tokens, config.vocab_size)
    if pp:  # pp-ft's `padded`: input ids padded to --max-length, the target packing [rows, 2, k] (positions, tokens)
        mb["input_ids"] = torch.nn.functional.pad(mb["input_ids"], (0, args.max_length - mb["input_ids"].shape[1]))
        mb["target"] = torch.stack([mb["logit_positions"], mb["targets"]], dim=1)
        stand_ins[1] = (
            f"a synthetic batch: {args.batch_size} x {args.max_length} random tokens per step, collated and padded "
            "as pp-ft's `padded` pads them (restated here), cut by the schedule into "
            f"{accum} micro-batches of {args.micro_batch_size}, the last {opts.answer_tokens} positions the answer "
            "(the last stage's loss and lm_head)"
        )
    if technique == "tp-sp":  # as tp-sp-ft pads: sequence parallelism splits the sequence into equal parts
        mb = batching.pad_to_multiple(mb, world)
    runs = min(accum, opts.micro_steps or accum)  # micro-steps run per optimizer step (pp: in one schedule.step)
    if runs < accum:
        stand_ins.append(
            f"each optimizer step ran {runs} of its {accum} accumulation micro-steps (--micro-steps); the FLOPs "
            f"counted are scaled by {accum}/{runs} (every micro-step counts the same); the peak is the one all "
            f"{accum} reach, since every micro-step after the first accumulates into the same gradients (tracked to "
            "the byte with 2 layers: 2 and 8 micro-steps, 2,260,994,684 bytes each)"
        )
    # The global batch's target tokens (pp's batch is the global one).
    n_target = int((mb["targets"] != data.IGNORE_INDEX).sum()) * (1 if pp else accum * dp)

    padded = not bool(mb["attention_mask"].all())
    attention_mask = mb["attention_mask"] if padded else None
    # pp-ft's Stage calls the decoder layers with no mask itself (causal attention alone): nothing to stand in for.
    unmasked = not padded and not pp
    if unmasked:
        stand_ins.append(
            "no attention mask: the synthetic batch has no padding, so the causal mask is left to SDPA's is_causal "
            "(GQA kept), as transformers decides on a real run; on fake tensors it cannot read the mask or the "
            "position ids and would build the mask, which every layer's SDPA then saves, with k and v repeated "
            "to every head"
        )
    if args.lora_dropout > 0:
        stand_ins.append(
            "LoRA dropout runs as torch.native_dropout, CUDA's fused kernel, which saves a 1-byte mask; CPU's "
            "dropout multiplies by a noise tensor in the input dtype and saves that instead"
        )
    nf4 = getattr(args, "quant", "none") == "nf4"
    if nf4:
        rows_4bit = args.micro_batch_size * args.max_length
        stored = (
            "and their weights the packed uint8 codes bitsandbytes stores ([out * in / 2, 1]), which the script's "
            "shard_model shards, as fsdp-ft shards the loaded base; each layer's quantization constants come from "
            "bitsandbytes' quantize_4bit of a fake bf16 weight (NF4, double quantization, blocksize 64) and are its "
            "module's quant_state, whole on this rank, tracked as 'Inputs'; the gathered weight, a plain parameter "
            "of FSDP2's, is given the module's quant_state as it is (bitsandbytes wraps it in a Params4bit first, "
            "sharing its storage, which a fake tensor cannot be)"
            if technique == "fsdp"
            else "each weight is quantized by bitsandbytes' quantize_4bit from a fake bf16 weight (NF4, double "
            "quantization, blocksize 64) and kept as a plain frozen parameter carrying its quant_state (a Params4bit "
            "cannot wrap a fake tensor); the quantization constants are tracked as 'Other'"
        )
        stand_ins.append(
            "the 4-bit base: transformers' bitsandbytes quantizer makes the meta model's projections Linear4bit "
            f"layers, as from_pretrained does{',' if technique == 'fsdp' else ';'} {stored}. gemm_4bit runs as "
            f"bitsandbytes' CUDA kernel runs it past {GEMM_4BIT_FUSED_MAX_ROWS} rows (dequantize to a bf16 weight, "
            f"F.linear; its fake kernel allocates and computes nothing); these micro-batches have {rows_4bit} rows"
            + ("" if rows_4bit > GEMM_4BIT_FUSED_MAX_ROWS else ", where CUDA runs the fused kernel instead")
        )
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        cuda_dropout(),
        causal_mask_skipped(unmasked),
        dequantising_gemm_4bit() if nf4 else contextlib.nullcontext(),
        fsdp_quant_state() if nf4 and technique == "fsdp" else contextlib.nullcontext(),
    ):
        constants = materialise(model, device)
        quantized = quantization_report(model, constants) if nf4 else {}
        recorder = comm.CommRecorder(device)
        if pp:  # from here on, `model` is this rank's stage, as in pp-ft once it drops the other ranks' layers
            model, stage, schedule = pipeline(script, model, args, world, device, accum, n_target)
            comm.record_stage_sends([stage], recorder)
            stand_ins.append(
                "the PipelineStage is given its input and output metadata (input_args, output_args: pp-ft's own "
                "`pipeline_stage`, so no shapes are exchanged between ranks, which the fake group could not do)"
                + (
                    "; the gradients stage 0 receives are its receive buffers as the stage allocates them (fake "
                    "tensors: the fake group's receive returns at once and writes nothing); a sent stage output is "
                    "released as torch releases a plain tensor's (it keeps a FakeTensor, a subclass, until its "
                    "backward: one [micro, seq, hidden] tensor per micro-batch in flight)"
                    if stage.is_first
                    else "; the activations the last stage receives from the stage before are its receive buffers as "
                    "the stage allocates them (fake tensors: the fake group's receive returns at once and writes "
                    "nothing), requiring grad as the given input metadata says, so the stage computes their "
                    "gradient and sends it back"
                )
            )
        if technique == "ddp":
            model = wrap_ddp(model, args, recorder, stand_ins)
        ddp = hasattr(model, "no_sync")
        trainable = [p for p in model.parameters() if p.requires_grad]
        replicated = script.replicated_lora(model) if technique == "tp-sp" else []
        optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)

        def micro_step(sync: bool) -> None:
            kwargs = dict(
                input_ids=mb["input_ids"], attention_mask=attention_mask, logits_to_keep=mb["logit_positions"]
            )
            if pp:  # pp-ft's step: the schedule runs every micro-batch's forward and backward, under autocast
                inputs = [mb["input_ids"]] if stage.is_first else []
                with lora.compute_autocast(device, dtype):
                    schedule.step(*inputs, target=mb["target"] if stage.is_last else None, losses=[])
                return
            if technique == "fsdp":  # experiments/fsdp-ft/train.py's micro-step: FSDP2 casts, no autocast
                model.set_requires_gradient_sync(sync)
                out = model(**kwargs)
                loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
                del out
                (loss * world).backward()
                return
            if technique == "tp-sp":  # tp-sp-ft's: bf16 base, its linears cast the adapters; the same loss everywhere
                out = model(**kwargs)
                loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
                del out
                loss.backward()
                return
            # single-gpu-ft / ddp-ft / tp-ft: the adapters compute in bf16 under autocast; DDP accumulates under
            # no_sync; TP runs the whole batch on every rank (dp 1)
            with model.no_sync() if ddp and not sync else contextlib.nullcontext():
                with lora.compute_autocast(device, dtype):
                    out = model(**kwargs)
                    loss = batching.token_loss_sum(out.logits, mb["targets"]) / n_target
                del out
                (loss * dp).backward()

        def optimizer_step() -> None:
            if technique == "tp":  # the scripts' own clips: each mixes sharded and replicated gradients
                script.clip_grads(trainable, args.max_grad_norm)
            elif technique == "tp-sp":  # tp-sp-ft also sums the replicated LoRA gradients' shares first
                script.sync_replicated_grads(replicated, dist.group.WORLD)
                optim.clip_grads_over_ranks(trainable, args.max_grad_norm, dist.group.WORLD, replicated)
            elif pp:  # each rank holds its stages' share of the gradients
                optim.clip_grads_over_ranks(trainable, args.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(
                    trainable, args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=not getattr(args, "gradient_as_bucket_view", False))

        def optimizer_step_of_micro_steps(tracker=None) -> None:
            calls = 1 if pp else runs  # one schedule.step runs the pipeline's micro-batches
            for j in range(calls):
                micro_step(sync=j == calls - 1)
                if tracker is not None:
                    # Per-module stats are kept for one forward/backward (FSDPMemTracker refuses a second); the
                    # peak over the whole run is kept.
                    tracker.reset_mod_stats()
            optimizer_step()

        # ---- `steps` optimizer steps of `accum` micro-steps each, memory tracked from the start.
        keys = ("input_ids", "target") if pp else ("input_ids", "attention_mask", "logit_positions", "targets")
        tracker = make_tracker(technique, model, optimizer, (*(mb[k] for k in keys), *constants))
        with no_tracker_graph_leak(), tracker:
            for _ in range(opts.steps):
                optimizer_step_of_micro_steps(tracker)
        # ---- one more optimizer step, its FLOPs counted (not inside the memory tracker: under both, the tracker
        # reported tens of GiB of temporaries that it does not report alone) and its collectives recorded.
        causal = causal_sdpa_formulas()
        dtypes = MatmulDtypes(config.vocab_size, causal)
        counter = FlopCounterMode(display=False, custom_mapping=causal)
        recorder.take()  # only the counted step's collectives
        recording = RECORDING[technique](recorder) if technique in RECORDING else contextlib.nullcontext()
        with dtypes, counter, recording:
            optimizer_step_of_micro_steps()
        recorded = {kind: {"bytes": s["bytes"], "count": s["count"]} for kind, s in recorder.take().items()}
        theory = collective_theory(technique, model, config, args, counts, mb, runs, replicated, world)
        peak = tracker.get_tracker_snapshot("peak")
    elapsed = time.perf_counter() - started

    peak = next(iter(peak.values()), {}) if peak else {}
    categories = {k: int(v) for k, v in peak.items() if k != "Total"}
    tracked_total = int(peak.get("Total", 0))
    setting = {"quant": args.quant} if technique in ("single", "ddp", "fsdp") else {}
    if technique != "single":
        setting["world_size"] = world
    if technique == "fsdp":
        setting["reshard_after_forward"] = args.reshard_after_forward
    pp_stages = {}
    if pp:  # as pp-ft's summary calls it (GPipe and 1F1B only here), for the stage tracked
        setting.update(pp_schedule=args.schedule, num_microbatches=accum)
        pp_stages = {
            where: metrics.predicted_memory(
                config, args, "pp", logit_positions=opts.answer_tokens, pp_stage=where, **setting
            )["total"]
            for where in ("first", "last")
        }
        setting["pp_stage"] = opts.pp_stage
    # The memory model's name for it: tp-sp-ft without sequence parallelism is plain Megatron TP.
    modelled = "tp" if technique == "tp-sp" and not args.sequence_parallel else technique
    predicted = metrics.predicted_memory(config, args, modelled, logit_positions=opts.answer_tokens, **setting)
    predicted_upper = metrics.predicted_memory(config, args, modelled, **setting)

    lengths = [args.max_length] * args.micro_batch_size * accum  # this rank's sequences per optimizer step
    # The convention's FLOPs for those sequences, and the share of them that is this rank's: all of them with data
    # parallelism (each rank its own sequences), 1/world of them with TP (every rank runs every sequence); with PP
    # its stage's layers, 1/world of the decoder layers, and the whole lm_head on the last stage, none on the first.
    share = 1 / world if technique in (*TENSOR_PARALLEL, "pp") else 1
    scale = accum / runs  # exact: every micro-step counts the same
    # This command's count (MatmulDtypes: local shards), checked against FlopCounterMode's, which counts a DTensor
    # op at its logical shape: the two agree where no DTensor computes (single, ddp, fsdp's gathered weights).
    logical = counter.get_total_flops()
    without_rc = sum(dtypes.by_dtype.values())
    with_rc = without_rc + dtypes.recompute
    matmul_total = without_rc
    if technique != "tp" and with_rc != logical:
        stand_ins.append(
            f"FLOPs: FlopCounterMode counted {logical} with recompute, this command's own count of the same ops "
            f"{with_rc}: they should agree, and the difference is unexplained"
        )
    shape = memory.ModelShape.from_config(config)
    attn_convention = 6 * shape.layers * shape.q_dim * sum(s * s for s in lengths) * share
    # Where the step computes logits (logits_to_keep): each sequence's answer positions, the batch's k per row.
    logit_positions = mb["logit_positions"].shape[-1] * len(lengths)

    def rank_share(positions: int) -> tuple[float, float]:
        """The convention's FLOPs for this rank's sequences, the lm_head counted at `positions`, and the share of
        them that is this rank's; (total, lm_head)."""
        total = metrics.step_flops(lengths, config, counts["trainable"], positions) * share
        lm_head = 4 * shape.embedding_params() * positions * share
        if pp:  # the lm_head runs on the last stage, over every sequence
            whole = lm_head / share if stage.is_last else 0.0
            total, lm_head = total - lm_head + whole, whole
        return total, lm_head

    convention, lm_head_convention = rank_share(sum(lengths))
    at_logits, _ = rank_share(logit_positions)
    return {
        "technique": technique,
        "script": f"experiments/{SCRIPTS[technique]}/train.py",
        "world_size": world,
        "rank": rank,
        "label": LABEL,
        "config": {
            "model": args.model,
            "layers": config.num_hidden_layers,
            "dtype": args.dtype,
            "quant": getattr(args, "quant", "none") if technique in ("single", "ddp", "fsdp") else "none",
            "micro_batch_size": args.micro_batch_size,
            "max_length": args.max_length,
            "batch_size": args.batch_size,
            "accumulation_steps": accum,
            "micro_steps_run": runs,
            "answer_tokens": opts.answer_tokens,
            "lora_rank": args.lora_rank,
            "lora_alpha": args.lora_alpha,
            "lora_dropout": args.lora_dropout,
            "grad_checkpointing": args.grad_checkpointing,
            "steps_tracked": opts.steps,
            **({"reshard_after_forward": args.reshard_after_forward} if technique == "fsdp" else {}),
            **({"sequence_parallel": args.sequence_parallel} if technique == "tp-sp" else {}),
            **({"schedule": args.schedule, "pipeline_microbatches": accum, "stage": stage.stage_index} if pp else {}),
        },
        "parameters": counts,
        **quantized,
        "tracked_peak_bytes": tracked_total,
        "categories": categories,
        "predicted_bytes": int(predicted["total"]),
        "predicted": predicted,
        "predicted_bytes_every_position": int(predicted_upper["total"]),
        "tracked_over_predicted": tracked_total / predicted["total"] if predicted["total"] else None,
        **(
            {
                "predicted_bytes_by_stage": {k: int(v) for k, v in pp_stages.items()},
                "predicted_busiest_stage": max(pp_stages, key=pp_stages.get),
                "predicted_note": f"the memory model's '{opts.pp_stage}' stage, what rank {rank} holds and the "
                "tracked peak is compared with ('first': the embedding, and the most micro-batches in flight; "
                "'last': the final norm, the lm_head with its own copy of the tied embedding, and the loss); "
                "pp-ft's summary states the busier of the two, predicted_busiest_stage",
            }
            if pp
            else {}
        ),
        "flops_counted": without_rc * scale,
        "flops_counted_with_recompute": with_rc * scale,
        **({"flops_logical_with_recompute": logical * scale} if technique == "tp" else {}),
        "flops_convention": convention,
        "flops_counted_over_convention": without_rc * scale / convention,
        "flops_convention_at_logits": at_logits,
        "flops_counted_over_convention_at_logits": without_rc * scale / at_logits,
        "flops_counted_by_component": {k: v * scale for k, v in sorted(dtypes.by_component.items())},
        "flops_convention_by_component": {
            "attention": attn_convention,
            "lm_head": lm_head_convention,
            "projections_and_adapters": convention - attn_convention - lm_head_convention,
        },
        "flops_note": f"per optimizer step on rank {rank} (its micro-batch x accumulation sequences); the global "
        "step is "
        f"{dp} times this. Convention: {metrics.MFU_CONVENTION}; convention at logits: the same with the lm_head "
        f"at the {logit_positions} positions the step computes logits at (logits_to_keep: the answer positions). "
        "Counted: FlopCounterMode's formulas, with SDPA counted over the query-key pairs the causal mask keeps "
        "(causal_sdpa_formulas: FlopCounterMode's own count the whole s x s), its backward's recompute of the "
        "scores included (the convention leaves it out: 7/6 of its attention), the lm_head where it runs"
        + (
            f". TP: every rank runs every sequence, and the convention here is rank 0's 1/{world} share of the "
            "step; the script shards the decoder layers only, so every rank computes the whole lm_head (and holds "
            "the whole embedding)"
            if technique in TENSOR_PARALLEL
            else f". PP: rank {rank} runs stage {stage.stage_index} of {world} on every sequence: 1/{world} of the "
            "decoder layers, and "
            + (
                "the final norm and the lm_head (at the answer positions); the convention here is those layers' "
                "share of the step and the whole lm_head"
                if stage.is_last
                else "the embedding (no matmul); the convention here is those layers' share of the step (the "
                "lm_head is the last stage's)"
            )
            if pp
            else ""
        ),
        **collectives_report(technique, recorded, theory, runs),
        "bf16_matmul_fraction": dtypes.by_dtype.get("bfloat16", 0) / matmul_total if matmul_total else None,
        "matmul_flops_by_dtype": {k: v * scale for k, v in sorted(dtypes.by_dtype.items())},
        "stand_ins": stand_ins,
        "versions": hardware.versions(),
        "seconds": round(elapsed, 1),
    }


def collective_theory(
    technique: str, model, config, args, counts: dict, mb: dict, micro_steps: int, replicated: list, world: int
):
    """The bytes per collective kind that the script's summary states as theory (`theory_*`), for an optimizer
    step of `micro_steps` micro-batches like `mb`, from the same functions (ftkit/comm.py)."""
    if technique == "fsdp":  # as fsdp-ft's summary: floating parameters in --param-dtype, 4-bit codes as stored
        from torch.distributed.fsdp import FSDPModule

        param_dtype = cli.torch_dtype(args.param_dtype)
        layer_units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        return comm.fsdp_theory(
            comm.gathered_bytes(model.parameters(), param_dtype),
            sum(comm.gathered_bytes(unit.parameters(), param_dtype) for unit in layer_units),
            micro_steps,
            args.reshard_after_forward,
            counts["trainable"] * cli.torch_dtype(args.reduce_dtype).itemsize,
            world,
        )
    # pp-ft's activation_bytes_per_microbatch, once per micro-batch: stage 0 sends each one's output forward, the
    # last stage its input gradient backward, both [micro, seq, hidden] in the compute dtype.
    if technique == "pp":
        return {"send": mb["input_ids"].numel() * config.hidden_size * cli.torch_dtype(args.dtype).itemsize}
    if technique == "ddp":  # ddp-ft's summary: the trainable gradients, once per optimizer step (no_sync before)
        return {"all_reduce": comm.nbytes([p for p in model.parameters() if p.requires_grad])}
    # The TP scripts' row: the step's block-boundary activations [micro, seq, hidden], summed over its micro-batches.
    hidden = config.hidden_size
    row = {
        "comm": {},
        "activation_bytes": micro_steps * mb["input_ids"].numel() * hidden * cli.torch_dtype(args.dtype).itemsize,
    }
    if technique == "tp":
        return {"all_reduce": comm.tp_all_reduce_theory(config, args, [row], world)}
    if technique == "tp-sp":
        return comm.tp_sp_collective_theory(config, args, [row], comm.nbytes(replicated))
    return {}


def collectives_report(technique: str, recorded: dict, theory: dict, micro_steps: int) -> dict:
    """The counted step's collectives beside the theory, or why there are none to show."""
    if technique == "single":
        return {"collectives_note": "one device: no collectives"}
    return {
        "collective_bytes": {kind: int(s["bytes"]) for kind, s in sorted(recorded.items())},
        "collective_counts": {kind: int(s["count"]) for kind, s in sorted(recorded.items())},
        "collective_bytes_theory": {kind: float(b) for kind, b in sorted(theory.items()) if b},
        "collectives_note": f"the counted optimizer step (micro-steps: {micro_steps}), recorded as the script "
        "records them (ftkit/comm.py): bytes of the whole buffer each collective was given on this rank (the fake "
        "group returns at once, so no time); theory: the script's own formula for the same micro-steps",
    }


@contextlib.contextmanager
def causal_mask_skipped(unpadded: bool):
    """transformers' decision for a batch without padding passed without a mask, made for fake tensors.

    With no mask transformers looks for packed sequences in the position ids; a fake tensor has no values to look
    at, so it assumes packing and builds a 4-D mask. These position ids are 0..s-1 in every row, for which the check
    finds none (returns None): that is what this returns. Then the mask is skipped (SDPA's is_causal), as on a
    real run."""
    if not unpadded:
        yield
        return
    from transformers import masking_utils

    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


@contextlib.contextmanager
def no_tracker_graph_leak():
    """torch's memory trackers, without the leak their module tracking causes across steps.

    To follow backward through the modules, ModTracker registers a hook on each module's inputs that fires once all
    of their gradients are computed (`register_multi_grad_hook`, mode "all"). That hook's closure holds the inputs'
    autograd nodes, and each node holds the hook: a cycle through C++ that Python's collector cannot see, so the
    node, and everything its graph reaches, outlives the step. Here that is the embedding output (a leaf that
    requires grad: PEFT calls `enable_input_require_grads` when checkpointing is on) with its accumulated gradient,
    two hidden-size tensors per micro-step (21 MB each in bf16 at 2 x 2048 tokens), which a run without the tracker
    frees. The hook in mode "any" (fire at the first input gradient) holds no nodes; only the per-module statistics
    see the difference, for modules with more than one input that requires grad, not the peak."""
    from torch.distributed._tools import mod_tracker

    hook = mod_tracker.register_multi_grad_hook

    def first_gradient(tensors, fn, mode="all"):
        return hook(tensors, (lambda grad: fn([grad])) if mode == "all" else fn, mode="any")

    with mock.patch.object(mod_tracker, "register_multi_grad_hook", first_gradient):
        yield


# Rows above which bitsandbytes' CUDA gemm_4bit dequantizes the weight and calls F.linear instead of its fused
# kernel (bitsandbytes/backends/cuda/ops.py, `_gemm_4bit_custom_max_m`).
GEMM_4BIT_FUSED_MAX_ROWS = 1536


class DequantisingGemm4bit(threading.local):
    """bitsandbytes' `gemm_4bit` op as its CUDA kernel runs it past GEMM_4BIT_FUSED_MAX_ROWS rows
    (`_dequant_linear_fallback`): the 8-bit absmax dequantized to fp32, the weight dequantized to a new tensor in
    the activation dtype, F.linear. Its fake kernel returns an empty output, allocating and computing nothing.
    It runs inside bitsandbytes' autograd Function, where grad mode is off even in checkpointing's recompute:
    `in_forward` tells MatmulDtypes that its matmul is a forward."""

    in_forward = False

    def default(self, A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, **nested):
        ops = torch.ops.bitsandbytes
        if absmax_8bit is not None:
            absmax = (
                ops.dequantize_blockwise(absmax_8bit, absmax, nested["absmax_code"], 256, torch.float32)
                + nested["absmax_offset"]
            )
        weight = ops.dequantize_4bit(B, absmax, blocksize, quant_type, shapeB, A.dtype)
        self.in_forward = True
        try:
            return torch.nn.functional.linear(A, weight, bias)
        finally:
            self.in_forward = False


GEMM_4BIT = DequantisingGemm4bit()


@contextlib.contextmanager
def dequantising_gemm_4bit():
    with mock.patch.object(torch.ops.bitsandbytes, "gemm_4bit", GEMM_4BIT):
        yield


@contextlib.contextmanager
def fsdp_quant_state():
    """bitsandbytes' recovery of a 4-bit weight's quantization state under FSDP, for fake tensors. FSDP2 replaces a
    `Linear4bit`'s weight with its own parameters (the shard, the gathered one), which carry no `quant_state`;
    `Linear4bit.forward` then wraps the gathered weight in a `Params4bit` (sharing its storage) and gives it the
    module's `quant_state` (`fix_4bit_weight_quant_state_from_module`). A `Params4bit` cannot wrap a fake tensor:
    here the gathered parameter is given the module's state as it is. Nothing is allocated either way."""
    import bitsandbytes as bnb

    def attach(module) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            module.weight.quant_state = module.quant_state

    with mock.patch.object(bnb.nn.modules, "fix_4bit_weight_quant_state_from_module", attach):
        yield


@contextlib.contextmanager
def cuda_dropout():
    """`F.dropout` (what PEFT's `nn.Dropout` calls) as CUDA runs it: `torch.native_dropout`, the fused kernel that
    saves a bool mask for backward. On the CPU device `F.dropout` multiplies by a noise tensor in the input dtype
    and saves it, 2 bytes per element for bf16 instead of 1 (tests/test_memory.py measures both)."""

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0:
            return input
        return torch.native_dropout(input, p, True)[0]

    with mock.patch.object(torch.nn.functional, "dropout", dropout):
        yield


class NoBucketRebuild:
    """DDP's reducer, as DDP's Python side calls it, with the bucket rebuild answered "not rebuilt"."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)


def wrap_ddp(model, args, recorder: comm.CommRecorder, stand_ins: list[str]):
    """experiments/ddp-ft/train.py's DDP wrapper, built on fake tensors, its buckets' all-reduces recorded as
    `comm.register_ddp_hook` records them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(
        model,
        device_ids=None,
        bucket_cap_mb=args.bucket_cap_mb,
        find_unused_parameters=args.find_unused_parameters,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        static_graph=args.static_graph,
        forward_sync_buffers=False,
        init_sync=False,  # no check or broadcast of the parameters across ranks: fake tensors have no data to send
    )

    def hook(state, bucket):  # the fake group's all-reduce future carries no tensor: return the bucket as it is
        buffer = bucket.buffer()
        recorder.completed("all_reduce", recorder.issued("all_reduce", comm.nbytes(buffer)))
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    wrapped.register_comm_hook(None, hook)
    # After the first backward DDP rebuilds its buckets in the order the gradients arrived, copying them in C++,
    # which cannot read a fake tensor: the buckets stay in their first order (the same bytes).
    wrapped.reducer = NoBucketRebuild(wrapped.reducer)
    # DDP's reducer keeps one flat fp32 bucket copy of the trainable gradients for the whole run (none with
    # --gradient-as-bucket-view, where the gradients are views into the buckets). Its C++ constructor allocates them
    # before the tracker starts; the tracker registers them when a backward first writes them (they are an op's
    # output it has not seen), and counts them from then on.
    buckets = 0 if args.gradient_as_bucket_view else comm.nbytes([p for p in model.parameters() if p.requires_grad])
    stand_ins.append(
        "DDP is built without its start-up check and broadcast of the parameters across ranks (init_sync=False: "
        "fake tensors have no data); its comm hook records each bucket's bytes as ftkit/comm.py's does and returns "
        "the bucket as it is (the fake group's all-reduce future carries no tensor); the buckets are not rebuilt in "
        f"the gradients' arrival order after the first backward (a C++ copy of their data); its buckets ({buckets:,} "
        "bytes: one fp32 copy of the trainable gradients) are allocated at construction, before the memory tracker "
        "starts, and tracked from the first optimizer step's synchronising backward, which writes them, as 'Temp': "
        "the second step, which holds all the first one did and them, is the peak"
    )
    return wrapped


class RunPeakOnly:
    """A memory tracker that keeps the run's peak snapshot (what this command reads) and not every module's own
    peaks. Torch's trackers update those on every op by walking all the modules tracked so far, O(ops x modules):
    at 36 layers most of a run's time. The run's peak is updated as the trackers update it."""

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = copy.deepcopy(snap)


def make_tracker(technique: str, model, optimizer, inputs: tuple):
    if technique == "fsdp":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = type("FSDPRunPeakTracker", (RunPeakOnly, FSDPMemTracker), {})(model, optimizer)
        tracker.track_inputs(inputs)
        return tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = type("RunPeakTracker", (RunPeakOnly, MemTracker), {})()
    tracker.track_external(model, optimizer, *inputs)
    # MemTracker registers a gradient hook on every parameter a module's forward uses, and torch refuses a hook on
    # one that does not require grad: the frozen base gets a placeholder in the tracker's hook table instead.
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    if technique == "pp":
        # MemTracker takes a second forward of a root module (one called outside any other's forward) for the next
        # iteration and refuses it, but a pipeline stage runs one forward per micro-batch, and on the last stage
        # the loss calls the stage's lm_head, outside the stage's forward, once per micro-batch too: a root's own
        # statistics restart at each (the layers', and the peak, are kept). The hook is registered when the
        # tracker is entered.
        track_forward = tracker._pre_fw_hook

        def each_micro_batch(module, inputs) -> None:
            name = tracker._mod_tracker.get_known_fqn(module)
            root = set(tracker._mod_tracker.parents) - {name} == {"Global"}
            if root and torch._C._current_graph_task_id() == -1:  # a forward, not a recompute
                tracker.memory_tracking.pop(module, None)
            track_forward(module, inputs)

        tracker._pre_fw_hook = each_micro_batch
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass


def table(result: dict) -> str:
    gib = memory.GIB
    lines = [
        f"{result['technique']} (experiments/{SCRIPTS[result['technique']]}/train.py), rank {result['rank']} of "
        f"{result['world_size']}: {LABEL}",
        "",
        "memory, tracked peak by category:",
    ]
    lines += [f"  {k:<22} {v / gib:8.3f} GiB" for k, v in result["categories"].items() if v]
    lines += [f"  {'total':<22} {result['tracked_peak_bytes'] / gib:8.3f} GiB", "memory model (ftkit/memory.py):"]
    lines += [f"  {k:<22} {v / gib:8.3f} GiB" for k, v in result["predicted"].items() if v]
    lines += [
        f"  tracked / predicted: {result['tracked_over_predicted']:.3f}",
        "",
        f"FLOPs per optimizer step: counted {result['flops_counted']:.4g} (with recompute "
        f"{result['flops_counted_with_recompute']:.4g}), convention {result['flops_convention']:.4g}, "
        f"ratio {result['flops_counted_over_convention']:.3f}; at the logits computed "
        f"{result['flops_convention_at_logits']:.4g}, ratio {result['flops_counted_over_convention_at_logits']:.3f}",
    ]
    for k, v in result["flops_convention_by_component"].items():
        lines.append(f"  {k:<26} counted {result['flops_counted_by_component'].get(k, 0):.4g}  convention {v:.4g}")
    lines += [f"bf16 fraction of matmul FLOPs: {result['bf16_matmul_fraction']:.4f}", "", "stand-ins:"]
    lines += [f"  - {s}" for s in result["stand_ins"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse_args(argv)
        result = measure(opts)
    except (RealScaleError, errors.RunError, errors.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if opts.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
