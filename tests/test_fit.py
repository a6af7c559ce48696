"""--fit auto (ftkit/fit.py): on a GPU the run chooses its micro-batch layout and checkpointing from the memory model
and the planner before the model loads; the walkthrough and any run that gives those flags keep them. CUDA is faked
where the choice reads it (torch.cuda's name, memory and availability): the choice is what is tested, every rank
makes it from the same facts."""

from __future__ import annotations

import dataclasses
import runpy
import types

import pytest
import torch
from conftest import ROOT

from ftkit import cli, data, errors, fit, hardware, ranks
from ftkit.plan import fitting, techniques


def fake_cuda(monkeypatch, name: str = "NVIDIA H100 80GB HBM3", memory: float = 79.1 * 2**30) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(total_memory=memory)
    )


def gpu_args(*argv: str):
    parser = cli.common_parser("test", experiment="single-gpu-ft")
    parser.add_argument("--quant", default="none")
    return cli.resolve(parser.parse_args(["--model", "qwen3-4b-shape", *argv]))


def test_fit_is_the_gpu_default_and_off_in_the_walkthrough(monkeypatch):
    assert gpu_args().fit == "off"  # no CUDA here
    fake_cuda(monkeypatch)
    assert gpu_args().fit == "auto" and gpu_args("--fit", "off").fit == "off"
    assert cli.resolve(cli.common_parser("t", experiment="single-gpu-ft").parse_args(["--smoke"])).fit == "off"
    assert fit.reason_not_to_fit(gpu_args()) is None
    for argv in (["--micro-batch-size", "4"], ["--micro-batch-tokens", "8192"], ["--no-grad-checkpointing"]):
        assert "given" in fit.reason_not_to_fit(gpu_args(*argv)), argv
    assert "padded rows" in fit.reason_not_to_fit(gpu_args("--no-packing"))
    for own in ("pp-ft", "cp-ft"):  # their rows are their own: recorded as off, not as an auto they ignore
        assert (
            cli.resolve(cli.common_parser("t", experiment=own).parse_args(["--model", "qwen3-4b-shape"])).fit == "off"
        )


@pytest.mark.parametrize("key", ["rtx4090", "h100-sxm", "h200"])
def test_the_choice_is_the_fastest_layout_predicted_to_fit(key):
    """Every candidate priced by the planner: the chosen one fits (memory x margin + reserve <= the GPU's) and no
    fitting one is predicted faster."""
    args, gpu = gpu_args(), hardware.gpu(key)
    choice = fit.choose_for(args, gpu, gpu.memory_bytes, 1, {})
    rows = [
        techniques.evaluate(s, "single", {}, "none")
        for s in fitting.candidates(fit.setting(args, gpu, gpu.memory_bytes, 1))
    ]
    fit_rows = [r for r in rows if r.get("fits")]
    assert choice["predicted"]["required_bytes"] <= gpu.memory_bytes
    assert choice["predicted"]["tokens_per_s"] == max(r["tokens_per_s"] for r in fit_rows)
    assert "a prediction" in choice["said"]
    if key != "rtx4090":  # an 80 GB card is not filled by 2 rows with every layer checkpointed
        assert choice["chosen"] != {"micro_batch_tokens": None, "checkpointing": "all"}
        assert choice["predicted"]["tokens_per_s"] > choice["reference_tokens_per_s"]


def test_global_batches_take_the_choice_before_the_model_and_record_it(monkeypatch, capsys):
    fake_cuda(monkeypatch)
    monkeypatch.setattr(errors, "memory_prediction", None)  # set by the choice; restored after the test
    args = gpu_args()
    examples = [data.Encoded(list(range(3, 40 + i)), [-100] * 30 + list(range(33, 40 + i)), False) for i in range(40)]
    batches = fit.global_batches(args, examples)
    chosen = args.fit_choice["chosen"]
    assert args.micro_batch_tokens == chosen["micro_batch_tokens"] and args.checkpointing == chosen["checkpointing"]
    assert batches.pack_to == (args.micro_batch_tokens or args.max_length)
    assert capsys.readouterr().out.count("--fit auto: ") == 1
    assert errors.memory_prediction == args.fit_choice["said"] in ranks.out_of_memory()
    off = gpu_args("--micro-batch-size", "4")
    fit.global_batches(off, examples)
    assert off.fit_choice == {"off": "--micro-batch-size given"} and off.micro_batch_tokens is None


def test_the_devlogs_fit_table_is_what_the_fit_chooses():
    module = runpy.run_path(str(ROOT / "assets" / "fit_table.py"))
    assert module["table"](module["main"]()) in (ROOT / "devlogs" / "single-gpu-ft.md").read_text()


def test_a_job_across_nodes_is_priced_across_nodes(monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE gives the nodes: 16 ranks, 8 a node, are 2 nodes, and FSDP's collectives over
    all 16 then cross the slower link between them; without it (a single-node launch) the job is one node."""
    args, gpu = gpu_args("--batch-size", "64"), hardware.gpu("h100-sxm")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one = fit.setting(args, gpu, gpu.memory_bytes, 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    two = fit.setting(args, gpu, gpu.memory_bytes, 16)
    assert (one.nodes, two.nodes) == (1, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # not a divisor of the world: no node count to trust
    assert fit.setting(args, gpu, gpu.memory_bytes, 16).nodes == 1
    step = [techniques.evaluate(s, "fsdp", {"dp": 16}, "none")["step_time_s"] for s in (one, two)]
    assert step[1] > step[0]


def test_the_planner_prices_each_run_at_the_layout_its_fit_chooses(capsys):
    """`python -m ftkit.plan` (its default --fit auto) prices each experiment at the layout the run's --fit auto
    would choose on that GPU, so that its recommendation is what the run does: on 2 x RTX 4090 the NF4 base frees the
    memory for checkpointing every other layer, and QLoRA DDP leads where bf16 DDP led at the reference layout. A
    layout flag or --fit off prices every experiment at the flags' layout; pp-ft and cp-ft keep their own."""
    from ftkit.plan.__main__ import main

    gpu = hardware.gpu("rtx4090")
    planned = main(["--gpus", "2", "--gpu", "rtx4090", "--json"])
    for quant in ("nf4", "none"):
        parser = cli.common_parser("test", experiment="ddp-ft")
        parser.add_argument("--quant", default=quant)
        args = cli.resolve(parser.parse_args(["--model", "qwen3-4b-shape", "--compile"]))
        run = fit.choose_for(args, gpu, gpu.memory_bytes, 2, {"dp": 2})
        row = next(r for r in planned["techniques"] if r["experiment"] == "ddp-ft" and r["quant"] == quant)
        assert row["fit"] == run["chosen"], quant
        at = dataclasses.replace(
            fit.setting(args, gpu, gpu.memory_bytes, 2),
            layout="auto",
            host=None,
            micro_batch_tokens=run["chosen"]["micro_batch_tokens"],
            checkpoint_every=2 if run["chosen"]["checkpointing"] == "every-2" else 1,
            grad_checkpointing=run["chosen"]["checkpointing"] != "none",
        )
        assert row["tokens_per_s"] == techniques.evaluate(at, "ddp", {"dp": 2}, quant)["tokens_per_s"]
    rec = planned["recommendation"]
    chosen = {"micro_batch_tokens": 4096, "checkpointing": "every-2"}
    assert (rec["experiment"], rec["quant"], rec["fit"]) == ("ddp-ft", "nf4", chosen)
    assert "at --fit auto's --micro-batch-tokens 4096 --checkpointing every-2" in rec["reason"]
    assert next(r for r in planned["techniques"] if r["experiment"] == "pp-ft").get("fit") is None
    off = main(["--gpus", "2", "--gpu", "rtx4090", "--fit", "off", "--json"])
    flags = main(["--gpus", "2", "--gpu", "rtx4090", "--micro-batch-size", "2", "--json"])["techniques"]
    assert [r for r in off["techniques"] if r["technique"] != "cp"] == [r for r in flags if r["technique"] != "cp"]
    assert not any(r.get("fit") for r in off["techniques"])
    assert (off["recommendation"]["experiment"], off["recommendation"]["quant"]) == ("ddp-ft", "none")
    capsys.readouterr()


def test_the_planner_plans_each_script_at_its_own_micro_batch_unless_given():
    """cp-ft runs one whole meeting per micro-batch (its REAL defaults): without --micro-batch-size the planner prices
    it there, as `torchrun experiments/cp-ft/train.py` runs, and every other experiment at the common 2 rows; a given
    --micro-batch-size plans them all at it."""
    import ast

    from ftkit.plan.__main__ import main

    tree = ast.parse((ROOT / "experiments" / "cp-ft" / "train.py").read_text())
    real = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "REAL")
    own = {k.arg: ast.literal_eval(k.value) for k in real.keywords}
    assert fitting.OWN_MICRO_BATCH == {"cp": own["micro_batch_size"]}
    job = ["--gpus", "2", "--gpu", "rtx4090", "--max-length", "32768", "--batch-size", "8", "--json"]
    default, ones, twos = (
        main(job + flag)["techniques"] for flag in ([], ["--micro-batch-size", "1"], ["--micro-batch-size", "2"])
    )
    by = {r["technique"]: r for r in default}
    assert by["cp"] == next(r for r in ones if r["technique"] == "cp")
    assert by["cp"]["micro_batch_size"] == 1 and by["cp"]["fits"]  # 19.0 GiB, where 2 rows of 32k need 27.4
    assert not next(r for r in twos if r["technique"] == "cp")["fits"]
    assert [r for r in default if r["technique"] != "cp"] == [r for r in twos if r["technique"] != "cp"]
