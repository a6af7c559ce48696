"""Regional compilation: each decoder layer compiled (torch.compile), one graph for all of them, with the
sequence length a dynamic size so packed micro-batches of any width reuse it."""

from __future__ import annotations

import functools
import os

import torch

from ftkit import ranks

COMPILE_BACKEND_ENV = "FTKIT_COMPILE_BACKEND"  # torch.compile's backend [inductor]; the tests also use aot_eager


MAX_COMPILED_GRAPHS = 3  # what a run may compile (issue 30): the training layer's graph, and a recompile or two

# Why tp-sp-ft runs its decoder layers eager (`compile_layers`' eager_because; said once, kept in its summary).
TP_SP_EAGER_BECAUSE = (
    "tp-sp-ft's collectives are torch.distributed calls inside hand-rolled autograd Functions, recorded on every step "
    "by ftkit.comm.recording (wrappers with a lock and callbacks), which dynamo cannot trace: a layer would break"
)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' `GradientCheckpointingLayer`s: `Qwen3DecoderLayer`), in order,
    wherever a wrapper (PEFT, DDP, FSDP2, a pipeline stage) has put them."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_layers(model, enabled: bool, eager_because: str | None = None) -> dict | None:
    """--compile: compile each decoder layer's own forward (regional compilation), after PEFT is applied and before
    any wrapping that shards or replicates the model; what the run summary reports (`compile_report`).

    The compiled region is the layer's forward and nothing around it: the module's hooks (FSDP2's all-gathers, DDP's)
    and transformers' activation checkpointing stay eager, outside it. transformers (>= 5.23) checkpoints a layer by
    wrapping its class's `forward`; compiling the whole call put that checkpoint, and the LoRA dropout and SDPA it
    recomputes (random ops), inside one graph, which inductor's partitioner on torch 2.11 cannot split
    (`AssertionError: Node ... was invalid, but is output`; peft#3020, pytorch#135459). Here each layer's instance
    `forward` is `_CompiledForward`: the checkpoint (torch.utils.checkpoint, as transformers runs it) around the
    compiled original forward. The recompute runs the compiled forward again, and the checkpoint restores the RNG
    state first, so the recomputed dropout masks are the first forward's.

    All the layers run the same code on tensors of the same shapes, and their weights are the compiled function's
    inputs, not constants: one compiled function for all of them, traced once. Micro-batches change width from one
    to the next (packed rows are as wide as the fullest, `batching.packed_width`; padded ones as the longest
    example), so every call marks the sequence's dimensions dynamic (`mark_sequence_dynamic`): one graph whose
    kernels take the width as an argument, never recompiled for a new one. Only those sizes: `dynamic=True` would
    also turn the layer's Python floats (LoRA's scaling, the norms' eps) into tensor inputs, 11 per layer call.
    `fullgraph=True` makes a graph break an error at the first step instead of a silent slowdown.

    Only training forwards run compiled. An eval forward (the eval loss, generation) runs the eager forward: eval
    micro-batches are padded to their own longest example, so each new shape (and the switch to eval mode and
    no-grad) would compile another graph, for a few forwards every --eval-every steps.

    `eager_because`: the technique cannot compile its layers (says why once, and the summary records it)."""
    if not enabled:
        return None
    if eager_because:
        ranks.print0(f"--compile: the decoder layers run eager: {eager_because}")
        return {"eager": eager_because}
    backend = os.environ.get(COMPILE_BACKEND_ENV, "inductor")
    layers = decoder_layers(model)
    forward = layer_forward(type(layers[0]))
    compiled = torch.compile(forward, backend=backend, fullgraph=True)
    for layer in layers:
        layer.forward = _CompiledForward(layer, forward, compiled)
    ranks.print0(f"--compile: {len(layers)} decoder layers compiled ({backend}); the first step compiles them")
    return {"backend": backend, "layers": len(layers)}


def layer_forward(cls: type):
    """The decoder layer class's own forward, under the activation-checkpointing wrapper transformers >= 5.23 puts
    on every `GradientCheckpointingLayer` subclass (`functools.wraps`: the original is its `__wrapped__`)."""
    return getattr(cls.forward, "__wrapped__", cls.forward)


class _CompiledForward:
    """A decoder layer's forward as `compile_layers` sets it: checkpointed as transformers checkpoints it (when the
    layer checkpoints and trains), around the compiled forward in training (autograd on, the layer in train mode)
    and the eager one otherwise (an eval, even one that keeps autograd on, as pp-ft's schedule does), and also under
    a TorchDispatchMode that watches every op (the sampled steps' collective recording in tp-ft and fsdp-tp-ft, a
    FlopCounterMode): dynamo does not compile under one, and such a mode must see the eager ops anyway."""

    def __init__(self, layer: torch.nn.Module, forward, compiled):
        self.layer, self.forward, self.compiled = layer, forward, compiled

    def __call__(self, *args, **kwargs):
        from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack

        layer = self.layer
        run = self.forward
        if layer.training and torch.is_grad_enabled() and not any_torch_dispatch_mode_on_stack():
            mark_sequence_dynamic(args, kwargs)
            run = self.compiled
        step = functools.partial(run, layer, **kwargs)
        if layer.gradient_checkpointing and layer.training:
            return layer._gradient_checkpointing_func(step, *args)
        return step(*args)


def mark_sequence_dynamic(args: tuple, kwargs: dict) -> None:
    """Mark, in a decoder layer's call, every dimension (past the batch's) as long as the sequence dynamic: the
    hidden states' [rows, width, hidden], RoPE's cos and sin [rows, width, head_dim], the position ids, a mask's
    [rows, 1, width, width]; and the varlen boundaries' count (`attention.model_inputs`' `cu_seq_lens_q`). A size
    that only happens to equal the width is made dynamic too, which the graph computes just as well. `maybe_`: a
    size the graph needs static stays static (a recompile, which the run's summary would report) instead of an
    error."""
    hidden = args[0] if args else kwargs["hidden_states"]
    width = hidden.shape[1]
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):  # the packed rows' segments: as many as the micro-batch has
        if kwargs.get(name) is not None:
            torch._dynamo.maybe_mark_dynamic(kwargs[name], 0)
    stack = [*args, *kwargs.values()]
    while stack:
        value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, torch.Tensor):
            for dim in range(1, value.dim()):
                if value.shape[dim] == width:
                    torch._dynamo.maybe_mark_dynamic(value, dim)


def compile_report(compiled: dict | None) -> dict | None:
    """The summary's `compile`: None without --compile; {"eager": why} where the technique runs eager; else the
    backend, the layers compiled and dynamo's own counts for this process (rank 0's in a distributed run):
    `graphs` compiled, `graph_breaks` (0: the layer is one graph) and `recompiles` (0: one graph all run, whatever
    the widths), with the reasons dynamo gave for any recompile."""
    if compiled is None or "eager" in compiled:
        return compiled
    from torch._dynamo.utils import counters, get_compilation_metrics

    # dynamo's reason for each recompile: the guard that failed (its first line; the rest is the user stack)
    reasons = [m.recompile_reason.splitlines()[0] for m in get_compilation_metrics() if m.recompile_reason]
    report = {
        **compiled,
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": len(reasons),
    }
    if reasons:
        report["recompile_reasons"] = reasons
    if report["graph_breaks"] or report["graphs"] > MAX_COMPILED_GRAPHS:
        ranks.print0(f"--compile: {report}: expected no graph break and at most {MAX_COMPILED_GRAPHS} graphs")
    return report
