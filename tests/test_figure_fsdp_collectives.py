"""assets/fsdp_collectives.py, the figure of blogs/fsdp.md: FSDP2's all-gathers and reduce-scatters along one
micro-batch. The figure is a schematic (FSDP2's order, each unit's bytes from the model's shape); here its numbers
are held to what was recorded: the comm recorder's bytes and counts per step in every committed CPU run of fsdp-ft
(the tiny model, devlogs/runs/fsdp-ft/) and in the fake-tensor runs at Qwen3-4B's shape (devlogs/runs/realscale/),
the unsharded bytes the memory tracker saw there, fsdp-ft's own theory (`comm.fsdp_theory`), and the post's text."""

from __future__ import annotations

import json
import runpy

import pytest
from conftest import ROOT

from ftkit import comm, memory, models

FIGURE = runpy.run_path(str(ROOT / "assets" / "fsdp_collectives.py"))  # not as __main__: nothing written
RUNS = ROOT / "devlogs" / "runs" / "fsdp-ft"
REALSCALE = ROOT / "devlogs" / "runs" / "realscale"
TINY = memory.ModelShape.from_config({**models.TINY_CONFIG, "vocab_size": models.TINY_VOCAB})
BYTES = {"fp32": 4, "bf16": 2}
FSDP_RUNS = sorted(p.name for p in RUNS.iterdir() if (p / "summary.json").exists() and "reference" not in p.name)


def layout(config: dict) -> str:
    if config["wrap_class"] != "Qwen3DecoderLayer":
        return "wrong-wrap"
    return "default" if config["reshard_after_forward"] else "no-reshard"


@pytest.mark.parametrize("run", FSDP_RUNS)
def test_every_cpu_runs_collectives_are_the_figures_micro_batches(run):
    """Every step of every committed fsdp-ft CPU run (2 ranks, tiny model): the all-gathers and reduce-scatters the
    comm recorder saw, bytes and count, are the figure's micro-batches at the tiny model's shape and the run's flags
    (checkpointing or not, the KV cache, prefetch 2, a bf16 base or bf16 adapters, QLoRA's codes: the same rule)."""
    s = json.loads((RUNS / run / "summary.json").read_text())
    c = s["config"]
    unit_args = dict(
        shape=TINY,
        lora_rank=c["lora_rank"],
        param_bytes=BYTES[c["param_dtype"]],
        reduce_bytes=BYTES[c["reduce_dtype"]],
        quant=c.get("quant") or "none",
    )
    rows = [json.loads(line) for line in (RUNS / run / "metrics.jsonl").read_text().splitlines() if line]
    assert len(rows) == s["steps_run"] == 8
    for row in rows:
        micro_steps = row.get("micro_batches", s["accumulation_steps"])
        expected = FIGURE["per_step"](layout(c), micro_steps, **unit_args)
        recorded = {kind: {k: row["comm"][kind][k] for k in ("bytes", "count")} for kind in row["comm"]}
        assert recorded == expected, (run, row["step"])
    units = FIGURE["unit_bytes"](**unit_args)
    largest = units["root"] + units["layers"] * units["layer"] if layout(c) == "wrong-wrap" else units["root"]
    assert s["largest_unit_bytes"] == largest


def test_checkpointing_adds_no_all_gather():
    """The recompute runs after the backward all-gather: with and without checkpointing, the same collectives."""
    with_ckpt, without = ("cpu-smoke-2proc", "cpu-smoke-2proc-no-checkpointing")
    steps = [
        [json.loads(x)["comm"] for x in (RUNS / r / "metrics.jsonl").read_text().splitlines()]
        for r in (with_ckpt, without)
    ]
    strip = [[{k: {f: v[f] for f in ("bytes", "count")} for k, v in step.items()} for step in run] for run in steps]
    assert strip[0] == strip[1]
    for world in (2, 4, 8):
        a, b = (json.loads((REALSCALE / f"fsdp-world{world}{x}.json").read_text()) for x in ("", "-no-checkpointing"))
        assert a["collective_counts"] == b["collective_counts"] and a["collective_bytes"] == b["collective_bytes"]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_qwen3_4b_collectives_are_what_the_fake_tensor_runs_recorded(world):
    """At Qwen3-4B's shape, 2/4/8 ranks (4/2/1 micro-batches a step): the figure's micro-batch, repeated, is what
    fsdp-ft's own step recorded on fake tensors, to the byte and the collective, and what its theory states."""
    run = json.loads((REALSCALE / f"fsdp-world{world}.json").read_text())
    micro_steps = run["config"]["micro_steps_run"]
    assert micro_steps * world == 8  # global batch 16 of micro-batch 2
    expected = FIGURE["per_step"]("default", micro_steps)
    assert {k: v["bytes"] for k, v in expected.items()} == run["collective_bytes"] == run["collective_bytes_theory"]
    assert {k: v["count"] for k, v in expected.items()} == run["collective_counts"]
    n = FIGURE["numbers"]()
    theory = comm.fsdp_theory(
        n["forward_bytes"], n["backward_bytes"], micro_steps, True, n["reduce_scatter_bytes"], world
    )
    assert theory == run["collective_bytes"]
    assert n["forward_bytes"] == (run["parameters"]["trainable"] + run["parameters"]["frozen"]) * 2  # all, in bf16


def test_what_the_figure_shows_at_qwen3_4b():
    n = FIGURE["numbers"]()
    run = json.loads((REALSCALE / "fsdp-world2.json").read_text())
    # The recorded line of the figure is the committed run's, and it is 4 x the micro-batch drawn.
    assert n["recorded"]["bytes"] == run["collective_bytes"] and n["recorded"]["counts"] == run["collective_counts"]
    assert n["recorded"]["bytes"]["all_gather"] == 4 * n["gathered_per_micro_batch"]["default"]
    assert n["recorded"]["counts"]["all_gather"] == 4 * n["all_gathers_per_micro_batch"]["default"] == 292
    assert (n["forward_all_gathers"], n["backward_all_gathers"], n["reduce_scatters"]) == (37, 36, 36)
    assert n["reduce_scatter_bytes"] == run["parameters"]["trainable"] * 4 == 36 * n["layer_grad_bytes"]
    assert n["forward_bytes"] == n["root_bytes"] + n["backward_bytes"]
    # --no-reshard-after-forward: one gather per unit (fsdp_theory without the backward's); a wrong wrap class: one.
    assert (
        n["gathered_per_micro_batch"]["no-reshard"]
        == comm.fsdp_theory(n["forward_bytes"], n["backward_bytes"], 1, False, 0, 2)["all_gather"]
    )
    assert n["all_gathers_per_micro_batch"] == {"default": 73, "no-reshard": 37, "wrong-wrap": 1}
    # The shards each rank keeps, and what it holds unsharded at the tracked peak: the root, the layer running and
    # the next one in its all-gather buffer (the memory tracker's categories on fake tensors, checkpointing on).
    cats = run["categories"]
    assert n["shard_bytes_per_rank"] == cats["Sharded Param"]
    assert cats["All Gather"] == n["layer_bytes"]
    assert (
        n["held_max"]["default"]
        == cats["Unsharded Param"] + cats["All Gather"]
        == n["root_bytes"] + 2 * n["layer_bytes"]
    )
    for world in (4, 8):
        c = json.loads((REALSCALE / f"fsdp-world{world}.json").read_text())["categories"]
        assert c["Unsharded Param"] + c["All Gather"] == n["held_max"]["default"]
    # Without checkpointing the peak is at the loss: the root alone (the last layer was freed after its forward).
    at_loss = json.loads((REALSCALE / "fsdp-world2-no-checkpointing.json").read_text())["categories"]
    d = n["micro_batches"]["default"]
    head = next(i for i, (_, label, phase) in enumerate(d["compute"]) if label == "head" and phase == "forward")
    assert at_loss["Unsharded Param"] + at_loss["All Gather"] == d["held"][head] == n["root_bytes"]
    assert n["held_max"]["no-reshard"] == n["held_max"]["wrong-wrap"] == n["forward_bytes"]
    # The memory model's `gathered` counts the same units, the adapters gathered in bf16 (param_dtype): the same bytes.
    predicted = memory.predict(
        memory.QWEN3_4B, technique="fsdp", world_size=2, accumulation_steps=4, micro_batch_size=2, logit_positions=256
    ).gathered
    assert predicted == n["held_max"]["default"]


def test_the_post_shows_the_figure_and_its_numbers():
    post = (ROOT / "blogs" / "fsdp.md").read_text()
    assert "](../assets/fsdp_collectives.png)" in post
    assert (ROOT / "assets" / "fsdp_collectives.png").stat().st_size < 300_000
    n = FIGURE["numbers"]()
    for text in (
        f"{n['gathered_per_micro_batch']['default'] / 1e9:.2f} GB",
        f"{n['forward_bytes'] / 1e9:.2f} GB",
        f"{n['backward_bytes'] / 1e9:.2f} GB",
        f"{n['layer_bytes'] / 1e6:.1f} MB",
        f"{n['reduce_scatter_bytes'] / 1e6:.0f} MB",
        f"{n['recorded']['bytes']['all_gather'] / 1e9:.1f} GB",
        f"{n['held_max']['default'] / 1e9:.2f} GB",
    ):
        assert text in post, text
