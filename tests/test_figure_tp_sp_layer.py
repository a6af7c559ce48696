"""assets/tp_sp_layer.py, the figure of blogs/tp-sp.md: where TP's f and g and SP's all-gather / reduce-scatter sit in
one decoder layer, and what they move. Its numbers must be ftkit/comm.py's theory at the reference configuration, and
that theory what the scripts issued at Qwen3-4B's shape (the committed fake-tensor runs of ftkit.realscale, which
record every collective as the scripts record them)."""

from __future__ import annotations

import json
import runpy
from types import SimpleNamespace

import pytest
from conftest import ROOT

from ftkit import comm
from ftkit.memory import QWEN3_4B

REALSCALE = ROOT / "devlogs" / "runs" / "realscale"
ACT = 2 * 2048 * QWEN3_4B.hidden * 2  # the reference micro-batch's activation, [2, 2048, 2560] in bf16


@pytest.fixture(scope="module")
def figure() -> dict:
    return runpy.run_path(str(ROOT / "assets" / "tp_sp_layer.py"))["numbers"]()  # not as __main__: nothing drawn


def record(name: str) -> tuple[dict, int]:
    """A committed realscale run at the reference configuration on 2 ranks: its collectives, its micro-steps."""
    run = json.loads((REALSCALE / f"{name}.json").read_text())
    cfg = run["config"]
    assert run["world_size"] == 2 and cfg["model"] == "qwen3-4b-shape" and cfg["layers"] == QWEN3_4B.layers
    assert (cfg["micro_batch_size"], cfg["max_length"], cfg["lora_rank"], cfg["grad_checkpointing"]) == (
        2,
        2048,
        16,
        True,
    )
    assert run["collective_bytes"] == pytest.approx(run["collective_bytes_theory"], abs=4)  # + the grad norm's scalar
    return run, cfg["micro_steps_run"]


def theory(mode: str, layers: int) -> dict[str, float]:
    """Each script's theory for one micro-batch of the reference, called here as the scripts call it."""
    cfg = SimpleNamespace(num_hidden_layers=layers, hidden_size=QWEN3_4B.hidden)
    args = SimpleNamespace(grad_checkpointing=True, sequence_parallel=mode == "tp-sp", lora_rank=16)
    rows = [{"activation_bytes": ACT, "comm": {}}]
    if mode == "tp-ft":
        return {"all_reduce": comm.tp_all_reduce_theory(cfg, args, rows, tp=2)}
    return {k: b for k, b in comm.tp_sp_collective_theory(cfg, args, rows, replicated_bytes=0).items() if b}


def test_each_collective_moves_one_activation(figure):
    assert figure["activation_bytes"] == ACT == 20_971_520
    for mode in ("tp", "tp-sp"):
        for c in figure["modes"][mode]["collectives"]:
            assert c["buffer"] == ACT
            for kind, sent in c["wire"].items():  # a ring of 2: all-reduce the whole buffer, each half of it
                assert sent == ACT * (1.0 if kind == "all_reduce" else 0.5)


@pytest.mark.parametrize("mode", ["tp", "tp-sp"])
def test_the_four_places_add_up_to_one_layer_of_the_theory(figure, mode):
    """f, g (or SP's pair) before and after each block, forward x2 where checkpointing recomputes it: together what
    one more decoder layer adds to the script's theory."""
    drawn: dict[str, float] = {}
    for c in figure["modes"][mode]["collectives"]:
        for kind, runs in c["runs"].items():
            drawn[kind] = drawn.get(kind, 0) + runs * c["buffer"]
    two, one = theory(mode, 2), theory(mode, 1)
    per_layer = {kind: two[kind] - one.get(kind, 0) for kind in two}
    assert drawn == per_layer == figure["modes"][mode]["per_layer"]
    expected = {"tp": {"all_reduce": 5 * ACT}, "tp-sp": {"all_gather": 6 * ACT, "reduce_scatter": 5 * ACT}}[mode]
    assert per_layer == expected


def test_per_micro_batch_is_what_the_scripts_issued_at_qwen3_4b_shape(figure):
    modes = figure["modes"]
    for mode in modes:
        assert modes[mode]["micro_batch"] == theory(mode, QWEN3_4B.layers)
    # tp-sp-ft: 6 all-gathers and 5 reduce-scatters per layer, the lm_head's all-gather and the scatter's backward one
    run, micro_steps = record("tp-sp-world2")
    per_micro = {k: run["collective_bytes"][k] / micro_steps for k in ("all_gather", "reduce_scatter")}
    assert modes["tp-sp"]["micro_batch"] == per_micro
    assert run["collective_counts"]["all_gather"] == micro_steps * (6 * QWEN3_4B.layers + 2)
    assert run["collective_bytes"]["all_gather"] / run["collective_counts"]["all_gather"] == ACT
    # ... and once per step the replicated LoRA gradients (plus the gradient norm's one fp32 scalar)
    assert run["collective_bytes"]["all_reduce"] == figure["replicated_lora_bytes"] + 4
    # tp-ft: DTensor's per-module all-reduces
    run, micro_steps = record("tp-world2")
    assert modes["tp-ft"]["micro_batch"] == {"all_reduce": run["collective_bytes"]["all_reduce"] / micro_steps}
    # fsdp-ft: the weights it gathers per micro-batch, half of them on the wire from each of 2 GPUs
    run, micro_steps = record("fsdp-world2")
    assert figure["fsdp_micro_batch_wire"] == run["collective_bytes"]["all_gather"] / micro_steps / 2


def test_what_each_gpu_sends(figure):
    """The figure's captions, in the units it prints them."""
    modes = figure["modes"]
    assert round(modes["tp"]["per_layer_wire"] / 1e6, 1) == 104.9
    assert round(modes["tp-sp"]["per_layer_wire"] / 1e6, 1) == 115.3
    assert round(modes["tp-ft"]["per_layer_wire"] / 1e6, 1) == 189.9
    gb = {mode: round(m["micro_batch_wire"] / 1e9, 2) for mode, m in modes.items()}
    assert gb == {"tp": 3.77, "tp-sp": 4.17, "tp-ft": 6.84}
    assert round(figure["fsdp_micro_batch_wire"] / 1e9, 2) == 7.72


def test_the_post_shows_the_figure_and_its_numbers():
    post = (ROOT / "blogs" / "tp-sp.md").read_text()
    assert "](../assets/tp_sp_layer.png)" in post
    png = ROOT / "assets" / "tp_sp_layer.png"
    assert png.exists() and png.stat().st_size < 300_000
    for quoted in ("21.0 MB", "104.9 MB", "115.3 MB", "41.3 MB"):
        assert quoted in post, quoted
