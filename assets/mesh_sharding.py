"""How fsdp-tp-ft shards one decoder layer's q_proj (column-parallel) and o_proj (row-parallel) of Qwen3-4B, and
their LoRA A and B, on a 2-D mesh of DP x TP ranks: which rank holds which block of each weight, the placement on
each mesh dimension, and the shapes and bytes.

Nothing here is drawn by hand. The layer's two projections are built on the meta device with PEFT's module names
and Qwen3-4B's shapes (`ftkit.models.QWEN3_4B_CONFIG`, the `--lora-rank` default), then sharded by the script's
own code path: tp-ft's `lora_aware_plan()` through `parallelize_module` on the `tp` dimension, then FSDP2's
`fully_shard` on the `dp` dimension, as experiments/fsdp-tp-ft/train.py does, in one process playing rank 0 of
a fake process group. Each rank's block is DTensor's own local shape and global offset for that rank's mesh
coordinate.

    uv run python assets/mesh_sharding.py            # writes assets/mesh_sharding.png (mesh 2 x 2)
    uv run python assets/mesh_sharding.py --table    # the same numbers as the table in devlogs/fsdp-tp-ft.md

`sharding(dp, tp)` returns the numbers the figure shows, for tests/test_figure_mesh_sharding.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

from ftkit import cli, models  # noqa: E402

PROJECTIONS = ("q_proj", "o_proj")  # one column-parallel and one row-parallel projection of the attention block
RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
# PEFT keeps the LoRA weights in fp32 (ftkit/lora.py: the optimizer's master copy); the base is in --dtype.
LORA_DTYPE = torch.float32


def _lora_linear(n_in: int, n_out: int, rank: int, dtype: torch.dtype) -> nn.Module:
    """The modules PEFT puts where a target nn.Linear was: `base_layer`, `lora_A.default`, `lora_B.default`."""
    module = nn.Module()
    module.base_layer = nn.Linear(n_in, n_out, bias=False, dtype=dtype)
    module.lora_A = nn.ModuleDict({"default": nn.Linear(n_in, rank, bias=False, dtype=LORA_DTYPE)})
    module.lora_B = nn.ModuleDict({"default": nn.Linear(rank, n_out, bias=False, dtype=LORA_DTYPE)})
    return module


def _placement_name(placement) -> str:
    """Shard(dim=0) -> Shard(0), Replicate() as it is, FSDP2's _StridedShard(dim=0, sf=2) (its dp shard of a TP
    shard on the same dim) -> _StridedShard(0, sf=2)."""
    return repr(placement).replace("dim=", "")


def sharding(dp: int = 2, tp: int = 2) -> dict:
    """Every weight of q_proj and o_proj as fsdp-tp-ft shards it on a DP x TP mesh: its global shape and dtype, the
    TP style the plan gives it, its placement on each mesh dimension, its bytes whole and per rank, and each
    rank's block (rows, columns) of the whole matrix."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("sharding() plays rank 0 of a fake process group: call it where no group exists")
    tp_ft = cli.load_experiment("tp-ft")
    config = models.QWEN3_4B_CONFIG
    hidden, attn = config["hidden_size"], config["num_attention_heads"] * config["head_dim"]
    rank = cli.common_parser("", experiment="fsdp-tp-ft").get_default("lora_rank")
    dtype = cli.torch_dtype(cli.REAL["dtype"])
    shapes = {"q_proj": (hidden, attn), "o_proj": (attn, hidden)}  # (in, out) features
    dist.init_process_group("fake", rank=0, world_size=dp * tp, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            for name in PROJECTIONS:
                setattr(layer.self_attn, name, _lora_linear(*shapes[name], rank, dtype))
        plan = {k: v for k, v in tp_ft.lora_aware_plan().items() if k.split(".")[1] in PROJECTIONS}
        parallelize_module(layer, mesh["tp"], plan)  # as the script: TP first, on `tp`
        for name, p in layer.named_parameters():
            p.requires_grad_("lora_" in name)
        fully_shard(layer, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(param_dtype=dtype))  # then FSDP2
        tensors = []
        for name, p in layer.named_parameters():
            module = name.removesuffix(".weight")
            dims = p.device_mesh.mesh_dim_names  # ("dp", "tp"), or ("dp",) where TP left the tensor whole
            placements = dict(zip(dims, (_placement_name(x) for x in p.placements)))
            placements.setdefault("tp", _placement_name(Replicate()))  # a DTensor on dp alone: alike on the TP ranks
            blocks = {}
            for r in range(dp * tp):
                coord = (r // tp, r % tp) if len(dims) == 2 else (r // tp,)
                local, offset = _compute_local_shape_and_global_offset(
                    p.shape, p.device_mesh.shape, coord, p.placements
                )
                blocks[r] = {"rows": (offset[0], offset[0] + local[0]), "cols": (offset[1], offset[1] + local[1])}
            local = p.to_local().shape
            tensors.append(
                {
                    "name": name,
                    "projection": name.split(".")[1],
                    "part": "base" if "base_layer" in name else name.split(".")[2],  # base, lora_A, lora_B
                    "tp_style": type(plan[module]).__name__ if module in plan else None,
                    "shape": tuple(p.shape),
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "bytes": p.numel() * p.element_size(),
                    "mesh_dims": dims,
                    "placements": placements,
                    "local_shape": tuple(local),
                    "local_bytes": local.numel() * p.element_size(),
                    "blocks": blocks,
                }
            )
    finally:
        dist.destroy_process_group()
    return {"dp": dp, "tp": tp, "lora_rank": rank, "tensors": tensors}


def table(data: dict) -> str:
    """The figure's numbers as a markdown table, one row per weight."""
    lines = [
        "| weight | shape, dtype | bytes | tp-ft's plan | placement on dp | placement on tp "
        "| each rank holds | bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in data["tensors"]:
        lines.append(
            f"| `{t['projection']}.{t['part']}` | {list(t['shape'])} {t['dtype']} | {t['bytes']:,} "
            f"| {t['tp_style'] or '- (whole)'} | `{t['placements']['dp']}` | `{t['placements']['tp']}` "
            f"| {list(t['local_shape'])} | {t['local_bytes']:,} |"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def draw(data: dict, out: Path) -> None:
    dp, tp, r = data["dp"], data["tp"], data["lora_rank"]
    by_name = {(t["projection"], t["part"]): t for t in data["tensors"]}
    fig = plt.figure(figsize=(12.5, 9.0))
    grid = fig.add_gridspec(2, 4, width_ratios=[0.8, 2.0, 2.0, 1.2], hspace=0.5, wspace=0.3, top=0.86)
    # The mesh: rank = dp index x TP + tp index; a row is a TP group, a column an FSDP group.
    ax = fig.add_subplot(grid[:, 0])
    for k in range(dp * tp):
        i, j = divmod(k, tp)
        ax.add_patch(Rectangle((j, dp - 1 - i), 0.9, 0.9, color=RANK_COLORS[k]))
        ax.text(
            j + 0.45, dp - 0.55 - i, f"rank {k}\ndp {i}\ntp {j}", ha="center", va="center", color="white", fontsize=8
        )
    ax.set_xlim(-0.1, tp)
    ax.set_ylim(-0.6, dp + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"the mesh, {dp} x {tp}\nrow: a TP group (one node)\ncolumn: an FSDP group", fontsize=9)
    # Draw scale: the base matrices to scale; the LoRA rank dimension (r) widened to be visible.
    r_drawn = 1400
    for row, projection in enumerate(PROJECTIONS):
        for col, part in enumerate(("base", "lora_A", "lora_B")):
            t = by_name[(projection, part)]
            ax = fig.add_subplot(grid[row, 1 + col])
            rows, cols = t["shape"]
            sy = r_drawn / r if rows == r else 1.0  # drawn units per row / column
            sx = r_drawn / r if cols == r else 1.0
            holders: dict[tuple, list[int]] = {}
            for k, b in t["blocks"].items():
                holders.setdefault((b["rows"], b["cols"]), []).append(k)
            for (ys, xs), ranks in holders.items():
                # A block several ranks hold (the TP ranks of one FSDP index): the first's colour, hatched with
                # the others'.
                for n, k in enumerate(ranks):
                    ax.add_patch(
                        Rectangle(
                            (xs[0] * sx, ys[0] * sy),
                            (xs[1] - xs[0]) * sx,
                            (ys[1] - ys[0]) * sy,
                            facecolor=RANK_COLORS[ranks[0]] if n == 0 else "none",
                            edgecolor=RANK_COLORS[k] if n else "white",
                            hatch="//" if n else None,
                            linewidth=0 if n else 1.5,
                        )
                    )
                label = "ranks " + " & ".join(map(str, ranks)) if len(ranks) > 1 else f"rank {ranks[0]}"
                ax.text(
                    (xs[0] + xs[1]) * sx / 2,
                    (ys[0] + ys[1]) * sy / 2,
                    f"{label}\nrows {ys[0]}:{ys[1]}\ncols {xs[0]}:{xs[1]}",
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    color="white",
                )
            ax.set_xlim(0, cols * sx)
            ax.set_ylim(rows * sy, 0)
            ax.set_aspect("equal")
            ax.set_xticks([0, cols * sx], ["0", str(cols)], fontsize=7)
            ax.set_yticks([0, rows * sy], ["0", str(rows)], fontsize=7)
            style = t["tp_style"] or "none (whole under TP)"
            on_tp = "" if "tp" in t["mesh_dims"] else " (a DTensor on dp alone)"
            ax.set_title(
                f"{projection}.{part}  [{rows}, {cols}] {t['dtype']}, {_mib(t['bytes'])}\n"
                f"plan: {style}\n"
                f"dp: {t['placements']['dp']}, tp: {t['placements']['tp']}{on_tp}\n"
                f"each rank {list(t['local_shape'])}, {_mib(t['local_bytes'])}",
                fontsize=7.5,
            )
    whole = sum(t["bytes"] for t in data["tensors"])
    each = sum(t["local_bytes"] for t in data["tensors"])
    fig.text(
        0.5,
        0.035,
        f"Each rank holds {each:,} of these six weights' {whole:,} bytes ({each / whole:.1%}; 1/{dp * tp} would be "
        f"{whole / (dp * tp):,.0f}): the LoRA halves TP leaves whole are split {dp} ways, not {dp * tp}. Hatched: "
        f"a block the {tp} ranks of a TP group both hold. FSDP's all-gather over dp rebuilds a rank's TP slice "
        "(e.g. q_proj.base's rows of one tp index), never the whole matrix.",
        ha="center",
        fontsize=8,
        wrap=True,
    )
    fig.suptitle(
        f"Qwen3-4B, one decoder layer: q_proj (column-parallel) and o_proj (row-parallel) with LoRA r={r}, sharded by "
        f"fsdp-tp-ft on a {dp} x {tp} mesh\n(TP by tp-ft's plan, then FSDP2 on dim 0 over dp; placements and blocks "
        "from DTensor; LoRA's r drawn wider than to scale)",
        fontsize=10,
        y=0.97,
    )
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh-shape", default="2,2", metavar="DP,TP")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "mesh_sharding.png")
    p.add_argument("--table", action="store_true", help="print the numbers as a markdown table, draw nothing")
    args = p.parse_args()
    dp, tp = (int(x) for x in args.mesh_shape.split(","))
    data = sharding(dp, tp)
    if args.table:
        print(table(data))
        return
    draw(data, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
