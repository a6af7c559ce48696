"""Which technique for this job on these GPUs: predicted memory per GPU, step time and tokens/s for every
experiment and mesh shape the GPUs allow, and a recommendation with its reason: the command. What it computes, and
from what: the package's docstring (ftkit/plan/__init__.py).

    uv run python -m ftkit.plan --model Qwen/Qwen3-4B --gpus 2 --gpu rtx4090
"""

from __future__ import annotations

import argparse
import json

from ftkit import errors, hardware, models
from ftkit.lora import checkpoint_every
from ftkit.memory import GIB
from ftkit.plan import layouts
from ftkit.plan.hosts import ASSUMED_MFU, HOSTS
from ftkit.plan.layouts import AMI_LENGTHS, LAYOUTS
from ftkit.plan.recommendation import label, mesh_label, plan
from ftkit.plan.settings import QWEN3_CONFIGS, Setting, model_config


def print_table(result: dict, model: str) -> None:
    st, a = result["setting"], result["assumptions"]
    print(
        f"{model}: {st['gpus']} x {st['gpu']} ({st['memory_bytes'] / GIB:.1f} GiB) on {st['nodes']} node(s), "
        f"link {st['link']}" + (f", across nodes {st['inter_node_link']}" if st["inter_node_link"] else "")
    )
    notes = result.get("prediction")
    gpu = f"MFU {a['mfu']:.0%}" if notes is None else f"GPU kernels at {a['mfu']:.1%} of the peak (below)"
    own = [r for r in result["techniques"] if r["micro_batch_size"] != st["micro_batch_size"] and "refused" not in r]
    own = f" ({own[0]['experiment']}'s own {own[0]['micro_batch_size']})" if own else ""
    layout = f"micro-batch {st['micro_batch_size']}{own}, checkpointing {checkpointing(st)}"
    if any(r.get("fit") for r in result["techniques"]):
        layout = f"--fit auto's layout (below; else {layout})"
    print(
        f"global batch {st['batch_size']} x {st['max_length']} tokens, {layout}, LoRA "
        f"r{st['lora_rank']}; assumed: {gpu}, links at "
        f"{a['link_efficiency']:.0%} of their bandwidth, memory x{a['memory_margin']} "
        f"+ {a['reserve_bytes'] / GIB:.1f} GiB"
    )
    for note in notes or []:
        print(f"  {note}")
    if notes is None:  # the full layout: say why, and what the scripts run on AMI's examples
        longest = layouts.longest(st.get("tokenizer", models.QWEN3))
        why = (
            f"--max-length is beyond AMI's longest example, {longest:,} tokens: data longer than AMI's examples"
            if st["max_length"] > longest
            else "--layout full"
        )
        print(
            f"  every row --max-length real tokens ({why}); the scripts pack AMI's examples into rows, "
            "--micro-batch-size rows a micro-batch: --layout packed predicts that"
        )
    host = "" if notes is None else f" {'host s':>7} {'mb/step':>7}"
    fitted = any(r.get("fit") for r in result["techniques"])
    fit = f" {'--fit auto':<17}" if fitted else ""
    print(f"{'experiment':<30} {'mesh':<14} {'quant':<5}{fit} {'need GiB':>8} {'fits':<4} {'compute s':>9} "
          f"{'comm s':>7} {'bubble s':>8}{host} {'step s':>7} {'tokens/s':>9}")  # fmt: skip
    for r in result["techniques"]:
        mesh = mesh_label(r["mesh"])
        if "refused" in r:
            print(f"{r['experiment']:<30} {mesh:<14} {r['quant']:<5} refused: {r['refused']}")
            continue
        host = "" if notes is None else f" {r['host_s']:7.3f} {r['micro_batches']:7g}"
        fit = f" {fit_label(r.get('fit'), st['micro_batch_size']):<17}" if fitted else ""
        print(
            f"{r['experiment']:<30} {mesh:<14} {r['quant']:<5}{fit} {r['required_bytes'] / GIB:8.1f} "
            f"{'yes' if r['fits'] else 'no':<4} {r['compute_s']:9.3f} {r['exposed_comm_s']:7.3f} "
            f"{r['bubble_s']:8.3f}{host} {r['step_time_s']:7.3f} {r['tokens_per_s']:9,.0f}"
        )
    rec = result["recommendation"]
    print(f"recommendation: {label(rec) if rec['technique'] else 'none'}: {rec['reason']}")


def fit_label(choice: dict | None, rows: int) -> str:
    """A row's --fit auto layout in the table: its micro-batch and checkpointing; "flags" where it has none."""
    if not choice:
        return "flags"
    tokens = choice["micro_batch_tokens"]
    return f"{f'{tokens} tok' if tokens else f'{rows} rows'}, {choice['checkpointing']}"


def checkpointing(st: dict) -> str:
    every = st.get("checkpoint_every", 1)
    return "off" if not st["grad_checkpointing"] else "on" if every == 1 else f"every {every} layers"


def parser() -> argparse.ArgumentParser:
    # the command as it is run (argparse would name it after this file, __main__.py)
    p = argparse.ArgumentParser(prog="python -m ftkit.plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=models.QWEN3_4B, help=f"{', '.join(QWEN3_CONFIGS)}, or a config's path")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu", default="h100-sxm", choices=[g.key for g in hardware.GPUS])
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="[what torch reports for --gpu, ftkit/hardware.py; your card's total_memory / 2**30 where a fit is close]",
    )
    p.add_argument(
        "--link",
        choices=list(hardware.LINKS),
        help="between the GPUs of a node [the GPU's own: NVLink on SXM, PCIe via host memory on GeForce, else PCIe]",
    )
    p.add_argument("--inter-node-link", default="ib-ndr", choices=list(hardware.LINKS))
    p.add_argument("--batch-size", type=int, default=16, help="global batch, sequences")
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="rows per micro-batch [2, cp-ft's own 1; --fit auto's choice]",
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="one packed row of this many positions per micro-batch, as the scripts' flag (--layout packed)",
    )
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--answer-tokens", type=int, default=256, help="positions the lm_head runs on, per sequence")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--no-grad-checkpointing", dest="grad_checkpointing", action="store_false", help="old: none")
    p.add_argument(
        "--checkpointing",
        default=None,
        metavar="{all,none,every-K}",
        help="the decoder layers checkpointed, as the scripts' flag: every one, none, or layers 0, K, 2K, ... [all]",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="the GPU kernels' fraction of the dense bf16 peak while the GPU computes [--host's calibration; "
        f"without --host, {ASSUMED_MFU}, assumed]",
    )
    add_host_and_layout(p)
    p.add_argument("--link-efficiency", type=float, default=0.8, help="assumed fraction of a link's bandwidth")
    p.add_argument("--reserve-gib", type=float, default=1.0, help="CUDA context and NCCL buffers, assumed")
    p.add_argument("--json", action="store_true")
    return p


def add_host_and_layout(p: argparse.ArgumentParser) -> None:
    """The flags of the host model and the batch layout (issue 30)."""
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="auto",
        help="auto: each script's own, packed (pp-ft: fixed) where AMI's examples reach --max-length, full beyond "
        "them (longer data, e.g. cp-ft's whole meetings); full: every row --max-length real tokens; padded: the AMI "
        "training examples one per row, right-padded per micro-batch (--no-packing); packed: packed into rows of up "
        "to --max-length, each micro-batch as wide as its fullest row (the scripts' default); masked: padded with "
        "the padding mask passed (the committed H100 runs); fixed: one example per row, right-padded to "
        "--max-length (pp-ft)",
    )
    p.add_argument(
        "--fit",
        choices=("auto", "off"),
        default="auto",
        help="auto: each experiment at the layout its run's --fit auto chooses (the scripts' default on CUDA: "
        "micro-batch tokens and checkpointing, the fastest predicted to fit; not pp-ft, cp-ft, nor beyond AMI's "
        "examples), unless a layout flag (--micro-batch-size, --micro-batch-tokens, --checkpointing) is given; "
        "off: every experiment at the flags' layout [auto]",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the decoder layers compiled where the script compiles them, as the scripts do on CUDA (not tp-sp-ft, "
        "cp-ft, fsdp-ft --quant nf4); the host's count of compiled layers a prediction; --no-compile: every layer "
        "eager, as the committed H100 runs [compiled, but eager on --layout padded or masked]",
    )
    p.add_argument(
        "--host",
        choices=list(HOSTS),
        default=None,
        help="model the host's cost per micro-batch, calibrated on the committed H100 (h100-vm) or H200 (h200-vm) "
        "runs' host [not modelled]",
    )
    p.add_argument("--host-op-us", type=float, default=None, help="microseconds per host op [--host's calibration]")
    p.add_argument("--seed", type=int, default=0, help="the global batches' seed, for the AMI layouts")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps predicted, for the AMI layouts [one epoch]")
    p.add_argument(
        "--tokenizer",
        choices=list(AMI_LENGTHS),
        default=models.QWEN3,
        help="whose token counts the AMI layouts use: qwen3 (Qwen3's own, a Qwen3-4B run's) or tiny (what the "
        "committed H100 runs tokenized)",
    )


def setting_from(p: argparse.ArgumentParser, args: argparse.Namespace) -> Setting:
    """The Setting the flags give; a combination the planner cannot predict is the parser's error (exit code 2)."""
    if args.compile is None:  # the scripts' default; assets/host_ops.py counts compiled layers on packed rows only
        args.compile = args.layout not in ("padded", "masked")
    elif args.compile and args.layout in ("padded", "masked"):
        p.error(
            "--compile: assets/host_ops.py counts the compiled layers' launches on packed rows: --layout packed or full"
        )
    try:
        every = checkpoint_every(args.checkpointing or ("all" if args.grad_checkpointing else "none"))
    except errors.RunError as e:
        p.error(str(e))
    if args.checkpointing not in (None, "none") and not args.grad_checkpointing:
        p.error(f"--checkpointing {args.checkpointing} and --no-grad-checkpointing (--checkpointing none) disagree")
    if args.micro_batch_tokens and (args.layout not in ("auto", "packed") or args.micro_batch_tokens < args.max_length):
        p.error("--micro-batch-tokens: one packed row (--layout packed) of at least --max-length positions")
    if args.gpus < 1 or args.nodes < 1 or args.gpus % args.nodes:
        p.error(f"--gpus {args.gpus} must be a positive multiple of --nodes {args.nodes} (GPUs per node alike)")
    layout_given = [args.micro_batch_size, args.micro_batch_tokens, args.checkpointing]
    fit = args.fit == "auto" and args.grad_checkpointing and all(v is None for v in layout_given)
    micro_batch_given = args.micro_batch_size is not None
    args.micro_batch_size = 2 if args.micro_batch_size is None else args.micro_batch_size
    gpu = hardware.gpu(args.gpu)
    try:
        config = model_config(args.model)
    except errors.ModelError as e:
        p.error(str(e))  # one line and exit code 2, as a bad flag
    return Setting(
        config=config,
        gpu=gpu,
        gpus=args.gpus,
        nodes=args.nodes,
        link=hardware.LINKS[args.link or gpu.link],
        inter_node_link=hardware.LINKS[args.inter_node_link],
        memory_bytes=args.gpu_memory_gib * GIB if args.gpu_memory_gib else gpu.memory_bytes,
        reserve_bytes=args.reserve_gib * GIB,
        **{k: getattr(args, k) for k in ("batch_size", "micro_batch_size", "max_length", "answer_tokens")},
        **{k: getattr(args, k) for k in ("lora_rank", "lora_dropout", "mfu")},
        grad_checkpointing=every > 0,
        checkpoint_every=max(every, 1),
        micro_batch_tokens=args.micro_batch_tokens,
        micro_batch_given=micro_batch_given,
        link_efficiency=args.link_efficiency,
        layout=args.layout,
        compile=args.compile,
        fit=fit,
        host=args.host,
        host_op_s=None if args.host_op_us is None else args.host_op_us * 1e-6,
        seed=args.seed,
        tokenizer=args.tokenizer,
        steps=args.steps,
    )


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    setting = setting_from(p, args)
    result = {"model": args.model, **plan(setting)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result, args.model)
    return result


if __name__ == "__main__":
    main()
