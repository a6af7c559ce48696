"""--compile (issue 30): each decoder layer compiled in place, and the step it computes is the eager one.

Every compiled run is compared with the eager single-process reference of the same flags (`parity.reference`, the
runs tests/test_fsdp.py and tests/test_ddp.py make, shared when the whole suite runs), and its summary's `compile`
(dynamo's counters in that process) must show one graph, no graph break and no recompile: the first step compiled
the layer and no later one compiled anything.

Inductor compiles a layer in ~40-70 s on 2 busy cores, so one in-process test uses it (the reference configuration's
layer, `test_real_defaults_compile_to_one_graph`, where inductor's own numerics meet the 1e-5 bar), and the script
runs use the "aot_eager" backend (FTKIT_COMPILE_BACKEND): the same dynamo capture, the same graph breaks and
recompiles, and AOTAutograd's joint forward/backward, run by eager kernels, so the wrapping (DDP's hooks, FSDP2's)
is what they check.
"""

from __future__ import annotations

import json
import time

import parity
import pytest
import test_ddp
import test_fsdp
import test_packing
import torch
from conftest import run_script

from ftkit import batching, cli, compilation, lora, models, prepare

AOT_EAGER = {compilation.COMPILE_BACKEND_ENV: "aot_eager"}
ONE_GRAPH = {"graphs": 1, "graph_breaks": 0, "recompiles": 0}


def compiled_counts(run_dir) -> dict:
    report = json.loads((run_dir / "summary.json").read_text())["compile"]
    return {k: report[k] for k in ONE_GRAPH}


def assert_same_step(run_dir, ref) -> None:
    loss = parity.compare_losses(run_dir, ref)
    eval_loss = parity.compare_losses(run_dir, ref, key="eval_loss")
    adapter = parity.compare_adapters(run_dir / "adapter", ref / "adapter")
    print(f"compiled vs eager: max |loss diff| {loss:.2e}, eval {eval_loss:.2e}, adapter {adapter:.2e}")
    assert loss <= parity.LOSS_TOL and eval_loss <= parity.LOSS_TOL
    assert adapter <= parity.ADAPTER_TOL


def widths(data_dir, flags) -> set[int]:
    """The widths of the training micro-batches a run with these flags computes, laid out as the scripts lay them
    out (`batching.global_batches`): packed rows as wide as each micro-batch's fullest (`batching.packed_width`)."""
    from ftkit import data

    parser = cli.common_parser("single-gpu-ft", experiment="single-gpu-ft")
    args = cli.resolve(parser.parse_args(["--data", str(data_dir), *flags]))
    _, train_set, _, _ = prepare.encode_data(args, data.load_splits(args.data))
    batches = batching.global_batches(args, train_set)
    return {
        mb["input_ids"].shape[1]
        for step in range(args.max_steps)
        for mb in batches.micro_batches(step, args.micro_batch_size)
    }


def test_single_gpu_compiled_takes_the_eager_step(tmp_path_factory, short_data_dir):
    """bf16-LoRA's reference script (--quant none), its layers compiled (dynamo and AOTAutograd, run by eager
    kernels: inductor's own numerics are `test_real_defaults_compile_to_one_graph`'s), on micro-batches of several
    widths (packed short examples): per-step losses within 1e-5 of eager, the 4 layers compiled at the first step
    and never again for a new width (a dynamic size)."""
    flags = ("--data", str(short_data_dir), *test_packing.FLAGS)
    assert len(widths(short_data_dir, test_packing.FLAGS)) >= 2  # the graph must serve several widths
    out = tmp_path_factory.mktemp("compile") / "single"
    start = time.monotonic()
    proc = run_script(
        "experiments/single-gpu-ft/train.py",
        *flags,
        "--quant",
        "none",
        "--compile",
        "--output-dir",
        str(out),
        env=AOT_EAGER,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 decoder layers compiled (aot_eager)" in proc.stdout
    rows = parity.metrics(out)
    print(f"compiled run: {time.monotonic() - start:.1f} s; step times {[round(r['step_time_s'], 1) for r in rows]} s")
    assert_same_step(out, parity.reference(tmp_path_factory.mktemp("ref"), *flags, quant="none"))
    # SDPA (the CPU's kernel) runs a micro-batch whose rows hold one example each unmasked (is_causal) and one that
    # packs two or more with the block-diagonal mask: a graph for each, the second a recompile for the mask. (A GPU's
    # varlen kernel takes both unmasked, with their boundaries: one graph, tests/test_attention.py.)
    report = json.loads((out / "summary.json").read_text())["compile"]
    assert compiled_counts(out) == {"graphs": 2, "graph_breaks": 0, "recompiles": 1}
    assert "attention_mask is None" in report["recompile_reasons"][0]


@pytest.mark.parametrize(
    ("script", "flags", "quant"),
    [
        ("experiments/ddp-ft/train.py", test_ddp.flags, "nf4"),  # QLoRA: bitsandbytes' 4-bit matmul in the graph
        ("experiments/fsdp-ft/train.py", test_fsdp.flags, "none"),
    ],
    ids=["ddp", "fsdp"],
)
def test_distributed_compiled_layers_take_the_eager_step(
    tmp_path_factory, data_dir, short_data_dir, script, flags, quant
):
    """DDP (its gradient hooks fire from the compiled backward) and FSDP2 (its all-gather and reduce-scatter hooks
    run outside the compiled layer) on 2 ranks, layers compiled: the reference's losses and adapter, one graph."""
    flags = flags(data_dir, 8)
    out = tmp_path_factory.mktemp("compile") / script.split("/")[1]
    launch = parity.torchrun(script, *flags, "--compile", "--output-dir", str(out), env=AOT_EAGER)
    assert launch.returncode == 0, launch.report()
    print(f"compiled run: {launch.seconds:.1f} s")
    assert_same_step(out, parity.reference(tmp_path_factory.mktemp("ref"), *flags, quant=quant))
    assert compiled_counts(out) == ONE_GRAPH


def tiny_lora(grad_checkpointing: bool, dtype: torch.dtype = torch.float32, dropout: float = 0.0):
    model = models.load_model("tiny", quant="none", dtype=dtype, device=torch.device("cpu"), seed=0)
    model = lora.freeze_base(model, grad_checkpointing)
    return lora.adapters_compute_in(lora.apply_lora(model, rank=8, alpha=16.0, dropout=dropout, seed=0), dtype)


def fresh_dynamo() -> None:
    """This process's compiled code and dynamo's counts cleared (pytest runs other tests in it)."""
    from torch._dynamo.utils import clear_compilation_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()


def train_steps(model, dtype: torch.dtype, seed: int = 0) -> tuple[list[float], list[torch.Tensor]]:
    """Two packed micro-batches of different widths (128 and 96 positions), forward and backward as the scripts run
    them (under `compute_autocast`, dropout masks drawn from the seeded stream): their losses and the LoRA grads."""
    torch.manual_seed(seed)
    model.train()
    model.zero_grad()
    mb = packed_batch()
    narrower = {k: v[:, :96] for k, v in mb.items() if k != "logit_positions"} | {
        "logit_positions": mb["logit_positions"]
    }
    losses = []
    for batch in (mb, narrower):
        with lora.compute_autocast(torch.device("cpu"), dtype):
            loss = lora.answer_logits(model, batch).float().square().mean()
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_real_defaults_compile_to_one_graph(monkeypatch):
    """The reference configuration's layer, compiled by inductor: LoRA dropout 0.05, bf16 autocast, activation
    checkpointing, packed rows of two widths - one graph, no break, no recompile (on torch 2.11, compiling the
    checkpointed call crashed inductor's partitioner: `ftkit.compilation`). .ci/gpu-machine-env runs it there."""
    monkeypatch.setenv(compilation.COMPILE_BACKEND_ENV, "inductor")
    fresh_dynamo()
    model = tiny_lora(True, torch.bfloat16, dropout=0.05)
    compiled = compilation.compile_layers(model, True)
    train_steps(model, torch.bfloat16)
    report = compilation.compile_report(compiled)
    fresh_dynamo()
    assert {k: report[k] for k in ONE_GRAPH} == ONE_GRAPH, report


def test_compiled_dropout_is_the_eager_dropout(monkeypatch):
    """The same layer in fp32, compiled by inductor with its `fallback_random` (its dropout drawn by the eager
    kernels, from the same stream): the eager step to 1e-5, dropout masks and their recompute in backward included
    (LoRA's B starts at zero, so the masks show in B's gradients)."""
    from torch._inductor import config as inductor_config

    monkeypatch.setenv(compilation.COMPILE_BACKEND_ENV, "inductor")
    fresh_dynamo()
    eager_losses, eager_grads = train_steps(tiny_lora(True, dropout=0.05), torch.float32)
    model = tiny_lora(True, dropout=0.05)
    compilation.compile_layers(model, True)
    with inductor_config.patch(fallback_random=True):
        losses, grads = train_steps(model, torch.float32)
    fresh_dynamo()
    diff = max((a - b).abs().max().item() for a, b in zip(grads, eager_grads))
    print(f"compiled vs eager, fp32, dropout 0.05: losses {losses} vs {eager_losses}; grads max |diff| {diff:.2e}")
    assert max(abs(a - b) for a, b in zip(losses, eager_losses)) <= 1e-5
    assert diff <= 1e-5 * max(g.abs().max().item() for g in eager_grads)


def packed_batch() -> dict:
    """Two packed rows of 128 positions, two examples each (position_ids restarting), no mask."""
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 1000, (2, 128), generator=generator),
        "position_ids": torch.cat([torch.arange(50), torch.arange(78)]).repeat(2, 1),
        "logit_positions": torch.arange(40, 60).repeat(2, 1),
    }


def saved_activation_bytes(model, mb: dict) -> tuple[int, dict]:
    """Bytes autograd saves for backward in one forward (distinct storages, parameters aside: those are held by
    the model anyway), and the LoRA gradients of that forward's backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = lora.answer_logits(model, mb)
    logits.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return sum(saved.values()), grads


def test_compiled_layers_keep_activation_checkpointing(monkeypatch):
    """Non-reentrant checkpointing (transformers' GradientCheckpointingLayer) around the compiled forward: backward
    still recomputes each layer, so a forward saves exactly what the eager checkpointed layers keep (their inputs),
    a fraction of what it saves without checkpointing; the gradients are the eager ones. Eval forwards (eval mode,
    no grad) and forwards under a TorchDispatchMode run the eager layer and compile nothing."""
    from torch._dynamo.utils import clear_compilation_metrics, counters
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setenv(compilation.COMPILE_BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()  # this process's compiled code and counts (pytest runs other tests in it)
    counters.clear()
    clear_compilation_metrics()
    mb = packed_batch()
    eager_bytes, eager_grads = saved_activation_bytes(tiny_lora(True), mb)
    model = tiny_lora(True)
    assert compilation.compile_layers(model, True) == {"backend": "aot_eager", "layers": 4}
    compiled_bytes, compiled_grads = saved_activation_bytes(model, mb)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for the 4 layers
    whole_bytes, _ = saved_activation_bytes(tiny_lora(False), mb)  # eager, every activation kept
    print(f"saved for backward: eager checkpointed {eager_bytes}, compiled checkpointed {compiled_bytes}, eager "
          f"without checkpointing {whole_bytes} bytes")  # fmt: skip
    assert compiled_bytes == eager_bytes  # the checkpoint is outside the compiled forward, as in the eager layers
    assert whole_bytes > 3 * compiled_bytes
    assert all(torch.equal(compiled_grads[n], g) for n, g in eager_grads.items())
    assert not counters["graph_break"]

    model.eval()
    with torch.no_grad():
        lora.answer_logits(model, mb)
    model.train()
    with FlopCounterMode(display=False):
        lora.answer_logits(model, mb).sum().backward()
    # Another width (the next micro-batch's fullest row): the same graph, the width a dynamic size.
    narrower = {k: v[:, :96] for k, v in mb.items() if k != "logit_positions"} | {
        "logit_positions": mb["logit_positions"]
    }
    lora.answer_logits(model, narrower).sum().backward()
    report = compilation.compile_report({"backend": "aot_eager", "layers": 4})
    assert (report["graphs"], report["graph_breaks"], report["recompiles"]) == (1, 0, 0), report
    torch._dynamo.reset()


def test_a_technique_that_cannot_compile_says_so(capsys):
    model = tiny_lora(True)
    compiled = compilation.compile_layers(model, True, eager_because="hand-rolled collectives")
    assert compiled == {"eager": "hand-rolled collectives"} == compilation.compile_report(compiled)
    assert "the decoder layers run eager: hand-rolled collectives" in capsys.readouterr().out
    assert all("forward" not in vars(layer) for layer in compilation.decoder_layers(model))  # the class's forward
    assert compilation.compile_layers(model, False) is None and compilation.compile_report(None) is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], True), (["--no-compile"], False), (["--smoke"], False), (["--smoke", "--compile"], True)],
)
def test_compile_is_on_for_gpu_runs_and_off_for_the_walkthrough(argv, expected):
    args = cli.resolve(cli.common_parser("test", experiment="single-gpu-ft").parse_args(argv))
    assert args.compile is expected


def test_checkpointing_every_other_layer_is_the_same_step():
    """--checkpointing every-2: freeze_base checkpoints exactly layers 0, 2, ... (each layer's own flag, which the
    eager and the compiled layers check); the step is the same math as all and none (fp32, LoRA dropout on: the
    recompute restores the RNG state), to 1e-6. (Compiled with aot_eager, every-2 is one graph, no recompile: 15 s
    on CPU, run by hand, not here.)"""
    steps = {}
    for spec in ("all", "every-2", "none"):
        model = tiny_lora(spec, dropout=0.05)
        layers = compilation.decoder_layers(model)
        assert [layer.gradient_checkpointing for layer in layers] == lora.checkpointed_layers(spec, len(layers))
        steps[spec] = train_steps(model, torch.float32)
    assert [layer.gradient_checkpointing for layer in layers] == [False] * len(layers) and len(layers) > 2
    losses, grads = steps["all"]
    for spec, (other_losses, other_grads) in steps.items():
        assert other_losses == pytest.approx(losses, abs=1e-6), spec
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, other_grads)), spec
