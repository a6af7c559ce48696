"""What every train.py's command line refuses in ftkit.cli.resolve, before any work: compiled LoRA dropout under
activation checkpointing on the torch releases whose compiled dropout masks are wrong there (pytorch/pytorch#198333,
torch 2.13 and 2.14), with torch's version faked."""

from __future__ import annotations

import argparse
import re
import runpy
import sys

import parity
import pytest
import torch

from ftkit import cli, errors, rundir

SCRIPTS = sorted(p.parent.name for p in (parity.ROOT / "experiments").glob("*/train.py"))
EAGER = ("tp-sp-ft", "cp-ft")  # their layers run eager whatever --compile says (cli.ALWAYS_EAGER)
# --smoke leaves --compile off and the dropout at 0: both asked for here; activation checkpointing is on by default.
COMPILED_DROPOUT = ("--smoke", "--compile", "--lora-dropout", "0.1")


def fake_torch(monkeypatch, version: str) -> None:
    """torch.__version__ as that release's (a TorchVersion, which compares with tuples, as bitsandbytes does)."""
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))


def resolve(*argv: str) -> object:
    return cli.resolve(cli.common_parser("test", experiment="single-gpu-ft").parse_args(list(argv)))


@pytest.mark.parametrize("version", ["2.13.0", "2.13.1+cu130", "2.14.0a0+git1234abc", "2.14.2+cu132"])
def test_compiled_checkpointed_dropout_is_refused_on_torch_2_13_and_2_14(monkeypatch, version):
    fake_torch(monkeypatch, version)
    with pytest.raises(errors.RunError) as refused:
        resolve(*COMPILED_DROPOUT)
    message = str(refused.value)
    assert "pytorch/pytorch#198333" in message and f"torch {version}" in message  # what is wrong, and why
    for way_out in ("--lora-dropout 0", "--no-compile", "--no-grad-checkpointing", "2.15"):
        assert way_out in message
    with pytest.raises(errors.RunError, match="198333"):
        resolve()  # a GPU run's defaults: compiled, checkpointed, --lora-dropout 0.05


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.15.0", "2.15.1+cu132", "2.16.0a0+gitabc", "3.0.0"])
def test_other_torch_releases_pass(monkeypatch, version):
    fake_torch(monkeypatch, version)
    assert resolve(*COMPILED_DROPOUT).compile
    assert resolve().lora_dropout == 0.05


@pytest.mark.parametrize(
    "way_out",
    [
        ("--lora-dropout", "0"),
        ("--no-compile",),
        ("--no-grad-checkpointing",),
    ],
)
def test_each_way_out_passes_on_torch_2_14(monkeypatch, way_out):
    fake_torch(monkeypatch, "2.14.0")
    resolve(*COMPILED_DROPOUT, *way_out)
    resolve(*way_out)  # from a GPU run's defaults too
    resolve("--smoke", "--lora-dropout", "0.1")  # the walkthrough runs eager unless --compile is given


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in EAGER])
def test_every_script_that_compiles_refuses_it_before_any_work(monkeypatch, tmp_path, script):
    fake_torch(monkeypatch, "2.14.0")
    world = None if script == "single-gpu-ft" else 2
    out = tmp_path / "run"
    message = parity.refused(
        monkeypatch, f"experiments/{script}/train.py", *COMPILED_DROPOUT, "--output-dir", str(out), world=world
    )
    assert "pytorch/pytorch#198333" in message and not out.exists()


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("tp-sp-ft", ()),  # a GPU run's defaults: --compile on, the layers eager whatever it says
        ("cp-ft", ()),
        (
            "fsdp-ft",
            ("--quant", "nf4"),
        ),  # a 4-bit base: the layers run eager by default (an explicit --compile is refused)
        ("pp-ft", ("--schedule", "zbv")),  # a zero-bubble schedule: the weight gradients apart, eager layers
    ],
)
def test_runs_whose_layers_run_eager_are_not_refused(monkeypatch, script, argv):
    """No compiled dropout where the decoder layers run eager (`compilation.compile_layers`' eager_because)."""
    fake_torch(monkeypatch, "2.14.0")
    monkeypatch.setattr(sys, "argv", [script, *argv])
    args = runpy.run_path(str(parity.ROOT / "experiments" / script / "train.py"))["parse_args"]()
    assert args.compile and args.grad_checkpointing and args.lora_dropout > 0 and not cli.layers_compiled(args)


def test_pp_ft_compiles_its_layers_except_under_a_zero_bubble_schedule(monkeypatch):
    """A zero-bubble schedule computes a layer's weight gradients apart from its input gradients, which a compiled
    layer's one backward node cannot do: its layers run eager by default, an explicit --compile is refused with the
    reason, and the script passes the reason to compile_layers; 1f1b compiles."""
    parse_args = runpy.run_path(str(parity.ROOT / "experiments" / "pp-ft" / "train.py"))["parse_args"]
    for schedule, compiled in (("1f1b", True), ("interleaved-1f1b", True), *((s, False) for s in cli.PP_ZERO_BUBBLE)):
        monkeypatch.setattr(sys, "argv", ["train.py", "--schedule", schedule])
        args = parse_args()
        assert args.compile and cli.layers_compiled(args) == compiled, schedule
    monkeypatch.setattr(sys, "argv", ["train.py", "--schedule", "zbv", "--compile"])
    with pytest.raises(errors.RunError, match="--schedule zbv --compile: the decoder layers cannot be compiled"):
        parse_args()
    source = (parity.ROOT / "experiments" / "pp-ft" / "train.py").read_text()
    assert "compile_layers(model, args.compile, eager_because=cli.eager_because(args))" in source


def test_the_hugging_face_baseline_is_not_refused(monkeypatch):
    """assets/hf_baseline.py takes the common flags (--compile on by default on a GPU run) and never compiles."""
    fake_torch(monkeypatch, "2.14.0")
    monkeypatch.setattr(sys, "argv", ["hf_baseline.py"])
    args = runpy.run_path(str(parity.ROOT / "assets" / "hf_baseline.py"))["parse_args"]()
    assert not args.compile and args.lora_dropout > 0


@pytest.mark.parametrize("script", SCRIPTS)
def test_always_eager_names_the_scripts_that_never_compile_their_layers(script):
    """cli.ALWAYS_EAGER against the scripts: those that pass compile_layers an eager_because on every run."""
    source = (parity.ROOT / "experiments" / script / "train.py").read_text()
    call = re.search(r"compilation\.compile_layers\(([^()]*(?:\([^()]*\)[^()]*)*)\)", source).group(1)
    always_eager = re.search(r"eager_because=(\w+\.)?[A-Z_]+\s*$", call) is not None  # a constant: every run
    assert always_eager == (script in EAGER) == (script in cli.ALWAYS_EAGER), call
    assert set(cli.ALWAYS_EAGER) == {*EAGER, "hf-baseline"}


def test_qlora_without_bitsandbytes_is_refused_with_the_way_out(monkeypatch):
    """The GPU machines this project is measured on have no bitsandbytes: --quant nf4 says so before any work,
    instead of transformers' ImportError once the model loads; --quant none runs."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    parser = cli.common_parser("test", experiment="single-gpu-ft")
    parser.add_argument("--quant", default="nf4")
    with pytest.raises(errors.RunError, match="needs bitsandbytes.*--quant none"):
        cli.resolve(parser.parse_args(["--smoke"]))
    assert cli.resolve(parser.parse_args(["--smoke", "--quant", "none"])).quant == "none"


def test_micro_batches_by_tokens_are_one_row_and_refused_where_they_cannot_hold(monkeypatch):
    """--micro-batch-tokens N: one packed row of N positions per micro-batch (--micro-batch-size 1); refused below
    --max-length, beside a --micro-batch-size of more rows, unpacked, and in pp-ft and cp-ft (padded rows)."""
    assert resolve("--smoke", "--micro-batch-tokens", "2048").micro_batch_size == 1
    for argv, said in [
        (("--micro-batch-tokens", "256"), "less than --max-length 512"),
        (("--micro-batch-tokens", "2048", "--micro-batch-size", "2"), "give one of them"),
        (("--micro-batch-tokens", "2048", "--no-packing"), "one padded example per row"),
    ]:
        with pytest.raises(errors.RunError, match=said):
            resolve("--smoke", *argv)
    for script in ("pp-ft", "cp-ft"):
        with pytest.raises(errors.RunError, match="--micro-batch-tokens"):
            monkeypatch.setattr(sys, "argv", [script, "--smoke", "--micro-batch-tokens", "8192"])
            runpy.run_path(str(parity.ROOT / "experiments" / script / "train.py"))["parse_args"]()


def test_checkpointing_by_layer_forms_and_refusals():
    """--checkpointing all|none|every-K (K >= 1; every-1 is all), --no-grad-checkpointing its old spelling of none,
    the two at odds refused, and a malformed value refused naming the forms; grad_checkpointing stays the bool."""
    for argv, spec, on in [
        ((), "all", True),
        (("--checkpointing", "none"), "none", False),
        (("--checkpointing", "every-1"), "all", True),
        (("--checkpointing", "every-3"), "every-3", True),
        (("--no-grad-checkpointing",), "none", False),
        (("--no-grad-checkpointing", "--checkpointing", "none"), "none", False),
    ]:
        args = resolve("--smoke", *argv)
        assert (args.checkpointing, args.grad_checkpointing) == (spec, on), argv
    for bad in ("every-0", "every-x", "every2", "some", "every--2", "every-2.5"):
        with pytest.raises(errors.RunError, match="give all, none or every-K"):
            resolve("--smoke", "--checkpointing", bad)
    with pytest.raises(errors.RunError, match="disagree"):
        resolve("--smoke", "--checkpointing", "every-2", "--no-grad-checkpointing")
    assert cli.checkpoint_every("none") == 0 and cli.checkpoint_every("all") == 1 == cli.checkpoint_every("every-1")
    assert cli.checkpointed_layers("every-2", 5) == [True, False, True, False, True]
    assert cli.checkpointed_layers("all", 3) == [True] * 3 and cli.checkpointed_layers("none", 2) == [False] * 2
    # a run recorded before --checkpointing (grad_checkpointing only), as --resume takes its flags
    old = argparse.Namespace(grad_checkpointing=False, checkpointing=None, explicit_flags=[])
    cli.resolve_checkpointing(old)
    assert old.checkpointing == "none" and not old.grad_checkpointing
    # --resume of an every-2 run with --no-grad-checkpointing given again: none (RESUME_MAY_CHANGE)
    again = argparse.Namespace(grad_checkpointing=False, checkpointing="every-2", explicit_flags=["grad_checkpointing"])
    cli.resolve_checkpointing(again)
    assert again.checkpointing == "none"
    assert "checkpointing" in rundir.RESUME_MAY_CHANGE and "checkpointing" not in rundir.RESUME_MUST_MATCH
