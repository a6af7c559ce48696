"""assets/mesh_sharding.png shows how fsdp-tp-ft shards Qwen3-4B's q_proj and o_proj and their LoRA halves on a 2 x 2
mesh. Its numbers are checked against their sources: the shapes against `QWEN3_4B_CONFIG` and the `--lora-rank`
default, the dtypes against the reference configuration and PEFT's fp32 adapters, the TP styles against tp-ft's
plan and `ftkit.lora`'s column/row split, and each rank's block against the split the two wrappers make (TP's chunk
of the plan's dim, then FSDP2's chunk of dim 0 over dp). No drawing: one process on meta tensors, a fake group."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import ROOT

from ftkit import cli, lora, models

spec = importlib.util.spec_from_file_location("mesh_sharding", ROOT / "assets" / "mesh_sharding.py")
mesh_sharding = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mesh_sharding)
DP, TP = 2, 2


@pytest.fixture(scope="module")
def figure():
    return mesh_sharding.sharding(DP, TP)


def test_the_figure_shows_the_six_weights_with_qwen3_4b_shapes(figure):
    c = models.QWEN3_4B_CONFIG
    hidden, attn = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]  # 2560, 4096
    r = cli.common_parser("", experiment="fsdp-tp-ft").parse_args([]).lora_rank
    assert figure["lora_rank"] == r == 16
    expected = {
        ("q_proj", "base"): (attn, hidden),  # nn.Linear(hidden, heads * head_dim).weight: [out, in]
        ("q_proj", "lora_A"): (r, hidden),
        ("q_proj", "lora_B"): (attn, r),
        ("o_proj", "base"): (hidden, attn),
        ("o_proj", "lora_A"): (r, attn),
        ("o_proj", "lora_B"): (hidden, r),
    }
    shown = {(t["projection"], t["part"]): t for t in figure["tensors"]}
    assert {k: t["shape"] for k, t in shown.items()} == expected
    base_dtype = cli.torch_dtype(cli.REAL["dtype"])  # bf16 in the reference configuration
    for (_, part), t in shown.items():
        dtype = base_dtype if part == "base" else torch.float32  # PEFT's adapters stay fp32 (ftkit/lora.py)
        assert t["dtype"] == str(dtype).removeprefix("torch.")
        assert t["bytes"] == expected[_, part][0] * expected[_, part][1] * dtype.itemsize
    assert shown["q_proj", "base"]["bytes"] == shown["o_proj", "base"]["bytes"] == 20_971_520  # 20 MiB each


def test_the_tp_styles_are_tp_fts_plan(figure):
    tp_ft = cli.load_experiment("tp-ft")
    plan = tp_ft.lora_aware_plan()
    assert "q_proj" in lora.COLUMN_PARALLEL and "o_proj" in lora.ROW_PARALLEL
    for t in figure["tensors"]:
        style = plan.get(t["name"].removesuffix(".weight"))  # e.g. self_attn.q_proj.base_layer
        assert t["tp_style"] == (type(style).__name__ if style is not None else None), t["name"]
    styles = {(t["projection"], t["part"]): t["tp_style"] for t in figure["tensors"]}
    # Column layers: base and B split by output rows, A whole; row layers: base and A by input columns, B whole.
    assert styles == {
        ("q_proj", "base"): "ColwiseParallel",
        ("q_proj", "lora_A"): None,
        ("q_proj", "lora_B"): "ColwiseParallel",
        ("o_proj", "base"): "RowwiseParallel",
        ("o_proj", "lora_A"): "RowwiseParallel",
        ("o_proj", "lora_B"): None,
    }


def chunk(span: tuple[int, int], n: int, i: int) -> tuple[int, int]:
    size = (span[1] - span[0]) // n
    return span[0] + i * size, span[0] + (i + 1) * size


def test_each_ranks_block_is_tps_chunk_then_fsdps(figure):
    """ColwiseParallel shards dim 0 by tp, RowwiseParallel dim 1; then FSDP2 chunks the rank's local tensor on dim 0
    by dp. Rank k sits at (dp, tp) = divmod(k, TP) (init_device_mesh, row-major)."""
    tp_dim = {"ColwiseParallel": 0, "RowwiseParallel": 1, None: None}
    for t in figure["tensors"]:
        rows, cols = t["shape"]
        held = {}
        for k in range(DP * TP):
            i, j = divmod(k, TP)
            span = [(0, rows), (0, cols)]
            if tp_dim[t["tp_style"]] is not None:
                span[tp_dim[t["tp_style"]]] = chunk(span[tp_dim[t["tp_style"]]], TP, j)
            span[0] = chunk(span[0], DP, i)
            block = t["blocks"][k]
            assert (block["rows"], block["cols"]) == tuple(span), (t["name"], k)
            held.setdefault(tuple(span), []).append(k)
        # The blocks tile the matrix: each element held by one rank, or by the TP ranks of one row of the mesh.
        copies = 1 if t["tp_style"] else TP
        assert all(len(ranks) == copies for ranks in held.values())
        assert sum((b[0][1] - b[0][0]) * (b[1][1] - b[1][0]) for b in held) == rows * cols
        # what a rank stores: its block, 1/(DP x TP) of the matrix, or 1/DP where TP left it whole
        (r0, r1), (c0, c1) = t["blocks"][0]["rows"], t["blocks"][0]["cols"]
        assert t["local_shape"] == (r1 - r0, c1 - c0)
        assert t["local_bytes"] * DP * TP // copies == t["bytes"]


def test_the_placements(figure):
    shown = {(t["projection"], t["part"]): t["placements"] for t in figure["tensors"]}
    # FSDP2 over a TP shard of the same dim: a _StridedShard on dp (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)
    assert shown["q_proj", "base"] == shown["q_proj", "lora_B"] == {"dp": "_StridedShard(0, sf=2)", "tp": "Shard(0)"}
    assert shown["o_proj", "base"] == shown["o_proj", "lora_A"] == {"dp": "Shard(0)", "tp": "Shard(1)"}
    assert shown["q_proj", "lora_A"] == shown["o_proj", "lora_B"] == {"dp": "Shard(0)", "tp": "Replicate()"}


def test_the_devlogs_table_is_the_figures(figure):
    devlog = (ROOT / "devlogs" / "fsdp-tp-ft.md").read_text()
    assert devlog.split("<!-- mesh:begin -->\n")[1].split("\n<!-- mesh:end -->")[0] == mesh_sharding.table(figure)


def test_the_post_shows_the_figure_and_its_numbers(figure):
    post = (ROOT / "blogs" / "fsdp-tp.md").read_text()
    assert "](../assets/mesh_sharding.png)" in post
    whole = sum(t["bytes"] for t in figure["tensors"])
    each = sum(t["local_bytes"] for t in figure["tensors"])
    assert f"holds {each:,} of these six weights' {whole:,} bytes, {each / whole:.1%}" in post
