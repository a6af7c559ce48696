"""ftkit.plan: its memory against the peaks tracked at Qwen3-4B's shape, its compute against the FLOPs counted
there, its alpha-beta term by hand, its refusals in the scripts' own words, and its recommendations pinned for
three settings."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
from pathlib import Path

import pytest

from ftkit import hardware, memory, models
from ftkit.plan import hosts, layouts, recommendation, settings, techniques, timing
from ftkit.plan.__main__ import main

REALSCALE = sorted((Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "realscale").glob("*.json"))


def setting(**kw) -> settings.Setting:
    base = dict(
        config=settings.model_config("Qwen/Qwen3-4B"),
        gpu=hardware.gpu("h100-sxm"),
        gpus=2,
        nodes=1,
        link=hardware.LINKS["nvlink4"],
        inter_node_link=hardware.LINKS["ib-ndr"],
        memory_bytes=hardware.gpu("h100-sxm").memory_bytes,
        layout="full",  # the alpha-beta and FLOP checks below are on full rows, the real-scale runs' layout
    )
    return settings.Setting(**{**base, **kw})


def row(result: dict, experiment: str, **match) -> dict:
    rows = [r for r in result["techniques"] if r["experiment"] == experiment]
    rows = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    assert len(rows) == 1, (experiment, match, rows)
    return rows[0]


def test_there_are_tracked_runs_to_check_against():
    techniques = {json.loads(p.read_text())["technique"] for p in REALSCALE}
    assert techniques == {"single", "ddp", "fsdp", "tp", "tp-sp", "pp", "cp"}


@pytest.mark.parametrize("path", REALSCALE, ids=[p.stem for p in REALSCALE])
def test_the_planners_memory_is_the_one_checked_at_real_scale_and_its_margin_covers_the_tracked_peak(path):
    r = json.loads(path.read_text())
    c = r["config"]
    s = setting(gpus=r["world_size"], **settings.run_flags(c))
    world = r["world_size"]
    mesh = {"single": {}, "ddp": {"dp": world}, "fsdp": {"dp": world}, "pp": {"pp": world}, "cp": {"cp": world}}.get(
        r["technique"], {"tp": world}
    )
    planned = techniques.evaluate(s, r["technique"], mesh, c["quant"])
    # What the posts say of the model at this shape: within 3% of every tracked peak (the LoRA gradients it counts
    # are not allocated yet with one micro-step per optimizer step: 2.6% of QLoRA + DDP).
    assert 0.97 <= r["tracked_peak_bytes"] / r["predicted_bytes"] <= 1.02
    if r["technique"] == "pp" and c["schedule"] != "1f1b":
        return  # the planner plans pp-ft's 1F1B; the GPipe runs check the model alone
    # The same memory model at the same configuration as the fake-tensor run's prediction (for a pipeline, its
    # busiest stage's) ...
    busiest = max(r["predicted_bytes_by_stage"].values()) if r["technique"] == "pp" else r["predicted_bytes"]
    assert planned["memory_bytes"] == pytest.approx(busiest, rel=1e-9)
    # ... and the planner's margin above it covers what was tracked. A tracked run beyond the margin means the
    # margin (or the model) must change.
    assert r["tracked_peak_bytes"] <= planned["memory_bytes"] * techniques.MEMORY_MARGIN


def test_the_recompute_the_planner_adds_is_the_one_counted_at_real_scale():
    """Checkpointing's recompute, in FLOPs per step: the planner's formula (each layer's forward again, its
    attention causal) against the count on the fake-tensor FSDP run (rank 0's sequences), to 0.1%."""
    r = json.loads(next(p for p in REALSCALE if p.stem == "fsdp-world8").read_text())
    counted = r["flops_counted_with_recompute"] - r["flops_counted"]
    on = techniques.evaluate(setting(gpus=8), "fsdp", {"dp": 8}, "none")
    off = techniques.evaluate(setting(gpus=8, grad_checkpointing=False), "fsdp", {"dp": 8}, "none")
    # The planner's compute is the convention's FLOPs (what r["flops_convention"] is for rank 0) plus the recompute.
    planned = (on["compute_s"] / off["compute_s"] - 1) * r["flops_convention"]
    assert counted == pytest.approx(planned, rel=1e-3)


def test_a_collective_costs_its_ring_bytes_at_the_link_rate_plus_a_latency_per_ring_step():
    pcie = hardware.LINKS["pcie4"]
    # 1 GB all-reduced over 2 GPUs: each sends 2 (N-1)/N x 1 GB = 1 GB, at 80% of 31.5 GB/s, in 2 ring steps.
    assert timing.collective_s("all_reduce", 1e9, 2, pcie, 0.8) == pytest.approx(1e9 / 25.2e9 + 2 * 10e-6)
    # An all-gather over 4 GPUs: 3/4 of the buffer, 3 steps.
    assert timing.collective_s("all_gather", 1e9, 4, pcie, 1.0) == pytest.approx(0.75e9 / 31.5e9 + 3 * 10e-6)
    assert timing.collective_s("all_reduce", 1e9, 1, pcie, 0.8) == 0.0


def test_refusals_are_the_scripts_own_messages():
    s = setting(gpus=16, nodes=2, batch_size=16)
    tp = techniques.evaluate(s, "tp-sp", {"tp": 16}, "none")
    assert "tensor-parallel degree 16 does not divide the model's 8 key/value heads" in tp["refused"]
    ddp = techniques.evaluate(s, "ddp", {"dp": 16}, "none")  # 16 sequences cannot be 2 per rank on 16 ranks
    assert "--batch-size 16 is not a multiple of --micro-batch-size 2 x 16" in ddp["refused"]
    pp = techniques.evaluate(setting(gpus=8), "pp", {"pp": 8}, "none")
    assert "8 pipeline stages do not divide the model's 36 layers" in pp["refused"]
    cp = techniques.evaluate(setting(gpus=4, max_length=4095), "cp", {"cp": 4}, "none")
    assert "--max-length 4095 cannot be cut into 2 x --cp = 8 equal chunks: pass --max-length 4096" in cp["refused"]
    packed = techniques.evaluate(setting(layout="packed"), "cp", {"cp": 2}, "none")
    assert packed["refused"] == techniques.CP_LAYOUT


def test_whole_meetings_on_two_4090s_fit_bf16_lora_only_sharded_or_split():
    """32k-token sequences on 2 x RTX 4090 (23.64 GiB) over PCIe: bf16 LoRA does not fit a whole replica (single,
    DDP); it fits sharded (FSDP), or split by the sequence (cp-ft) or by the layers' widths (tp-sp-ft). TP+SP holds
    less (it splits the weights too), CP sends less: K and V (8 of 32 heads) a layer, where TP+SP moves the hidden
    states 4-5.5 times a layer."""
    args = ["--gpus", "2", "--gpu", "rtx4090", "--max-length", "32768", "--micro-batch-size", "1"]
    result = main([*args, "--batch-size", "8", "--json"])
    for experiment in ("single-gpu-ft", "ddp-ft"):
        assert not row(result, experiment, quant="none")["fits"], experiment
    assert row(result, "fsdp-ft", quant="none")["fits"]
    cp, tp_sp = row(result, "cp-ft"), row(result, "tp-sp-ft")
    assert cp["fits"] and tp_sp["fits"] and cp["mesh"] == {"cp": 2}
    assert tp_sp["memory_bytes"] < cp["memory_bytes"]
    assert cp["compute_s"] == tp_sp["compute_s"] and cp["exposed_comm_s"] < tp_sp["exposed_comm_s"] / 3
    assert cp["tokens_per_s"] > tp_sp["tokens_per_s"]


def test_the_pcie_box_gets_data_parallelism_and_tp_sp_loses_to_fsdp_there(capsys):
    """The seed's box: 2 x 24 GB on PCIe 4, Qwen3-4B at the reference layout (--fit off). The job fits on one GPU,
    so the planner says data parallelism; and without NVLink TP+SP's per-layer collectives on the critical path cost
    more than FSDP's prefetched weight gathers (the claim the memory post's decision tree made the other way round).
    At --fit auto's layouts (the default) QLoRA DDP leads: test_the_planner_prices_each_run_at_the_layout_it_fits."""
    result = main(["--model", "Qwen/Qwen3-4B", "--gpus", "2", "--gpu", "rtx4090", "--fit", "off"])
    rec = result["recommendation"]
    assert (rec["experiment"], rec["mesh"], rec["quant"]) == ("ddp-ft", {"dp": 2}, "none")
    assert row(result, "fsdp-ft", quant="none")["tokens_per_s"] > row(result, "tp-sp-ft")["tokens_per_s"]
    assert row(result, "tp-sp-ft")["tokens_per_s"] > row(result, "tp-ft")["tokens_per_s"]
    assert all(r["fits"] for r in result["techniques"] if "refused" not in r)
    assert "recommendation: ddp-ft --quant none (dp2)" in capsys.readouterr().out


def test_one_80gb_gpu_gets_the_single_gpu_script_on_a_bf16_base():
    result = main(["--gpus", "1", "--gpu", "h100-sxm", "--json"])
    assert [r["technique"] for r in result["techniques"]] == ["single", "single"]
    rec = result["recommendation"]
    assert (rec["experiment"], rec["quant"]) == ("single-gpu-ft", "none")
    # NF4 costs its dequantization on every pass and saves memory that is not needed here
    assert (
        row(result, "single-gpu-ft", quant="nf4")["step_time_s"]
        > row(result, "single-gpu-ft", quant="none")["step_time_s"]
    )


def test_two_nodes_with_a_model_that_needs_sharding_in_bf16():
    """Qwen3-32B on 2 x 8 H100s over InfiniBand: its bf16 base (65 GB) does not fit an 80 GB GPU with the
    activations, so bf16 DDP is out. QLoRA DDP fits and sends only the LoRA gradients, which the planner prefers
    over any sharded bf16 layout, whose weight traffic crosses the nodes, at the reference layout (--fit off; at --fit
    auto's, 4-bit FSDP leads: blogs/fsdp-tp.md, tests/test_post_advice.py)."""
    args = ["--model", "Qwen/Qwen3-32B", "--gpus", "16", "--nodes", "2", "--link", "nvlink4", "--fit", "off"]
    result = main([*args, "--inter-node-link", "ib-ndr", "--batch-size", "64", "--json"])
    assert not row(result, "ddp-ft", quant="none")["fits"]
    assert not row(result, "single-gpu-ft", quant="none")["fits"]
    rec = result["recommendation"]
    assert (rec["experiment"], rec["mesh"], rec["quant"]) == ("ddp-ft", {"dp": 16}, "nf4")
    meshes = [r["mesh"] for r in result["techniques"] if r["technique"] == "fsdp-tp"]
    assert meshes == [{"dp": 8, "tp": 2}, {"dp": 4, "tp": 4}, {"dp": 2, "tp": 8}]
    # TP inside a node: its collectives on NVLink, cheaper than fsdp-ft's weight gathers across the nodes
    best_2d = max((r for r in result["techniques"] if r["technique"] == "fsdp-tp"), key=lambda r: r["tokens_per_s"])
    assert best_2d["tokens_per_s"] > row(result, "fsdp-ft", quant="none")["tokens_per_s"]


def test_fsdp_ft_is_planned_on_a_4bit_base_too():
    """fsdp-ft --quant nf4: the packed 4-bit codes sharded (the quantization constants whole on every rank), so
    less memory per GPU than QLoRA DDP and than bf16 FSDP; it gathers 0.5 B per projection weight where bf16 FSDP
    gathers 2, and pays NF4's dequantization on every pass as ddp-ft --quant nf4 does (each at the same layout,
    --fit off). Its label is the command."""
    result = main(["--gpus", "2", "--gpu", "rtx4090", "--fit", "off", "--json"])
    fsdp_nf4, fsdp_bf16 = row(result, "fsdp-ft", quant="nf4"), row(result, "fsdp-ft", quant="none")
    ddp_nf4 = row(result, "ddp-ft", quant="nf4")
    assert (fsdp_nf4["technique"], fsdp_nf4["mesh"]) == ("fsdp", {"dp": 2})
    assert (
        recommendation.label(fsdp_nf4) == "fsdp-ft --quant nf4 (dp2)"
        and recommendation.label(fsdp_bf16) == "fsdp-ft (dp2)"
    )
    assert fsdp_nf4["memory_bytes"] < ddp_nf4["memory_bytes"] and fsdp_nf4["memory_bytes"] < fsdp_bf16["memory_bytes"]
    assert fsdp_nf4["compute_s"] == ddp_nf4["compute_s"] > fsdp_bf16["compute_s"]  # the dequantization
    assert 0 < fsdp_nf4["exposed_comm_s"] < fsdp_bf16["exposed_comm_s"]
    experiments = [(r["experiment"], r["quant"]) for r in result["techniques"]]
    assert experiments[2:6] == [("ddp-ft", "nf4"), ("ddp-ft", "none"), ("fsdp-ft", "nf4"), ("fsdp-ft", "none")]
    # The host model prices its micro-batches with the 4-bit step's op counts, as for ddp-ft --quant nf4, eager: the
    # script runs its layers eager on a 4-bit base (cli.eager_because), where ddp-ft compiles them.
    hosted = main(["--gpus", "2", "--host", "h100-vm", "--layout", "packed", "--no-compile", "--fit", "off", "--json"])
    fsdp_nf4, ddp_nf4 = row(hosted, "fsdp-ft", quant="nf4"), row(hosted, "ddp-ft", quant="nf4")
    assert fsdp_nf4["host_ops_per_micro_batch"] == ddp_nf4["host_ops_per_micro_batch"]
    assert fsdp_nf4["host_s"] == ddp_nf4["host_s"] > row(hosted, "fsdp-ft", quant="none")["host_s"]
    default = main(["--gpus", "2", "--host", "h100-vm", "--fit", "off", "--json"])
    assert not row(default, "fsdp-ft", quant="nf4")["compiled"] and row(default, "ddp-ft", quant="nf4")["compiled"]
    assert row(default, "fsdp-ft", quant="nf4")["host_ops_per_micro_batch"] == fsdp_nf4["host_ops_per_micro_batch"]


def test_a_job_that_fits_nowhere_says_what_to_change():
    result = main(["--model", "Qwen/Qwen3-32B", "--gpus", "1", "--gpu", "rtx4090", "--max-length", "8192"])
    rec = result["recommendation"]
    assert rec["technique"] is None
    assert "nothing fits in 23.6 GiB" in rec["reason"] and "--max-length" in rec["reason"]


def test_gpus_must_split_evenly_over_nodes(capsys):
    with pytest.raises(SystemExit):
        main(["--gpus", "3", "--nodes", "2"])
    assert "--gpus 3 must be a positive multiple of --nodes 2" in capsys.readouterr().err


def test_ftkits_readme_shows_what_the_planner_prints(capsys):
    readme = (Path(__file__).resolve().parents[1] / "ftkit" / "README.md").read_text()
    command = "uv run python -m ftkit.plan --model Qwen/Qwen3-4B --gpus 2 --gpu rtx4090"
    shown = readme.split(f"```bash\n{command}\n```\n\n```\n", 1)[1].split("```", 1)[0]
    main(command.split()[5:])
    assert capsys.readouterr().out == shown


def test_the_tp_sp_posts_throughput_table_is_what_the_planner_predicts(capsys):
    post = (Path(__file__).resolve().parents[1] / "blogs" / "tp-sp.md").read_text()
    rows = re.findall(r"^\| [^|]*\(`(--gpu [^`]+)`\) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|$", post, re.M)
    assert len(rows) == 4
    for flags, *shown in rows:
        result = main(["--gpus", "2", *flags.split(), "--fit", "off", "--json"])  # at the reference layout
        columns = [row(result, "ddp-ft", quant="none"), row(result, "fsdp-ft", quant="none"), row(result, "tp-sp-ft")]
        predicted = [f"{r['tokens_per_s']:,.0f}" for r in [*columns, row(result, "tp-ft")]]
        assert predicted == shown, flags
    capsys.readouterr()


def test_the_fsdp_tp_posts_layout_table_is_what_the_planner_predicts(capsys):
    post = (Path(__file__).resolve().parents[1] / "blogs" / "fsdp-tp.md").read_text()
    rows = re.findall(r"^\| `([\w-]+)(?: --quant (\w+))?`, ([^|]+?) \| ([\d.]+) GiB \| ([\d,]+) \|$", post, re.M)
    assert len(rows) == 5
    args = ["--model", "Qwen/Qwen3-32B", "--gpus", "16", "--nodes", "2", "--batch-size", "64", "--fit", "off", "--json"]
    result = main(args)  # at the reference layout
    capsys.readouterr()
    for experiment, quant, layout, gib, tokens in rows:
        mesh = re.search(r"mesh (\d+) x (\d+)", layout)
        match = {"mesh": {"dp": int(mesh[1]), "tp": int(mesh[2])}} if mesh else {}
        r = row(result, experiment, quant=quant or "none", **match)
        assert (f"{r['required_bytes'] / 2**30:.1f}", f"{r['tokens_per_s']:,.0f}") == (gib, tokens), layout


@pytest.mark.parametrize("run", ["cpu-mesh-2x1", "cpu-mesh-2x2"])
def test_fsdp_tp_reduce_scatters_priced_at_the_bytes_the_committed_runs_sent(run):
    """Under TP one LoRA half of each projection is whole on every rank: the gradients FSDP reduce-scatters shrink
    to 0.72x at TP 2 on the tiny model, not 0.5x."""
    s = json.loads((ROOT / "devlogs" / "runs" / "fsdp-tp-ft" / run / "summary.json").read_text())
    tiny = memory.ModelShape.from_config({**models.TINY_CONFIG, "vocab_size": models.TINY_VOCAB})
    sent = s["comm"]["reduce_scatter"]["bytes"] / s["steps_run"]
    assert timing.adapter_grad_bytes(tiny, s["config"]["lora_rank"], s["mesh"]["tp"]) == sent


def test_the_pp_devlogs_case_table_is_what_the_planner_predicts(capsys):
    """devlogs/pp-ft.md's cases on RTX 4090s: each row's pick and its tokens/s, and what becomes of pp-ft."""
    devlog = (ROOT / "devlogs" / "pp-ft.md").read_text()
    pattern = r"^\| (4B|14B|32B), (\d+)(?: on (\d+) nodes)? \| (-|`[^`]+`) \| `([^`]+)`, ([\d,]+) \| ([^|]+) \|$"
    rows = re.findall(pattern, devlog, re.M)
    assert len(rows) == 10
    for size, gpus, nodes, flags, pick, tokens, pp in rows:
        argv = [
            "--model",
            f"Qwen/Qwen3-{size}",
            "--gpus",
            gpus,
            "--gpu",
            "rtx4090",
            *(["--nodes", nodes] * bool(nodes)),
        ]
        result = main([*argv, *(flags.strip("`").split() if flags != "-" else []), "--json"])
        rec = result["recommendation"]
        picked = next(r for r in result["techniques"] if all(r[k] == rec[k] for k in ("experiment", "mesh", "quant")))
        assert (recommendation.label(rec), f"{picked['tokens_per_s']:,.0f}") == (pick, tokens), argv
        pp_row = row(result, "pp-ft")
        said = pp.strip()
        if said.startswith("refused"):
            assert "loads the whole bf16 base" in pp_row["refused"], argv
        else:
            assert pp_row["fits"] and f"{pp_row['tokens_per_s']:,.0f}" == said, argv
    capsys.readouterr()


def test_fsdp_all_gathers_priced_at_the_bytes_the_fake_tensor_run_sent():
    """fsdp-ft at Qwen3-4B's shape (devlogs/runs/realscale/fsdp-world2.json): per micro-batch every layer twice with
    its bf16 adapters, the embedding and final norm once, to the byte."""
    r = json.loads((ROOT / "devlogs" / "runs" / "realscale" / "fsdp-world2.json").read_text())
    c = r["config"]
    assert (c["model"], c["layers"], c["quant"], c["lora_rank"]) == ("qwen3-4b-shape", 36, "none", 16)
    per_micro = r["collective_bytes"]["all_gather"] / c["micro_steps_run"]
    shape = memory.ModelShape.from_config(vars(settings.model_config("Qwen/Qwen3-4B")))
    assert timing.fsdp_gather_bytes(shape, c["lora_rank"], "none") == per_micro


@pytest.mark.parametrize("argv", [["--gpus", "2", "--gpu", "rtx4090"], ["--gpus", "1"]])
def test_the_pinned_recommendations_hold_with_the_h100_runs_host(argv, capsys):
    """devlogs/single-gpu-ft.md measured 4.8% MFU where the planner assumes 40%, and the step was bound by its host:
    with that host modelled (--host h100-vm) the one-node picks hold. (Qwen3-32B across nodes becomes fsdp-tp-ft with
    it, as blogs/fsdp-tp.md says: tests/test_post_advice.py.)"""
    assumed, hosted = (main([*argv, "--json", *host])["recommendation"] for host in ([], ["--host", "h100-vm"]))
    capsys.readouterr()
    assert (hosted["experiment"], hosted["mesh"], hosted["quant"]) == (
        assumed["experiment"],
        assumed["mesh"],
        assumed["quant"],
    )


def test_packed_rows_leave_data_parallel_ranks_uneven():
    """The scripts' packed rows go round the ranks fullest first (batching.GlobalBatches), every rank as many
    micro-steps: on 2 GPUs DDP's rank 0 computes more than half the rows' work, where TP splits every row. At a slow
    enough GPU (--mfu 0.048, the H100 runs' MFU taken as the kernels') that outweighs TP's all-reduces on a
    peer-to-peer PCIe link; not through host memory, the GeForce cards' own link (each at the reference layout)."""
    argv = ["--gpus", "2", "--gpu", "rtx4090", "--fit", "off", "--json"]
    result = main(argv)
    ddp, tp = row(result, "ddp-ft", quant="none"), row(result, "tp-ft")
    assert ddp["compute_s"] > 1.1 * tp["compute_s"]  # tp-ft's compute_s is the whole step's over 2 GPUs
    slow = main([*argv, "--mfu", "0.048", "--link", "pcie4"])["recommendation"]
    assert (slow["experiment"], slow["mesh"]) == ("tp-ft", {"tp": 2})
    through_host = main([*argv, "--mfu", "0.048"])["recommendation"]
    assert (through_host["experiment"], through_host["quant"]) == ("ddp-ft", "none")


def test_the_readmes_memory_requirement_is_the_planners(capsys):
    result = main(["--gpus", "1", "--fit", "off", "--json"])  # the reference configuration's
    capsys.readouterr()
    nf4, bf16 = row(result, "single-gpu-ft", quant="nf4"), row(result, "single-gpu-ft", quant="none")
    gib = [f"{r[k] / 2**30:.1f}" for k in ("memory_bytes", "required_bytes") for r in (nf4, bf16)]
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    expected = (
        f"the memory model predicts {gib[0]} GiB for QLoRA on Qwen3-4B and {gib[1]} GiB for bf16 LoRA, {gib[2]} and "
        f"{gib[3]} GiB with the planner's margin"
    )
    assert expected in readme


# ---------------------------------------------------------------------------------------------------- the host
# Issue 30: the planner's host term, calibrated on the committed H100 files, against the committed H100 runs.

ROOT = Path(__file__).resolve().parents[1]
GPU_RUNS = ROOT / "devlogs" / "runs" / "single-gpu-ft"
GPU_FILES = ROOT / "devlogs" / "runs" / "single-gpu-ft-gpu"
HOST_OPS = json.loads((ROOT / "devlogs" / "runs" / "plan-host" / "host-ops.json").read_text())
# The committed H100 runs: the first session's code (adapters in fp32) and the second's (bf16), both eager and padded
# with the padding mask passed (the planner's "masked" layout).
H100_RUNS = {
    "gpu-4b-shape-lora-bf16": "h100-session2",
    "gpu-4b-shape-qlora-nf4": "h100-session2",
    "gpu-4b-shape-lora-bf16-fp32-adapters": "h100-session1",
    "gpu-4b-shape-qlora-nf4-fp32-adapters": "h100-session1",
}


# SDPA's CUDA kernels (cuDNN's on the H100) and the CPU's, which the count ran
CPU_NAME = {
    "aten::_cudnn_attention_forward": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_cudnn_attention_backward": "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}


def metrics_rows(run: str) -> list[dict]:
    return [json.loads(line) for line in (GPU_RUNS / run / "metrics.jsonl").read_text().splitlines()]


def h100_prediction(run: str) -> tuple[list[dict], dict]:
    """The planner's per-step prediction for a committed H100 run (its flags, its steps' batches, its code's op
    counts, the calibrated host), and the run's summary."""
    summary = json.loads((GPU_RUNS / run / "summary.json").read_text())
    c = summary["config"]
    s = setting(
        gpus=1,
        **settings.run_flags(c),
        layout="masked",
        host="h100-vm",
        steps=summary["steps_run"],
        ops_source=H100_RUNS[run],
        tokenizer="tiny",  # what those runs tokenized (qwen3-4b-shape's before issue 42)
    )
    steps = [timing.step_time(s, "single", {}, c["quant"], st) for st in layouts.layout_steps(s, 1)]
    return steps, summary


def test_the_ami_lengths_give_the_h100_runs_batches_step_by_step():
    """ftkit/ami_lengths-tiny.json (the tiny tokenizer's counts, which those runs tokenized) through
    batching.GlobalBatches gives each committed run's global batches: the real tokens of every step are the ones its
    metrics.jsonl recorded."""
    for run in H100_RUNS:
        steps, _ = h100_prediction(run)
        assert [p["tokens"] for p in steps] == [r["tokens"] for r in metrics_rows(run)], run


def test_the_host_calibration_is_the_committed_h100_files():
    """Every calibration constant of ftkit/plan/hosts.py, read back from the file it comes from."""
    # step 2 of the bf16 LoRA run, unprofiled, and the profile of the same batch
    step2 = metrics_rows(hosts.H100_STEP2["run"])[hosts.H100_STEP2["step"] - 1]
    assert hosts.H100_STEP2["seconds"] == step2["step_time_s"]
    profile = (GPU_FILES / "profile-lora-bf16-step2-ops.txt").read_text()
    assert f"Self CUDA time total: {hosts.H100_STEP2['gpu_busy_s']}s" in profile
    assert json.loads((GPU_RUNS / hosts.H100_STEP2["run"] / "summary.json").read_text())["peak_flops"] == (
        hosts.H100_PEAK_FLOPS
    )
    # the op counts (devlogs/runs/plan-host/host-ops.json), and the profiles' counts beside them: the ops a profile
    # lists come out equal, but for the step's own copy_ and add_ (PROFILE_RESIDUAL_PER_STEP)
    for counted in HOST_OPS["h100"]:
        key = (counted["source"], counted["quant"])
        assert counted["first"]["aten_ops"] == counted["later"]["aten_ops"] == hosts.H100_OPS_PER_MICRO[key]
        assert hosts.H100_OPS_PER_STEP[counted["source"]] == (
            counted["step"]["aten_ops"] + hosts.PROFILE_RESIDUAL_PER_STEP
        )
    for source, name in (
        ("h100-session1", "profile-lora-bf16-fp32-adapters-step2-ops.txt"),
        ("h100-session2", "profile-lora-bf16-step2-ops.txt"),
    ):
        counted = next(c for c in HOST_OPS["h100"] if c["source"] == source and c["quant"] == "none")
        residual = {}
        for line in (GPU_FILES / name).read_text().splitlines():
            cells = re.split(r"\s{2,}", line.strip())
            if cells[0].startswith("aten::") and cells[-1].isdigit():
                op = CPU_NAME.get(cells[0], cells[0])
                by_step = sum(
                    n * counted[part]["by_name"].get(op, 0) for part, n in (("first", 1), ("later", 7), ("step", 1))
                )
                residual[op] = int(cells[-1]) - by_step
        assert residual.pop("aten::copy_") + residual.pop("aten::add_") == hosts.PROFILE_RESIDUAL_PER_STEP, source
        assert set(residual.values()) == {0}, (source, residual)  # mm, mul, add, dropout, attention: equal
    # seconds per op and the kernels' fraction of the peak
    ops = 8 * hosts.H100_OPS_PER_MICRO["h100-session2", "none"] + hosts.H100_OPS_PER_STEP["h100-session2"]
    host = hosts.HOSTS["h100-vm"]
    assert host["op_s"] == pytest.approx(step2["step_time_s"] / ops, rel=1e-12)
    s = setting(gpus=1, layout="masked", steps=2, tokenizer="tiny")
    step = layouts.layout_steps(s, 1)[1]
    assert (step.tokens, step.positions, len(step.micros)) == (28298, 28584, 8)
    assert sum(timing.micro_flops(s, m) for m in step.micros) == hosts.H100_STEP2_FLOPS
    assert host["kernel_mfu"] == pytest.approx(hosts.H100_STEP2_FLOPS / (3.386 * 989e12), rel=1e-12)
    # the first session's medians over steps 2-10, from which NF4_PASS_S comes
    for run, median in hosts.H100_SESSION1_MEDIANS.items():
        assert median == statistics.median(r["step_time_s"] for r in metrics_rows(run)[1:10])
    # the per-layer counts of this tree's step
    for key, (base, per_layer) in hosts.HOST_OPS.items():
        layout, quant, checkpointing, compiled = key
        at = {
            c["layers"]: c["later"]["aten_ops"] + c["later"]["compiled_kernels"]
            for c in HOST_OPS["tree"]
            if (c["layout"], c["quant"], c["grad_checkpointing"], c["compile"]) == key
        }
        assert (base + 2 * per_layer, base + 3 * per_layer) == (at[2], at[3]), key
    per_step = {c["layers"]: c["step"]["aten_ops"] for c in HOST_OPS["tree"]}
    assert (
        hosts.HOST_OPS_PER_STEP[0] + 2 * hosts.HOST_OPS_PER_STEP[1],
        sum(hosts.HOST_OPS_PER_STEP) + 2 * hosts.HOST_OPS_PER_STEP[1],
    ) == (per_step[2], per_step[3])
    assert hosts.HOST_OPS_PER_STEP[0] + 36 * hosts.HOST_OPS_PER_STEP[1] == HOST_OPS["h100"][0]["step"]["aten_ops"]


@pytest.mark.parametrize("run", list(H100_RUNS))
def test_the_planner_reproduces_the_committed_h100_runs_median_step_time(run):
    """issue 30's bar: the eager padded H100 runs' median step time (the summary's: steps 2 on) within 25%, from the
    calibrated host (seconds per op, the 4-bit pass's extra), each run's code's op count and its own batches."""
    steps, summary = h100_prediction(run)
    predicted = statistics.median(p["step_time_s"] for p in steps[1:])
    assert predicted == pytest.approx(summary["median_step_time_s"], rel=0.25), (predicted, run)
    assert all(p["step_time_s"] > 1.2 * p["compute_s"] for p in steps)  # host-bound, every step


# Issue 43: the second host, the committed H200 runs' (bf16 LoRA, single-gpu-ft, eager, 6 steps, tree 953b11d: no
# padding mask passed, so this tree's op counts), padded (--no-packing) and packed.
H200_RUNS = ROOT / "devlogs" / "runs" / "gpu-session-2026-11-26-gpu" / "b1-lora-h200-2"
H200_LAYOUTS = {"lora-padded-eager": "padded", "lora-packed-eager": "packed"}


def h200_prediction(run: str) -> tuple[list[dict], dict]:
    """The planner's per-step prediction for a committed H200 run, from the flags `python -m ftkit.plan` takes for it
    (its recorded configuration, its layout, the h200-vm host, the tiny tokenizer it tokenized with, its steps), and
    the run's summary."""
    from ftkit.plan.__main__ import parser, setting_from

    summary = json.loads((H200_RUNS / run / "summary.json").read_text())
    c = summary["config"]
    assert (c["quant"], c["dtype"], c["compile"], c["packing"]) == (
        "none",
        "bf16",
        False,
        H200_LAYOUTS[run] == "packed",
    )
    argv = ["--gpu", "h200", "--gpus", "1", "--host", "h200-vm", "--layout", H200_LAYOUTS[run], "--tokenizer", "tiny"]
    argv += ["--no-compile"]  # the runs' layers ran eager (their config's compile, above)
    argv += ["--seed", str(c["seed"]), "--steps", str(summary["steps_run"]), "--batch-size", str(c["batch_size"])]
    argv += ["--micro-batch-size", str(c["micro_batch_size"]), "--max-length", str(c["max_length"])]
    argv += ["--lora-rank", str(c["lora_rank"]), "--checkpointing", "all" if c["grad_checkpointing"] else "none"]
    p = parser()
    s = setting_from(p, p.parse_args(argv))
    steps = [timing.step_time(s, "single", {}, c["quant"], st) for st in layouts.layout_steps(s, 1)]
    rows = [json.loads(line) for line in (H200_RUNS / run / "metrics.jsonl").read_text().splitlines()]
    assert [(p["tokens"], len(p["micros"])) for p in steps] == [(r["tokens"], r["micro_batches"]) for r in rows]
    return steps, summary


def test_the_h200_host_calibration_is_the_committed_h200_files():
    """HOSTS["h200-vm"], read back from the committed H200 runs: the step times it takes, the code they ran (no
    padding mask: this tree's op counts), and its seconds per op; its kernels the H100 profile's (assumed)."""
    run = ROOT / "devlogs" / "runs" / hosts.H200_RUN
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["hardware"]["gpu"] == "NVIDIA H200" and summary["versions"]["torch"] == "2.11.0"
    assert "953b11d" in (run.parent / "env.txt").read_text()
    for step, seconds in hosts.H200_HOST_STEPS.items():
        assert rows[step - 1]["step_time_s"] == seconds and rows[step - 1]["micro_batches"] == 8
    fewest = sorted(rows[1:], key=lambda r: r["tokens"])[:2]  # steps 2-6: the two of fewest real tokens
    assert sorted(r["step"] for r in fewest) == sorted(hosts.H200_HOST_STEPS)
    ops = 8 * (191 + 36 * 1430) + (24 + 36 * 98 + 673)
    assert ops == 417593 == hosts._H200_STEP_OPS
    host = hosts.HOSTS["h200-vm"]
    assert host["op_s"] == pytest.approx((4.084021240234375 + 3.79883251953125) / 2 / ops, rel=1e-12)
    assert host["op_s"] * 1e6 == pytest.approx(9.44, abs=0.005)
    assert host["kernel_mfu"] == hosts.HOSTS["h100-vm"]["kernel_mfu"]
    # the steps it takes are host-bound: the GPU's predicted share well under half of each
    steps, _ = h200_prediction("lora-padded-eager")
    assert all(steps[step - 1]["compute_s"] < 0.4 * seconds for step, seconds in hosts.H200_HOST_STEPS.items())


@pytest.mark.parametrize("run", list(H200_LAYOUTS))
def test_the_planner_reproduces_the_committed_h200_runs_median_step_time(run):
    """The H200 runs' median step time (the summary's: steps 2-6) within 25%, from the h200-vm host: the padded run
    it was calibrated on (other steps of), and the packed run it was not (4 and 8 micro-batches a step)."""
    steps, summary = h200_prediction(run)
    predicted = statistics.median(p["step_time_s"] for p in steps[1:])
    assert predicted == pytest.approx(summary["median_step_time_s"], rel=0.25), (predicted, run)
    assert all(p["step_time_s"] >= p["compute_s"] for p in steps)  # the host at least as slow: the full steps tie


def test_the_hosts_are_the_planners_choices(capsys):
    """--host takes every calibrated host; the H200's says where its numbers come from."""
    main(["--gpus", "1", "--gpu", "h200", "--host", "h200-vm", "--layout", "padded", "--steps", "2"])
    out = capsys.readouterr().out
    assert "9.44 us per op (calibrated: the committed H200 runs' host" in out
    assert "(the H100 profile's eager kernels, assumed: no H200 profile is committed)" in out


def test_packed_and_compiled_steps_are_predicted_faster_and_say_what_they_assume(capsys):
    """On the H100's host, the scripts' packed layout (fewer micro-batches) and then compiled decoder layers (far fewer
    launches per micro-batch) are predicted faster than today's padded eager step, and the output says it is a
    prediction and what it assumes."""
    base = ["--gpus", "1", "--host", "h100-vm", "--fit", "off", "--json"]
    padded, packed, compiled = (
        main([*base, *flags])
        for flags in (["--layout", "padded"], ["--layout", "packed", "--no-compile"], ["--layout", "packed"])
    )
    capsys.readouterr()
    for quant in ("none", "nf4"):
        p, k, c = (row(result, "single-gpu-ft", quant=quant) for result in (padded, packed, compiled))
        assert c["tokens_per_s"] > k["tokens_per_s"] > p["tokens_per_s"], quant
        assert p["bound"] == k["bound"] == "host"
        assert c["micro_batches"] == k["micro_batches"] < p["micro_batches"] == 8
        assert c["host_ops_per_micro_batch"] * 8 < k["host_ops_per_micro_batch"]  # 6,256 against 54,208 (bf16)
        # issue 30's bar: the host's work per 1,000 real tokens, packed compiled at least 10x below padded eager
        assert c["host_ops_per_1000_tokens"] * 10 <= p["host_ops_per_1000_tokens"], quant
        assert c["host_ops_per_1000_tokens"] < k["host_ops_per_1000_tokens"] < p["host_ops_per_1000_tokens"]
        assert c["padding_fraction"] <= 0.05  # rows as wide as their micro-batch's fullest (batching.packed_width)
    for result in (padded, packed, compiled):
        assert result["prediction"][0] == "PREDICTED by ftkit.plan: a model, not a measurement"
    main(["--gpus", "1", "--host", "h100-vm", "--layout", "packed", "--compile"])
    out = capsys.readouterr().out
    for said in (
        "PREDICTED by ftkit.plan: a model, not a measurement",
        "layout: the same global batches packed first-fit decreasing into rows of up to 2048",
        "compiled layers: the compiled graphs' kernels",
        "a prediction",
        "us per op (calibrated: the committed H100 runs' host",
        "per 4-bit linear pass (calibrated on the first H100 session's QLoRA and LoRA runs; not attributed)",
        "of the dense bf16 peak (calibrated on the same profile, eager kernels); compiled kernels taken as no faster",
    ):
        assert said in out, said


def test_micro_batches_by_tokens_are_predicted_faster_in_fewer_micro_steps_with_more_memory(capsys):
    """--micro-batch-tokens 16384 on one H100 (its host, compiled, packed): about one micro-step per step where 2
    rows of 2048 take several, so less host time per token; its activations cost more memory; attention is counted per
    example (the varlen kernel), not over the 16,384-position row."""
    base = ["--gpus", "1", "--host", "h100-vm", "--layout", "packed", "--compile", "--fit", "off", "--json"]
    rows, by_tokens = (main([*base, *flags]) for flags in ([], ["--micro-batch-tokens", "16384"]))
    capsys.readouterr()
    r, t = (row(result, "single-gpu-ft", quant="none") for result in (rows, by_tokens))
    assert t["micro_batches"] < r["micro_batches"] and t["tokens_per_s"] > r["tokens_per_s"]
    assert t["memory_bytes"] > r["memory_bytes"] and t["compute_s"] < 1.2 * r["compute_s"]
    with pytest.raises(SystemExit):
        main(["--gpus", "1", "--layout", "padded", "--micro-batch-tokens", "16384"])


def test_the_commands_default_compiles_the_layers_the_scripts_compile():
    """On CUDA the scripts compile their decoder layers by default, but tp-sp-ft, cp-ft and fsdp-ft on a 4-bit base
    run them eager whatever --compile says (cli.layers_compiled): the planner's host prices each row so. --compile
    is the same; --no-compile prices every row eager, as the committed H100 runs; --layout padded has no compiled
    count, so its default is eager."""
    base = ["--gpus", "2", "--host", "h100-vm", "--json"]
    result = main(base)
    compiled = {(r["experiment"], r["quant"]): r["compiled"] for r in result["techniques"] if "refused" not in r}
    eager = {("tp-sp-ft", "none"), ("fsdp-ft", "nf4")}
    assert {k for k, c in compiled.items() if not c} == eager and len(compiled) == 9
    assert main([*base, "--compile"])["techniques"] == result["techniques"]
    assert not any(r.get("compiled", False) for r in main([*base, "--no-compile"])["techniques"])
    assert not any(r.get("compiled", False) for r in main([*base, "--layout", "padded", "--steps", "2"])["techniques"])


def test_compile_needs_one_shape_per_micro_batch(capsys):
    with pytest.raises(SystemExit):
        main(["--gpus", "1", "--layout", "padded", "--compile"])
    assert "counts the compiled layers' launches on packed rows" in capsys.readouterr().err


def test_without_a_host_the_planner_is_the_gpu_only_model_it_was():
    """--host left out and full-length rows (--layout full, or auto beyond AMI's longest example): no host term, the
    assumed 40%, and the rows as before issue 30; --mfu 0.4 given is the same setting."""
    result = main(["--gpus", "2", "--layout", "full", "--json"])
    assert "prediction" not in result and result["assumptions"]["mfu"] == 0.4
    assert all("host_s" not in r for r in result["techniques"])
    assert main(["--gpus", "2", "--layout", "full", "--json", "--mfu", "0.4"])["techniques"] == result["techniques"]
    beyond = ["--gpus", "2", "--max-length", str(layouts.longest() + 1), "--micro-batch-size", "1", "--json"]
    assert main(beyond)["techniques"] == main([*beyond, "--layout", "full"])["techniques"]


def test_the_commands_default_layout_is_the_scripts():
    """--layout auto (the default): the scripts' packed rows where AMI's examples reach --max-length (pp-ft's own
    aside: below), full rows beyond the longest of them (20,632 of Qwen3's tokens)."""
    assert layouts.longest() == 20632

    def packed_ones(argv: list[str]) -> list[dict]:
        return [r for r in main(argv)["techniques"] if r["technique"] != "pp"]

    base = ["--gpus", "2", "--json"]
    assert packed_ones(base) == packed_ones([*base, "--layout", "packed"])
    at = ["--gpus", "2", "--max-length", str(layouts.longest()), "--micro-batch-size", "1", "--steps", "2", "--json"]
    assert packed_ones(at) == packed_ones([*at, "--layout", "packed"])
    assert main(base)["prediction"][1].startswith("layout: the scripts' own (--layout auto): the same global batches")


def test_the_single_gpu_devlog_states_the_planners_host_work_per_1000_tokens(capsys):
    """devlogs/single-gpu-ft.md's table of the host's work per 1,000 real tokens (ops dispatched eager, kernels and
    ops launched compiled) at the reference configuration on the H100's host: the planner's numbers."""
    devlog = (ROOT / "devlogs" / "single-gpu-ft.md").read_text()
    base = ["--gpus", "1", "--host", "h100-vm", "--fit", "off", "--json"]
    for name, flags in (
        ("padded, eager", ["--layout", "padded"]),
        ("packed, eager", ["--layout", "packed", "--no-compile"]),
        ("packed, compiled", ["--layout", "packed"]),
    ):
        result = main([*base, *flags])
        per = [f"{row(result, 'single-gpu-ft', quant=q)['host_ops_per_1000_tokens']:,.0f}" for q in ("none", "nf4")]
        assert re.search(rf"^\| {name}[^|]* \| {per[0]} \| {per[1]} \|$", devlog, re.M), (name, per)
    capsys.readouterr()


def test_the_devlogs_host_tables_are_what_the_planner_gives():
    """devlogs/plan-cpu-check.md's two tables (the H100 runs against the planner, and its predictions) are
    `assets/host_ops.py --tables` as the committed files and ftkit/plan/ give them today."""
    import runpy

    tables = runpy.run_path(str(ROOT / "assets" / "host_ops.py"))["host_tables"]()
    devlog = (ROOT / "devlogs" / "plan-cpu-check.md").read_text()
    assert devlog.split("<!-- host-tables:begin -->\n", 1)[1].split("<!-- host-tables:end -->", 1)[0] == tables


def test_the_docs_predictions_on_the_ami_layouts_are_the_planners_in_qwen3s_tokens(capsys):
    """What the devlogs, ftkit's README and the README say the planner predicts on the AMI layouts (the examples in
    Qwen3's tokens, and where they compare, the tiny tokenizer's, which the planner counted before issue 42)."""
    import runpy

    from ftkit.memory import GIB

    h100 = runpy.run_path(str(ROOT / "assets" / "host_ops.py"))["h100_setting"]

    def single(**kw) -> dict:
        return techniques.evaluate(h100(**kw), "single", {}, "none")

    def planned(*flags: str) -> dict:
        return row(main([*flags, "--host", "h100-vm", "--layout", "packed", "--compile", "--fit", "off", "--json"]),
                   "single-gpu-ft", quant="none")  # fmt: skip

    def says(page: str, *quoted: str) -> None:
        text = " ".join((ROOT / page).read_text().split())
        for q in quoted:
            assert q in text, (page, q)

    padded, packed = single(layout="padded"), single(layout="packed")
    compiled, at40 = single(layout="packed", compile=True), single(layout="packed", compile=True, mfu=0.4)
    before = {k: single(layout=k, compile=k == "packed", tokenizer="tiny") for k in ("padded", "packed")}
    mean = statistics.mean(len(step.micros) for step in layouts.layout_steps(h100(layout="packed"), 1))
    tps = [f"{r['tokens_per_s']:,.0f}" for r in (padded, packed, compiled, at40)]
    ops = [f"{r['host_ops_per_1000_tokens']:,.0f}" for r in (padded, packed, compiled)]
    says(
        "devlogs/plan-cpu-check.md",
        f"(8 to 4; mean {mean:.1f})",
        f"leave {packed['padding_fraction']:.1%}, against {padded['padding_fraction']:.1%} padded",
        f"{packed['tokens_per_s'] / padded['tokens_per_s']:.2f}x the padded tokens/s",
        f"{compiled['tokens_per_s'] / padded['tokens_per_s']:.1f}x the padded eager tokens/s",
        f"{ops[0]} ops padded eager, {ops[1]} packed eager and launches {ops[2]} packed compiled",
        f"at an assumed 40% the same step gives {tps[3]} tokens/s",
    )
    moved = [
        f"{before[k]['tokens_per_s']:,.0f} to {r['tokens_per_s']:,.0f}"
        for k, r in (("packed", compiled), ("padded", padded))
    ]
    says(
        "devlogs/single-gpu-ft.md",
        f"padded eager today {tps[0]} tokens/s, packed eager {tps[1]} (host-bound",
        f"packed with compiled layers {tps[2]} (GPU-bound at the eager kernels' 20.7%; {tps[3]} at an assumed 40%)",
        f"moved from {moved[0]} tokens/s and padded eager from {moved[1]} (predictions)",
    )
    says("ftkit/README.md", f"{tps[0]} tokens/s padded eager, {tps[1]} packed eager and {tps[2]} packed and compiled")
    # the micro-batch sizes on a 24 GB card, in both tokenizers' tokens
    card = ["--gpus", "1", "--gpu", "rtx4090"]
    q, t = (
        [
            f"{planned(*card, '--micro-batch-size', str(m), '--tokenizer', tok)['tokens_per_s']:,.0f}"
            for m in (1, 2, 4, 8)
        ]
        for tok in ("qwen3", "tiny")
    )
    says(
        "devlogs/single-gpu-ft.md",
        f"{q[0]}, {q[1]}, {q[2]} and {q[3]} tokens/s (the AMI examples in Qwen3's tokens; {t[0]}, {t[1]}, {t[2]} and "
        f"{t[3]} in the tiny tokenizer's",
    )
    # the README's alternative --max-length
    at = {n: planned("--gpus", "1", "--max-length", str(n)) for n in (2048, 4096)}
    need = [f"{at[n]['required_bytes'] / GIB:.1f}" for n in (4096, 2048)]
    says(
        "README.md",
        f"at {need[0]} GiB with its margin instead of {need[1]}, and {at[4096]['tokens_per_s']:,.0f} tokens/s instead "
        f"of {at[2048]['tokens_per_s']:,.0f}",
    )
    capsys.readouterr()


def test_checkpointing_every_other_layer_lies_between_all_and_none_in_memory_and_time():
    """--checkpointing every-2 (Setting.checkpoint_every 2): half the layers recomputed, so less memory than none and
    a shorter step than all; on the calibrated host, compiled or eager, the host's ops per micro-batch between the two
    rows of HOST_OPS (compiled without checkpointing a prediction: hosts.host_ops_per_micro)."""
    for extra in ({}, {"host": "h100-vm", "layout": "packed", "compile": True, "steps": 2}):
        rows = [
            techniques.evaluate(setting(gpus=1, **extra, **ckpt), "single", {}, "none")
            for ckpt in ({}, {"checkpoint_every": 2}, {"grad_checkpointing": False})
        ]
        every_one, every_two, none = rows
        assert every_one["memory_bytes"] < every_two["memory_bytes"] < none["memory_bytes"]
        assert every_one["step_time_s"] > every_two["step_time_s"] > none["step_time_s"]
    ops = [
        hosts.host_ops_per_micro(setting(layout="packed", compile=compiled, **ckpt), "none", 36)
        for compiled in (False, True)
        for ckpt in ({}, {"checkpoint_every": 2}, {"grad_checkpointing": False})
    ]
    assert ops[0] > ops[1] > ops[2] and ops[3] > ops[4] > ops[5] and ops[0] == 280 + 1498 * 36
    assert settings.run_flags({"checkpointing": "every-3", "grad_checkpointing": True})["checkpoint_every"] == 3


def test_the_link_between_a_nodes_gpus_defaults_to_the_one_the_card_is_built_with():
    """Without --link, a node of PCIe cards is planned over PCIe, not over the NVLink of an SXM board: a reader who
    names only --gpu rtx4090 must not get NVLink's all-reduce times, nor the peer-to-peer PCIe that NVIDIA's driver
    does not give GeForce cards (their collectives go through host memory)."""
    from ftkit.plan.__main__ import parser, setting_from

    p = parser()
    expected = {"h100-sxm": "nvlink4", "h200": "nvlink4", "a100-40gb": "nvlink3", "h100-pcie": "pcie5"}
    expected |= {"rtx4090": "pcie4-host", "rtx3090": "pcie4-host", "l40s": "pcie4", "a100-80gb-pcie": "pcie4"}
    for gpu, link in expected.items():
        assert setting_from(p, p.parse_args(["--gpus", "2", "--gpu", gpu])).link.key == link, gpu
    chosen = setting_from(p, p.parse_args(["--gpus", "2", "--gpu", "rtx4090", "--link", "nvlink3"]))
    assert chosen.link.key == "nvlink3"


def test_a_group_across_nodes_is_bound_by_its_slowest_link():
    """A data-parallel ring across nodes runs through each node's GPUs and between the nodes. On nodes of RTX 4090s
    the link inside a node (PCIe through host memory, 12.9 GB/s) is slower than InfiniBand NDR between them (50), so
    InfiniBand does not speed up FSDP's gathers; on H100 nodes (NVLink inside) the link between nodes bounds them."""
    argv = ["--model", "Qwen/Qwen3-32B", "--gpus", "16", "--nodes", "2", "--batch-size", "64", "--json"]

    def gathers(gpu: str, between: str) -> float:
        return row(main([*argv, "--gpu", gpu, "--inter-node-link", between]), "fsdp-ft", quant="none")["exposed_comm_s"]

    assert gathers("rtx4090", "ib-ndr") == gathers("rtx4090", "nvlink4") == gathers("rtx4090", "pcie4-host") > 0
    assert gathers("rtx4090", "eth-10g") > gathers("rtx4090", "ib-ndr")  # 10 GbE is slower still
    assert gathers("h100-sxm", "ib-hdr") > gathers("h100-sxm", "ib-ndr")


def test_a_pick_made_because_the_batch_does_not_divide_says_so():
    """16 GPUs at the default global batch of 16: the data-parallel layouts need a multiple of 2 x 16, so they are
    refused for the batch, not the technique, and the recommendation names them (at 32 they are priced)."""
    s = setting(gpus=16, nodes=2, gpu=hardware.gpu("rtx4090"), link=hardware.LINKS["pcie4-host"])
    refused = recommendation.plan(s)
    assert row(refused, "ddp-ft", quant="none")["batch_refused"]
    assert "does not divide over their ranks: ddp-ft, fsdp-ft" in refused["recommendation"]["reason"]
    priced = recommendation.plan(dataclasses.replace(s, batch_size=32))
    assert row(priced, "ddp-ft", quant="none")["fits"] and "not priced" not in priced["recommendation"]["reason"]
    # ...and gives the pick at the next batch that divides: on 3 GPUs at 16 the pick by elimination is one GPU's
    # script or pp-ft, at 18 DDP, predicted more than twice as fast (blogs/pp.md says so).
    # On 9 GPUs pp-ft's 8 micro-batches are fewer than its 9 stages, which torch's 1F1B refuses: so does the planner.
    nine = main(["--gpus", "9", "--gpu", "rtx4090", "--json"])
    assert "fewer than the 9 pipeline stages" in row(nine, "pp-ft")["refused"]
    assert nine["recommendation"]["experiment"] != "pp-ft" and "at --batch-size 18" in nine["recommendation"]["reason"]
    three = main(["--gpus", "3", "--gpu", "rtx4090", "--json"])["recommendation"]
    at_18 = main(["--gpus", "3", "--gpu", "rtx4090", "--batch-size", "18", "--json"])["recommendation"]
    assert three["experiment"] in ("single-gpu-ft", "pp-ft") and at_18["experiment"] == "ddp-ft"
    assert at_18["tokens_per_s"] > 2 * three["tokens_per_s"]
    said = at_18["reason"].split(" tokens/s", 1)[0]
    pick = f"at --batch-size 18 (another global batch: another run) the pick is {recommendation.label(at_18)}, {said}"
    assert pick in three["reason"]


def test_a_tp_or_cp_group_wider_than_a_node_crosses_the_link_between_nodes():
    """TP's and CP's collectives run inside a node while their group fits in one; a group of 8 over nodes of 2 GPUs
    crosses the nodes' link, so its exposed communication grows as that link slows (and not while it fits)."""

    def comm(technique: str, mesh: dict[str, int], nodes: int, between: str) -> float:
        s = setting(gpus=8, nodes=nodes, link=hardware.LINKS["pcie4"], inter_node_link=hardware.LINKS[between])
        return techniques.evaluate(s, technique, mesh, "none")["exposed_comm_s"]

    for technique, mesh in (("tp-sp", {"tp": 8}), ("tp", {"tp": 8}), ("cp", {"dp": 1, "cp": 8})):
        assert comm(technique, mesh, 4, "eth-10g") > 10 * comm(technique, mesh, 4, "ib-ndr"), technique
        assert comm(technique, mesh, 1, "eth-10g") == comm(technique, mesh, 1, "ib-ndr"), technique


def test_the_scripts_that_load_the_whole_model_are_refused_where_it_does_not_fit_one_gpu():
    """pp-ft, tp-ft, tp-sp-ft and fsdp-tp-ft load the whole bf16 base on every GPU before keeping their part: for
    Qwen3-32B on RTX 4090s (61 GiB of bf16 weights) they are refused with that reason, even where a pipeline's
    step would be the fastest (4 nodes of 2 on 10 GbE); on 80 GB H100s they load, and are priced."""
    base = dict(config=settings.model_config("Qwen/Qwen3-32B"), gpus=8, nodes=4, gpu=hardware.gpu("rtx4090"))
    base |= dict(link=hardware.LINKS["pcie4-host"], memory_bytes=hardware.gpu("rtx4090").memory_bytes)
    slow = recommendation.plan(setting(**base, inter_node_link=hardware.LINKS["eth-10g"]))
    for technique in techniques.LOADS_WHOLE_MODEL:
        refused = [r["refused"] for r in slow["techniques"] if r["technique"] == technique]
        assert refused and all("loads the whole bf16 base" in why for why in refused), technique
    assert (slow["recommendation"]["experiment"], slow["recommendation"]["quant"]) == ("fsdp-ft", "nf4")
    h100 = recommendation.plan(setting(config=settings.model_config("Qwen/Qwen3-32B"), gpus=8))
    assert "required_bytes" in row(h100, "pp-ft") and "refused" not in row(h100, "pp-ft")


def test_fsdp_in_4_bits_is_refused_where_the_whole_4_bit_base_does_not_fit_one_gpu():
    """fsdp-ft quantizes a 4-bit base on every GPU before sharding it: Qwen3-32B's (17.9 GiB) does not load on a
    16 GiB card, though its shards would train there; the bf16 base, loaded on rank 0's CPU, is priced."""
    s = setting(config=settings.model_config("Qwen/Qwen3-32B"), gpus=16, nodes=2, memory_bytes=16 * 2**30)
    result = recommendation.plan(dataclasses.replace(s, batch_size=64))
    assert "loads the whole 4-bit base" in row(result, "fsdp-ft", quant="nf4")["refused"]
    assert "refused" not in row(result, "fsdp-ft", quant="none")


def test_pp_ft_is_planned_on_its_own_rows(capsys):
    """pp-ft pads every example to --max-length, the one shape its stages are built for (batching.collate_pipeline):
    by default its row is --layout fixed's, as many positions as full rows compute (about half of them padding at
    2,048), so fewer real tokens/s than full rows; the others' rows are packed."""
    base = ["--gpus", "2", "--gpu", "rtx4090", "--json"]
    auto, fixed, full = (main([*base, *flags]) for flags in ([], ["--layout", "fixed"], ["--layout", "full"]))
    capsys.readouterr()
    assert row(auto, "pp-ft") == row(fixed, "pp-ft")
    assert row(auto, "ddp-ft", quant="none")["padding_fraction"] < 0.1 < 0.4 < row(auto, "pp-ft")["padding_fraction"]
    assert row(auto, "pp-ft")["tokens_per_s"] < 0.6 * row(full, "pp-ft")["tokens_per_s"]
    assert "pp-ft's one example per row, right-padded to --max-length" in auto["prediction"][1]
