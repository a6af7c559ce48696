"""The posts' advice is the planner's: every "use X when Y" the series states, run through `python -m ftkit.plan` on
the case the post gives for it, names the technique the planner recommends there. Planner calls only (no model, no
GPU): each decision is found in its post by a stable phrase, and the text from that phrase to the end of its bullet
(or, in the memory post's decision tree, to the next branch) must name the recommendation."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import pytest
from conftest import ROOT

from ftkit import hardware
from ftkit.memory import GIB
from ftkit.plan.__main__ import main
from ftkit.plan.layouts import longest
from ftkit.plan.recommendation import label

RTX4090 = ["--gpu", "rtx4090"]  # its own link: PCIe through host memory (no peer-to-peer)
LONG = ["--micro-batch-size", "1"]


@dataclass(frozen=True)
class Decision:
    post: str
    phrase: str  # where the post states it (whitespace-normalized)
    argv: tuple[str, ...]  # the planner's flags for the post's case
    recommended: str  # the planner's recommendation, as recommendation.label writes it
    named: tuple[str, ...]  # what the post's text from the phrase on must name
    tokens: bool = False  # the post quotes the recommended row's predicted tokens/s there


def d(post, phrase, argv, recommended, *named, tokens=False):
    return Decision(post, phrase, tuple(argv.split() if isinstance(argv, str) else argv), recommended, named, tokens)


DECISIONS = [
    # blogs/tp-sp.md, "When to choose TP, and which script"
    *(
        d(
            "tp-sp.md",
            "The job fits a data-parallel run:",
            ["--gpus", "2", *flags.split()],
            "ddp-ft --quant none (dp2)",
            "ddp-ft --quant none",
        )
        for flags in (
            "--gpu h100-pcie --link pcie4",
            "--gpu h100-pcie --link pcie4 --micro-batch-size 1",
            "--gpu h100-sxm --link nvlink4",
        )
    ),
    d(
        "tp-sp.md",
        "The job fits a data-parallel run:",
        ["--gpus", "2", *RTX4090],
        "ddp-ft --quant nf4 (dp2)",
        "ddp-ft --quant nf4",
    ),
    d(
        "tp-sp.md",
        "Long sequences do not fit, but a bf16 replica does:",
        ["--gpus", "4", "--gpu", "l4", "--max-length", "40960", *LONG],
        "cp-ft (dp2 x cp2)",
        "cp-ft (dp2 x cp2)",
        tokens=True,
    ),
    d(
        "tp-sp.md",
        "Long sequences do not fit, nor does a replica:",
        ["--model", "Qwen/Qwen3-8B", "--gpus", "4", *RTX4090, "--max-length", "32768", *LONG, "--batch-size", "8"],
        "tp-sp-ft (tp4)",
        "tp-sp-ft (tp4)",
        tokens=True,
    ),
    # blogs/fsdp-tp.md, "Which layout for your cluster"
    d(
        "fsdp-tp.md",
        "The job fits on one GPU",
        ["--gpus", "2", *RTX4090],
        "ddp-ft --quant nf4 (dp2)",
        "ddp-ft --quant nf4",
    ),
    d(
        "fsdp-tp.md",
        "The job fits on one GPU",
        ["--gpus", "16", "--nodes", "2", *RTX4090, "--batch-size", "64"],
        "ddp-ft --quant nf4 (dp16)",
        "ddp-ft --quant nf4",
    ),
    d(
        "fsdp-tp.md",
        "Only a 4-bit replica fits, across nodes",
        "--model Qwen/Qwen3-32B --gpus 16 --nodes 2 --batch-size 64",
        "fsdp-ft --quant nf4 (dp16)",
        "fsdp-ft --quant nf4",
    ),
    d(
        "fsdp-tp.md",
        "On one node of H100s",
        "--model Qwen/Qwen3-32B --gpus 8 --batch-size 64",
        "fsdp-tp-ft (dp2 x tp4)",
        "fsdp-tp-ft (dp2 x tp4)",
    ),
    d(
        "fsdp-tp.md",
        "with the host modelled as well",
        "--model Qwen/Qwen3-32B --gpus 16 --nodes 2 --batch-size 64 --host h100-vm",
        "fsdp-tp-ft (dp4 x tp4)",
        "fsdp-tp-ft (dp4 x tp4)",
    ),
    d(
        "fsdp-tp.md",
        "At `--batch-size 32`, whose rows leave ranks idle",
        "--model Qwen/Qwen3-32B --gpus 16 --nodes 2 --batch-size 32",
        "fsdp-tp-ft (dp2 x tp8)",
        "`fsdp-tp-ft (dp2 x tp8)`",
    ),
    d(
        "fsdp-tp.md",
        "No replica fits, not even in 4 bits",
        ["--model", "Qwen/Qwen3-32B", "--gpus", "8", *RTX4090],
        "fsdp-ft (dp8)",
        "`fsdp-ft`",
    ),
    d(
        "fsdp-tp.md",
        "On 2 nodes of them",
        ["--model", "Qwen/Qwen3-32B", "--gpus", "16", "--nodes", "2", *RTX4090, "--batch-size", "64"],
        "fsdp-ft --quant nf4 (dp16)",
        "4-bit `fsdp-ft`",
    ),
    d(
        "fsdp-tp.md",
        "Between nodes on 10 GbE",
        ["--model", "Qwen/Qwen3-32B", "--gpus", "16", "--nodes", "2", *RTX4090, "--batch-size", "64"]
        + ["--inter-node-link", "eth-10g"],
        "fsdp-ft --quant nf4 (dp16)",
        "4-bit `fsdp-ft`",
    ),
    d(
        "fsdp-tp.md",
        "Where no mesh with TP inside a node fits",
        "--model Qwen/Qwen3-14B --gpus 8 --nodes 2 --gpu a100-40gb --link nvlink3 --max-length 40960 "
        "--micro-batch-size 1",
        "tp-sp-ft (tp8)",
        "tp-sp-ft",
    ),
    d(
        "fsdp-tp.md",
        "Qwen3-14B at 40,960 tokens on 2 nodes",
        "--model Qwen/Qwen3-14B --gpus 16 --nodes 2 --gpu a100-40gb --link nvlink3 --max-length 40960 "
        "--micro-batch-size 1",
        "fsdp-tp-ft (dp4 x tp4)",
        "fsdp-tp-ft (dp4 x tp4)",
        tokens=True,
    ),
    # blogs/what-fills-gpu-memory.md, the decision tree (each branch up to the next) and "What to run on your GPUs"
    d(
        "what-fills-gpu-memory.md",
        "one GPU enough for your time budget? ──── yes",
        "--gpus 1 --gpu h100-sxm",
        "single-gpu-ft --quant none (1 GPU)",
        "single-gpu-ft",
    ),
    d(
        "what-fills-gpu-memory.md",
        "no → DDP: a replica per GPU",
        ["--gpus", "2", *RTX4090],
        "ddp-ft --quant nf4 (dp2)",
        "ddp-ft",
    ),
    d(
        "what-fills-gpu-memory.md",
        "only the 4-bit replica fits DDP, all GPUs on one node",
        "--model Qwen/Qwen3-32B --gpus 8 --batch-size 64",
        "fsdp-tp-ft (dp2 x tp4)",
        "fsdp-tp-ft",
    ),
    d(
        "what-fills-gpu-memory.md",
        "FSDP's shards fit (bf16 or 4-bit)",
        ["--model", "Qwen/Qwen3-32B", "--gpus", "8", *RTX4090],
        "fsdp-ft (dp8)",
        "fsdp-ft",
    ),
    d(
        "what-fills-gpu-memory.md",
        "FSDP's shards fit (bf16 or 4-bit)",
        ["--model", "Qwen/Qwen3-32B", "--gpus", "4", *RTX4090],
        "fsdp-ft --quant nf4 (dp4)",
        "fsdp-ft [--quant nf4]",
    ),
    d(
        "what-fills-gpu-memory.md",
        "PP has no branch:",
        "--model Qwen/Qwen3-32B --gpus 8 --nodes 4 --gpu rtx4090 --inter-node-link eth-10g",
        "fsdp-ft --quant nf4 (dp8)",
        "keeps 4-bit FSDP",
    ),
    d(
        "what-fills-gpu-memory.md",
        "a bf16 replica fits beside 1/N of them",
        ["--gpus", "4", "--gpu", "l4", "--max-length", "40960", *LONG],
        "cp-ft (dp2 x cp2)",
        "cp-ft",
    ),
    d(
        "what-fills-gpu-memory.md",
        "it does not, on one node",
        ["--model", "Qwen/Qwen3-8B", "--gpus", "4", *RTX4090, "--max-length", "32768", *LONG, "--batch-size", "8"],
        "tp-sp-ft (tp4)",
        "tp-sp-ft",
    ),
    d(
        "what-fills-gpu-memory.md",
        "it does not, across nodes",
        "--model Qwen/Qwen3-14B --gpus 16 --nodes 2 --gpu a100-40gb --link nvlink3 --max-length 40960 "
        "--micro-batch-size 1",
        "fsdp-tp-ft (dp4 x tp4)",
        "fsdp-tp-ft",
    ),
    d(
        "what-fills-gpu-memory.md",
        "2 × 24 GB on PCIe 4",
        ["--gpus", "2", *RTX4090],
        "ddp-ft --quant nf4 (dp2)",
        "ddp-ft/train.py --quant nf4",
    ),
    d(
        "what-fills-gpu-memory.md",
        "One 80 GB GPU",
        "--gpus 1 --gpu h100-sxm",
        "single-gpu-ft --quant none (1 GPU)",
        "single-gpu-ft/train.py --quant none",
    ),
    d(
        "what-fills-gpu-memory.md",
        "2 nodes × 8 H100 on InfiniBand with Qwen3-32B",
        "--model Qwen/Qwen3-32B --gpus 16 --nodes 2 --batch-size 64",
        "fsdp-ft --quant nf4 (dp16)",
        "fsdp-ft --quant nf4",
    ),
    # blogs/fsdp.md, "When to pick FSDP over DDP for LoRA"
    d(
        "fsdp.md",
        "FSDP takes Qwen3-4B's model per GPU",
        ["--gpus", "2", *RTX4090, "--micro-batch-size", "8", "--batch-size", "32"],
        "ddp-ft --quant none (dp2)",
        "the planner keeps DDP",
    ),
    d(
        "fsdp.md",
        "The bf16 replica fits: use DDP.",
        ["--gpus", "2", *RTX4090],
        "ddp-ft --quant nf4 (dp2)",
        "ddp-ft --quant nf4",
    ),
    d(
        "fsdp.md",
        "Qwen3-8B at micro-batch 4 on 2 x RTX 4090",
        ["--model", "Qwen/Qwen3-8B", "--gpus", "2", *RTX4090, "--micro-batch-size", "4"],
        "ddp-ft --quant nf4 (dp2)",
        "ddp-ft --quant nf4",
    ),
    d(
        "fsdp.md",
        "Even the 4-bit replica does not fit: shard.",
        ["--model", "Qwen/Qwen3-32B", "--gpus", "8", *RTX4090],
        "fsdp-ft (dp8)",
        "`fsdp-ft` where bf16 shards fit",
    ),
    d(
        "fsdp.md",
        "Even the 4-bit replica does not fit: shard.",
        ["--model", "Qwen/Qwen3-32B", "--gpus", "4", *RTX4090],
        "fsdp-ft --quant nf4 (dp4)",
        "`fsdp-ft --quant nf4` where only 4-bit ones do",
    ),
    # blogs/cp.md, "What to run on two 24 GB cards"
    d(
        "cp.md",
        "At the 32k cap it picks QLoRA DDP",
        ["--gpus", "2", *RTX4090, "--max-length", "32768", *LONG, "--batch-size", "8"],
        "ddp-ft --quant nf4 (dp2)",
        "QLoRA DDP",
    ),
    d(
        "cp.md",
        "At 40,960 tokens it picks 4-bit FSDP",
        ["--gpus", "2", *RTX4090, "--max-length", "40960", *LONG, "--batch-size", "8"],
        "fsdp-ft --quant nf4 (dp2)",
        "4-bit FSDP",
    ),
    d(
        "cp.md",
        "on two L4s or A10s it picks cp-ft",
        ["--gpus", "2", "--gpu", "l4", "--max-length", "40960", *LONG, "--batch-size", "8"],
        "cp-ft (cp2)",
        "cp-ft",
    ),
    d(
        "cp.md",
        "its pick there is still `ddp-ft --quant nf4`",
        ["--gpus", "4", *RTX4090, "--max-length", "32768", *LONG, "--batch-size", "8"],
        "ddp-ft --quant nf4 (dp4)",
        "ddp-ft --quant nf4",
        tokens=True,
    ),
    # blogs/pp.md, "When to use PP, and what to run"
    d(
        "pp.md",
        "gets 4-bit FSDP at",
        "--model Qwen/Qwen3-32B --gpus 8 --nodes 4 --gpu rtx4090 --inter-node-link eth-10g",
        "fsdp-ft --quant nf4 (dp8)",
        "4-bit FSDP",
        tokens=True,
    ),
    # blogs/ddp.md, "What to run, and when": "Run it" on H100s and H200s, compiled and eager
    d(
        "ddp.md",
        "on H100s and H200s, not RTX 4090s,",
        "--gpus 2 --gpu h100-sxm",
        "ddp-ft --quant none (dp2)",
        "`--quant none`",
    ),
    d(
        "ddp.md",
        "on H100s and H200s, not RTX 4090s,",
        "--gpus 2 --gpu h200",
        "ddp-ft --quant none (dp2)",
        "`--quant none`",
    ),
    d(
        "ddp.md",
        "Eager (`--no-compile`) on 2 H100s",
        "--gpus 2 --gpu h100-sxm --no-compile",
        "ddp-ft --quant nf4 (dp2)",
        "QLoRA beats bf16 DDP",
    ),
    d(
        "ddp.md",
        "Eager on 2 H200s",
        "--gpus 2 --gpu h200 --no-compile --host h200-vm",
        "tp-sp-ft (tp2)",
        "`tp-sp-ft (tp2)`",
        tokens=True,
    ),
    # blogs/ddp.md, "What to run, and when": a global batch that fills 8 GPUs (at 16, fsdp-tp-ft leads: the flag test)
    d(
        "ddp.md",
        "At `--batch-size 64` on H100s",
        "--gpus 8 --gpu h100-sxm --batch-size 64",
        "ddp-ft --quant none (dp8)",
        "`ddp-ft --quant none` leads again",
    ),
    # blogs/ddp.md, "What to run, and when": the planner's example cards without peer-to-peer
    d(
        "ddp.md",
        "it still recommends `ddp-ft`",
        ["--gpus", "2", *RTX4090],
        "ddp-ft --quant nf4 (dp2)",
        "ddp-ft --quant nf4",
    ),
]


# A case holds for what the scripts run, not only for the planner's defaults (the scripts' own layout: AMI's span
# examples packed where they reach --max-length, every row --max-length real tokens beyond, each experiment at the
# layout its --fit auto chooses; the host not modelled; torch's total_memory of the datasheet's card): its pick is the
# same with the committed runs' host on the GPUs it was calibrated on, and with 0.15 GiB less memory (drivers move
# total_memory by ~0.1 GiB). A reader also takes a case to a cluster of another size: at half and at double the GPUs
# (GPUs per node alike up to 8, then nodes doubled; never one GPU, whose only run is single-gpu-ft) the same script
# and quantization are picked, the mesh grown or shrunk with it. On the GPUs whose host is calibrated, eager layers
# (`--no-compile`, as the committed runs; compiled layers are the default but not yet measured on a GPU) with the host
# modelled pick the same too (mesh included: a mesh is advice), and so do the other cards a reader calls 24 GB for an
# RTX 4090 case (RTX 3090, 23.55 GiB; A10 and L4, 22 GiB). Where a case's pick does change, the post must say so
# where it states the case (its paragraph or bullet; for the memory post's tree, the paragraph under it): STATED names
# the variant, the other pick, and the words the post says it with.
HOSTED = {"h100-sxm": "h100-vm", "h100-pcie": "h100-vm", "h200": "h200-vm"}
SAME_CLASS = ("rtx3090", "a10", "l4")  # the other "24 GB" cards, for an RTX 4090 case
# compared by script and quantization, not mesh
RESIZED = ("half the GPUs", "double the GPUs", *SAME_CLASS)
L4_A10 = "on two 22 GiB L4s or A10s `tp-sp-ft (tp2)`"  # the words every 2-card DDP case says it with
STATED = {  # (post, phrase): {variant: {the other pick: the words the post says it with}}
    ("fsdp-tp.md", "Only a 4-bit replica fits, across nodes"): {
        "packed, host": {"fsdp-tp-ft (dp4 x tp4)": "host"},
        "eager, host": {"fsdp-tp-ft (dp8 x tp2)": "eager with the host, dp8 x tp2"},
        "half the GPUs": {"fsdp-tp-ft": "On one node of H100s the planner picks `fsdp-tp-ft"},
    },
    ("fsdp-tp.md", "At `--batch-size 32`, whose rows leave ranks idle"): {
        "packed, host": {"fsdp-tp-ft (dp4 x tp4)": "dp4 x tp4 with the host modelled"},
        "eager, host": {"fsdp-tp-ft (dp8 x tp2)": "dp8 x tp2 leads with `--no-compile`"},
    },
    ("fsdp-tp.md", "On one node of H100s"): {
        "double the GPUs": {"fsdp-ft --quant nf4": "`fsdp-ft --quant nf4`"},
        "eager, host": {"fsdp-tp-ft (dp4 x tp2)": "eager with the host, dp4 x tp2"},
    },
    ("fsdp-tp.md", "with the host modelled as well"): {
        "eager, host": {"fsdp-tp-ft (dp8 x tp2)": "eager with the host, dp8 x tp2"},
    },
    ("fsdp-tp.md", "The job fits on one GPU"): {
        card: {"tp-sp-ft": "`tp-sp-ft (tp2)` on 2", "fsdp-ft": "bf16 `fsdp-ft` on 2 x 8"} for card in ("a10", "l4")
    },
    ("fsdp-tp.md", "On 2 nodes of them"): {
        card: {"fsdp-ft": "bf16 `fsdp-ft` on 3090s, A10s or L4s"} for card in ("rtx3090", "a10", "l4")
    },
    ("fsdp-tp.md", "No replica fits, not even in 4 bits"): {
        "half the GPUs": {"fsdp-ft --quant nf4": "on 4 of them only 4-bit shards fit"}
    },
    ("fsdp-tp.md", "Where no mesh with TP inside a node fits"): {"double the GPUs": {"fsdp-tp-ft": "`fsdp-tp-ft"}},
    ("fsdp-tp.md", "Qwen3-14B at 40,960 tokens on 2 nodes"): {"half the GPUs": {"tp-sp-ft": "`tp-sp-ft`"}},
    ("tp-sp.md", "Long sequences do not fit, nor does a replica:"): {
        "half the GPUs": {"none": "On two cards nothing fits"},
        "double the GPUs": {"cp-ft": "on eight, `cp-ft (cp8)`"},
    },
    ("tp-sp.md", "The job fits a data-parallel run:"): {
        "eager, host": {"fsdp-ft (dp2)": "on 2 H100s `fsdp-ft`"},
        **{card: {"tp-sp-ft": L4_A10} for card in ("a10", "l4")},
    },
    ("what-fills-gpu-memory.md", "one GPU enough for your time budget? ──── yes"): {
        "eager, host": {"single-gpu-ft --quant nf4 (1 GPU)": "(QLoRA or LoRA)"}
    },
    ("what-fills-gpu-memory.md", "no → DDP: a replica per GPU"): {card: {"tp-sp-ft": L4_A10} for card in ("a10", "l4")},
    ("what-fills-gpu-memory.md", "only the 4-bit replica fits DDP, all GPUs on one node"): {
        "double the GPUs": {"fsdp-ft --quant nf4": "fsdp-ft --quant nf4"},
        "eager, host": {"fsdp-tp-ft (dp4 x tp2)": "eager with the host, dp4 x tp2"},
    },
    ("what-fills-gpu-memory.md", "FSDP's shards fit (bf16 or 4-bit)"): {
        "half the GPUs": {"fsdp-ft --quant nf4": "fsdp-ft [--quant nf4]"},
        "double the GPUs": {"fsdp-ft": "fsdp-ft [--quant nf4]"},
    },
    ("what-fills-gpu-memory.md", "it does not, on one node"): {
        "half the GPUs": {"none": "on two nothing fits"},
        "double the GPUs": {"cp-ft": "on eight `cp-ft (cp8)`"},
    },
    ("what-fills-gpu-memory.md", "it does not, across nodes"): {"half the GPUs": {"tp-sp-ft": "tp-sp-ft"}},
    ("what-fills-gpu-memory.md", "2 × 24 GB on PCIe 4"): {card: {"tp-sp-ft": L4_A10} for card in ("a10", "l4")},
    ("what-fills-gpu-memory.md", "One 80 GB GPU"): {
        "eager, host": {"single-gpu-ft --quant nf4 (1 GPU)": "`--quant nf4` leads"}
    },
    ("what-fills-gpu-memory.md", "2 nodes × 8 H100 on InfiniBand with Qwen3-32B"): {
        "packed, host": {"fsdp-tp-ft (dp4 x tp4)": "fsdp-tp-ft"},
        "eager, host": {"fsdp-tp-ft (dp8 x tp2)": "eager with the host, dp8 x tp2"},
        "half the GPUs": {"fsdp-tp-ft": "fsdp-tp-ft"},
    },
    ("ddp.md", "At `--batch-size 64` on H100s"): {"eager, host": {"fsdp-ft (dp8)": "eager, `fsdp-ft`"}},
    ("ddp.md", "on H100s and H200s, not RTX 4090s,"): {
        "eager, host": {"fsdp-ft (dp2)": "with `--host h100-vm`, `fsdp-ft`", "tp-sp-ft (tp2)": "on 2 H200s, `tp-sp-ft"}
    },
    ("ddp.md", "Eager (`--no-compile`) on 2 H100s"): {
        **{
            variant: {"fsdp-ft (dp2)": "with `--host h100-vm`, `fsdp-ft`"}
            for variant in ("packed, host", "eager, host")
        },
        "double the GPUs": {"tp-sp-ft": "four: `tp-sp-ft` leads"},
    },
    ("ddp.md", "it still recommends `ddp-ft`"): {card: {"tp-sp-ft": L4_A10} for card in ("a10", "l4")},
    ("cp.md", "At 40,960 tokens it picks 4-bit FSDP"): {
        "-0.15 GiB": {"cp-ft (cp2)": "0.08 GiB to spare"},
        "rtx3090": {"cp-ft": "on 3090s"},
        **{card: {"cp-ft": "on two L4s or A10s it picks cp-ft"} for card in ("a10", "l4")},
    },
    ("fsdp.md", "The bf16 replica fits: use DDP."): {card: {"tp-sp-ft": L4_A10} for card in ("a10", "l4")},
    ("fsdp.md", "Qwen3-8B at micro-batch 4 on 2 x RTX 4090"): {"l4": {"fsdp-ft": "on L4s bf16 `fsdp-ft`"}},
    ("fsdp.md", "Even the 4-bit replica does not fit: shard."): {
        "half the GPUs": {"fsdp-ft --quant nf4": "`fsdp-ft --quant nf4` where only 4-bit ones do"},
        "double the GPUs": {"fsdp-ft": "`fsdp-ft` where bf16 shards fit"},
    },
}


def with_flag(argv: tuple[str, ...], flag: str, value: int | str) -> tuple[str, ...]:
    a = list(argv)
    if flag in a:
        a[a.index(flag) + 1] = str(value)
    else:
        a += [flag, str(value)]
    return tuple(a)


def variants(argv: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The case's flags as the scripts run it, by variant name (see above)."""
    flag = dict(zip(argv, argv[1:]))
    gpu = flag.get("--gpu", "h100-sxm")
    out = {"-0.15 GiB": (*argv, "--gpu-memory-gib", f"{hardware.gpu(gpu).memory_bytes / GIB - 0.15:.3f}")}
    if int(flag.get("--max-length", 2048)) <= longest() and gpu in HOSTED and "--layout" not in flag:
        if "--host" not in flag:
            out["packed, host"] = (*argv, "--host", HOSTED[gpu])
        out["eager, host"] = (*argv, *(() if "--host" in flag else ("--host", HOSTED[gpu])), "--no-compile")
    if gpu == "rtx4090":
        out.update({card: with_flag(argv, "--gpu", card) for card in SAME_CLASS})
    gpus, nodes = int(flag["--gpus"]), int(flag.get("--nodes", 1))
    if gpus >= 4:
        out["half the GPUs"] = with_flag(with_flag(argv, "--gpus", gpus // 2), "--nodes", max(nodes // 2, 1))
    if gpus >= 2:
        wider = 2 * gpus // nodes <= 8
        out["double the GPUs"] = with_flag(with_flag(argv, "--gpus", 2 * gpus), "--nodes", nodes * (1 if wider else 2))
    return out


def normalized(text: str) -> str:
    return " ".join(text.split())


@functools.cache
def blocks(post: str) -> tuple[str, ...]:
    """The post's paragraphs and bullets (a decision tree is one), whitespace-normalized."""
    text = (ROOT / "blogs" / post).read_text()
    return tuple(normalized(b) for b in re.split(r"\n(?=\s*- \*\*)|\n\s*\n", text))


def statement(post: str, phrase: str) -> str:
    """The post's text from `phrase` to the end of its paragraph or bullet, or to the decision tree's next branch."""
    found = [b for b in blocks(post) if phrase in b]
    assert len(found) == 1, f"blogs/{post}: {len(found)} paragraphs state {phrase!r}"
    return re.split(r"[├└]──", found[0][found[0].index(phrase) :])[0]


def case_text(post: str, phrase: str) -> str:
    found = blocks(post)
    i = next(i for i, b in enumerate(found) if phrase in b)
    return found[i] + (" " + found[i + 1] if "├──" in found[i] else "")


def case_sentence(post: str, phrase: str) -> str:
    """The words that state the case: the sentence or tree branch the phrase is in, and the block's lead (a paragraph's
    first sentence, a tree's question) where the lead states no case of its own. A flag one case names cannot stand
    for another case's in the same paragraph."""
    block = next(b for b in blocks(post) if phrase in b)
    at = block.index(phrase)
    start = max(block.rfind(". ", 0, at) + 2, block.rfind("── ", 0, at) + 3)
    stops = [i for i in (block.find(". ", at + len(phrase)), *(block.find(b, at) for b in ("├──", "└──"))) if i >= 0]
    first_sentence_end = block.find(". ") if ". " in block else len(block)
    lead = block[: block.index("├──") if "├──" in block else first_sentence_end]
    if any(x.phrase in lead for x in DECISIONS if x.post == post and x.phrase != phrase):
        lead = ""
    return lead + " " + block[start : min(stops, default=len(block))]


@pytest.fixture(scope="module")
def plans():
    cache = {}

    def run(argv: tuple[str, ...]) -> dict:
        if argv not in cache:
            cache[argv] = main([*argv, "--json"])
        return cache[argv]

    return run


@pytest.mark.parametrize("decision", DECISIONS, ids=[f"{x.post}:{x.phrase[:40]}:{x.recommended}" for x in DECISIONS])
def test_the_post_names_what_the_planner_recommends(decision, plans, capsys):
    result = plans(decision.argv)
    capsys.readouterr()
    rec = result["recommendation"]
    assert rec["technique"], rec["reason"]
    assert label(rec) == decision.recommended, (decision.argv, rec["reason"])
    said = statement(decision.post, decision.phrase)
    for name in decision.named:
        assert name in said, f"blogs/{decision.post}: {name!r} not in {said!r}"
    if decision.tokens:
        row = next(
            r
            for r in result["techniques"]
            if (r["experiment"], r["mesh"], r["quant"]) == (rec["experiment"], rec["mesh"], rec["quant"])
        )
        assert f"{row['tokens_per_s']:,.0f}" in said, said


@pytest.mark.parametrize("decision", DECISIONS, ids=[f"{x.post}:{x.phrase[:40]}:{x.recommended}" for x in DECISIONS])
def test_each_case_holds_for_what_the_scripts_run(decision, plans, capsys):
    stated = STATED.get((decision.post, decision.phrase), {})
    for name, argv in variants(decision.argv).items():
        rec = plans(argv)["recommendation"]
        capsys.readouterr()
        picked, expected = label(rec) if rec["technique"] else "none", decision.recommended
        if name in RESIZED:  # the script and its quantization: the mesh grows with the GPUs
            picked, expected = (re.sub(r" \([^)]*\)$", "", x) for x in (picked, expected))
        if picked != expected:
            said = stated.get(name, {}).get(picked)
            assert said, f"{name}: {argv} picks {picked}, not {expected}, and blogs/{decision.post} does not say so"
            assert said in case_text(decision.post, decision.phrase), (name, picked, said)


def test_no_case_the_posts_give_recommends_a_pipeline(plans, capsys):
    """pp-ft loads the whole bf16 base on every GPU first, so the planner refuses it where a pipeline would pay (no
    GPU trains the model alone even in 4 bits, nodes on 10 GbE), and the posts say so: no case above, nor Qwen3-4B's
    reference on two GPUs of either kind, gets pp-ft."""
    cases = {x.argv for x in DECISIONS} | {("--gpus", "2", *RTX4090), ("--gpus", "2", "--gpu", "h100-sxm")}
    picks = {argv: plans(argv)["recommendation"].get("experiment") for argv in cases}
    capsys.readouterr()
    assert "pp-ft" not in picks.values()
    ethernet = next(x for x in DECISIONS if x.phrase == "PP has no branch:")
    pp = next(r for r in plans(ethernet.argv)["techniques"] if r["technique"] == "pp")
    assert "loads the whole bf16 base" in pp["refused"]
    assert "`pp-ft` loads the whole bf16 base on every GPU" in statement(
        "what-fills-gpu-memory.md", "PP has no branch:"
    )


def test_the_planner_figures_in_the_advice_name_their_assumptions():
    """Every advice section that quotes the planner says what it assumes: the MFU (40% when no --host is given, as
    in every case above) and that the host is not modelled."""
    sections = {
        "tp-sp.md": "## When to choose TP",
        "fsdp-tp.md": "## Which layout for your cluster",
        "fsdp.md": "## When to pick FSDP over DDP",
        "what-fills-gpu-memory.md": "## The decision tree",
        "ddp.md": "## What to run, and when",
        "pp.md": "## When to use PP",
    }
    for post, heading in sections.items():
        text = (ROOT / "blogs" / post).read_text()
        section = normalized(text[text.index(heading) :].split("\n## ", 1)[0])
        if post == "fsdp.md":  # its planner figures' assumptions are stated under "Where the numbers come from"
            section = normalized(text)
        assert "assumed 40% MFU" in section and "host not modelled" in section, post


# The flags of a case beyond the machine it is on (model, GPUs, nodes, card, sequence length). A reader who copies
# the case without one of them runs the planner's default there; where that changes the pick, the post must give the
# flag where it states the case: its paragraph or bullet (for the memory post's tree, the paragraph under it that
# gives each branch's case), as the flag or in these words.
TUNED = ("--batch-size", "--micro-batch-size", "--link", "--inter-node-link", "--link-efficiency", "--host", "--layout")
IN_WORDS = {("--micro-batch-size", "1"): "micro-batch 1", ("--inter-node-link", "eth-10g"): "10 GbE"}


@pytest.mark.parametrize("decision", DECISIONS, ids=[f"{x.post}:{x.phrase[:40]}:{x.recommended}" for x in DECISIONS])
def test_a_case_names_every_flag_its_pick_depends_on(decision, plans, capsys):
    argv = decision.argv
    said = case_sentence(decision.post, decision.phrase)
    for i, flag in enumerate(argv):
        if flag not in TUNED:
            continue
        rec = plans(argv[:i] + argv[i + 2 :])["recommendation"]
        capsys.readouterr()
        picked = label(rec) if rec["technique"] else "none"
        value = argv[i + 1]
        if picked != decision.recommended:
            named = f"{flag} {value}" in said or IN_WORDS.get((flag, value), f"{flag} {value}") in said
            assert named, f"without {flag} {value} the planner picks {picked}: blogs/{decision.post} {said!r}"
