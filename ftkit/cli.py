"""The common command line every train.py starts from, and the two configurations its defaults come from: the
reference run (`REAL`, Qwen3-4B on GPUs) and the CPU walkthrough (`SMOKE`, --smoke). `resolve` fills them in and
checks every flag before anything expensive; --resume takes the run's own flags (`rundir.take_run_flags`)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import torch

from ftkit import models, ranks, rundir
from ftkit.data import SHIPPED
from ftkit.errors import RunError
from ftkit.lora import checkpoint_every, checkpointed_layers  # noqa: F401  (--checkpointing's helpers, for ftkit.fit)
from ftkit.profiling import parse_profile_steps

# The AMI meetings the package ships, offline, for the real runs and the walkthrough alike.
DEFAULT_DATA = SHIPPED


# Hub datasets read from a revision other than their main branch: AMIsum's main branch is a loading script,
# which `datasets` no longer runs, so it is read from the hub's parquet conversion of it.
HUB_REVISIONS = {"TalTechNLP/AMIsum": "refs/convert/parquet"}


class _Unset:
    """Stands in for every flag while parsing the command line a second time: what is still this was not given."""


class FlagParser(argparse.ArgumentParser):
    """Records which flags the command line gave (`args.explicit_flags`), so that --resume can take every other
    one from the run's config.json and tell a flag given again apart from a default."""

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        probe = argparse.Namespace(**{a.dest: _Unset for a in self._actions if a.dest != "help"})
        given = vars(super().parse_args(args, probe))
        parsed.explicit_flags = sorted(k for k, v in given.items() if v is not _Unset and k != "experiment")
        return parsed


def common_parser(description: str, experiment: str) -> argparse.ArgumentParser:
    p = FlagParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.set_defaults(experiment=experiment)
    g = p.add_argument_group("common flags (every experiment)")
    _add_model_data_and_run(g)
    _add_training(g)
    _add_watching_and_saving(g)
    return p


def _add_model_data_and_run(g: argparse._ArgumentGroup) -> None:
    """What is trained, on what, and where the run lives (or which run continues)."""
    g.add_argument(
        "--smoke",
        action="store_true",
        help="CPU walkthrough: tiny random Qwen3, fp32, gloo; defaults below marked [smoke] apply",
    )
    g.add_argument(
        "--model",
        default=None,
        help="Qwen/Qwen3-4B, a local path, 'tiny' or 'qwen3-4b-shape' (random init, exact 4B config) "
        "[default: Qwen/Qwen3-4B; smoke: tiny]",
    )
    g.add_argument(
        "--tokenizer",
        choices=models.TOKENIZERS,
        default="auto",
        help="qwen3: Qwen3's own, from the installed files (no hub); tiny: a byte-level BPE trained on the run's AMI "
        "text; auto: the model's own (tiny for tiny, qwen3 for qwen3-4b-shape, a model's files otherwise)",
    )
    g.add_argument(
        "--data",
        default=None,
        help=f"'{SHIPPED}' (QMSum's AMI meetings, shipped in the package), a QMSum-format folder or a hub dataset "
        f"id (owner/name[:config]) [default: {DEFAULT_DATA}]",
    )
    g.add_argument(
        "--data-revision",
        default=None,
        help="hub revision [default: the main branch; "
        + ", ".join(f"{k}: {v}" for k, v in HUB_REVISIONS.items())
        + "]",
    )
    g.add_argument(
        "--task",
        choices=["all", "spans", "meetings"],
        default=None,
        help="the queries trained and evaluated on: QMSum's span queries, its whole-meeting summaries (transcripts of "
        "up to 15k words, 20.5k of Qwen3's tokens; cp-ft's default) or both [all]",
    )
    g.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="run directory [default: a new runs/<experiment>[-smoke]/<time>/]",
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue a run: a run directory or checkpoint; bare --resume takes this experiment's latest run",
    )


def _add_training(g: argparse._ArgumentGroup) -> None:
    """The run itself: its length, its batches, the optimizer, the adapter and the compute."""
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps [100; smoke: 30]")
    g.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="exit after this step as if interrupted (schedule still spans --max-steps); "
        "for time-boxed jobs, continue with --resume",
    )
    g.add_argument("--max-length", type=int, default=None, help="tokens per sequence [2048; smoke: 512]")
    g.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="GLOBAL batch: sequences per optimizer step, whatever the number of GPUs [16; smoke: 8]",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="rows per rank per forward: packed rows of up to --max-length positions (several sequences each), or with "
        "--no-packing one padded sequence per row, accumulation = batch / (micro x data-parallel ranks) [2; smoke: 2]",
    )
    g.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help="micro-batches by tokens instead of rows: each micro-batch is one packed row of up to N positions "
        "(examples still cut at --max-length; N >= --max-length), so a step runs as few micro-steps as its tokens "
        "need; the global batch and the loss are unchanged [off]",
    )
    g.add_argument(
        "--fit",
        choices=["auto", "off"],
        default=None,
        help="auto: choose --micro-batch-tokens and --checkpointing for this GPU from the memory model and the "
        "planner (ftkit/fit.py), unless one of them (or --micro-batch-size) is given; printed and recorded "
        "[on CUDA in bf16: auto; smoke, pp-ft, cp-ft: off]",
    )
    g.add_argument(
        "--no-packing",
        dest="packing",
        action="store_false",
        help="one sequence per row, right-padded to the micro-batch's longest (the layout before packing, to compare)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile each decoder layer (torch.compile, regional: one graph for all layers; the first step pays "
        "for it), where the technique allows; --no-compile: eager [on CUDA: on; smoke: off]",
    )
    g.add_argument("--lr", type=float, default=None, help="peak learning rate [2e-4; smoke: 2e-3]")
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warmup, then cosine [10; smoke: 3]")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    g.add_argument("--lora-rank", type=int, default=16)
    g.add_argument("--lora-alpha", type=float, default=32.0)
    g.add_argument(
        "--lora-dropout",
        type=float,
        default=None,
        help="[0.05; smoke: 0.0, so runs of different techniques are comparable step by step]",
    )
    g.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="compute dtype [bf16; smoke: fp32, for exact parity between techniques]",
    )
    _add_checkpointing(g)


def _add_checkpointing(g: argparse._ArgumentGroup) -> None:
    """Activation checkpointing, by decoder layer (`resolve_checkpointing`)."""
    g.add_argument(
        "--checkpointing",
        default=None,
        metavar="{all,none,every-K}",
        help="activation checkpointing by decoder layer: all (recompute each layer in backward), none (keep every "
        "layer's activations), every-K (layers 0, K, 2K, ...: less memory than none, less recompute than all) [all]",
    )
    g.add_argument(
        "--no-grad-checkpointing",
        dest="grad_checkpointing",
        action="store_false",
        help="keep all activations instead of recomputing each layer in backward: --checkpointing none",
    )


def _add_watching_and_saving(g: argparse._ArgumentGroup) -> None:
    """How often the run evaluates, checkpoints and profiles, and how it reports its steps."""
    g.add_argument("--eval-every", type=int, default=None, help="eval loss on held-out meetings [25; smoke: 10]")
    g.add_argument("--eval-examples", type=int, default=None, help="held-out examples per eval [64; smoke: 16]")
    g.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps [50; smoke: 10]")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept")
    g.add_argument(
        "--profile-steps",
        type=parse_profile_steps,
        default=None,
        metavar="A:B",
        help="write a torch.profiler trace of optimizer steps A..B (and a CUDA memory snapshot on GPUs) into "
        "<run>/profile/, for Perfetto / TensorBoard / pytorch.org/memory_viz",
    )
    g.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="print one JSON line per step instead of a progress bar",
    )


def add_dump_flags(group: argparse._ArgumentGroup) -> None:
    """--dump-grads and --dump-logits, for the tensor-parallel experiments: what a test compares with the same
    step on one device."""
    group.add_argument(
        "--dump-grads",
        action="store_true",
        help="write step 3's LoRA gradients, reassembled to full shapes, to grads-step3.safetensors (the column "
        "layers' A gradients are zero while B is: at init, and after step 1, which warmup runs at lr 0)",
    )
    group.add_argument(
        "--dump-logits",
        action="store_true",
        help="after training, write the logits of the first eval micro-batch to logits.pt (for a one-device check)",
    )


SMOKE = dict(
    model="tiny",
    data=DEFAULT_DATA,
    task="all",
    max_steps=30,
    max_length=512,
    batch_size=8,
    micro_batch_size=2,
    lr=2e-3,
    warmup_steps=3,
    lora_dropout=0.0,
    dtype="fp32",
    eval_every=10,
    eval_examples=16,
    save_every=10,
)


REAL = dict(
    model="Qwen/Qwen3-4B",
    data=DEFAULT_DATA,
    task="all",
    max_steps=100,
    max_length=2048,
    batch_size=16,
    micro_batch_size=2,
    lr=2e-4,
    warmup_steps=10,
    lora_dropout=0.05,
    dtype="bf16",
    eval_every=25,
    eval_examples=64,
    save_every=50,
)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Take a resumed run's flags from its config.json, fill the scale-dependent defaults (smoke or real) and check
    the flags, all before anything expensive."""
    models.check_transformers()
    rundir.follow_restart(args)
    if args.resume:
        rundir.take_run_flags(args)
    for key, value in (SMOKE if args.smoke else REAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.data_revision is None:
        args.data_revision = HUB_REVISIONS.get(args.data.partition(":")[0])
    if args.compile is None:  # compiled layers where the step's speed matters; the CPU walkthrough stays eager
        args.compile = not args.smoke
    if args.fit is None:  # the GPU filled where the step's speed matters (ftkit/fit.py); the walkthrough as it is
        own_layout = args.experiment in ("hf-baseline", "pp-ft", "cp-ft")  # rows of their own: nothing to choose
        args.fit = "off" if args.smoke or not torch.cuda.is_available() or own_layout else "auto"
    for key in (
        "max_steps",
        "max_length",
        "batch_size",
        "micro_batch_size",
        "lora_rank",
        "eval_every",
        "save_every",
        "eval_examples",
    ):
        if getattr(args, key) <= 0:
            raise RunError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    check_micro_batch_tokens(args)
    resolve_checkpointing(args)
    if args.stop_after is not None and not 0 < args.stop_after <= args.max_steps:
        raise RunError(f"--stop-after must be in 1..--max-steps ({args.max_steps}), got {args.stop_after}")
    # Written so that NaN fails every check.
    ranges = {
        "lr": (args.lr > 0, "a positive learning rate, e.g. 2e-4"),
        "warmup_steps": (args.warmup_steps >= 0, "0 or more"),
        "weight_decay": (args.weight_decay >= 0, "0 or more"),
        "max_grad_norm": (args.max_grad_norm >= 0, "0 (no clipping) or a positive norm"),
        "lora_alpha": (args.lora_alpha > 0, "positive (the adapter's scale is alpha / rank)"),
        "lora_dropout": (0 <= args.lora_dropout < 1, "a probability in [0, 1)"),
        "keep_checkpoints": (args.keep_checkpoints >= 1, "1 or more (the newest checkpoint is what --resume needs)"),
    }
    for key, (ok, expected) in ranges.items():
        if not ok:
            raise RunError(f"--{key.replace('_', '-')} must be {expected}, got {getattr(args, key)}")
    why = eager_because(args)
    if why and args.compile and "compile" in getattr(args, "explicit_flags", ()):
        # Where --compile is only the default (CUDA runs), the layers run eager and say why (compile_layers).
        given, other = (
            (f"--schedule {args.schedule}", "compile them under a schedule that does not split it: --schedule 1f1b")
            if args.experiment == "pp-ft"
            else ("--quant nf4", "compile a bf16 base: --quant none --compile")
        )
        raise RunError(
            f"{given} --compile: the decoder layers cannot be compiled: {why}. Drop --compile ({given} runs its "
            f"layers eager, as it does by default), or {other}"
        )
    check_compiled_dropout(args)
    if getattr(args, "quant", None) == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
        raise RunError(
            "--quant nf4 (QLoRA) needs bitsandbytes, which is not installed here: `uv sync` installs it (Linux), "
            "or train bf16 LoRA with --quant none"
        )
    return args


# torch releases whose inductor draws wrong dropout masks in compiled layers that activation checkpointing recomputes
# (pytorch/pytorch#198333, "Since 2.13, inductor's 4x random path corrupts CUDA dropout masks"): on CUDA the forward
# kernel can take Philox's 4-at-a-time path and the recompute in backward the one-at-a-time path, so backward
# differentiates another mask than the forward applied, silently. LoRA's dropout on o_proj's input (attention's output,
# transposed and made contiguous) is the pattern. torch 2.15 turns that path off (inductor's `use_rand4x`,
# "Disabled pending" the issue, unless TORCHINDUCTOR_USE_RAND4X=1).
COMPILED_DROPOUT_BROKEN = ((2, 13), (2, 14))

# fsdp-ft --quant nf4: why its decoder layers run eager (`compilation.compile_layers`' eager_because: said once, kept
# in the summary), and why an explicit --compile is refused there.
FSDP_NF4_EAGER_BECAUSE = (
    "FSDP2 hands each layer its 4-bit weights all-gathered as plain uint8 tensors, and bitsandbytes' Linear4bit "
    "re-wraps each as a Params4bit on every call (fix_4bit_weight_quant_state_from_module), setting .data of a tensor "
    "made inside the compiled code, which dynamo cannot trace (tests/fsdp_4bit_compile.py)"
)

# pp-ft's zero-bubble schedules split each backward into its input gradients (I) and its weight gradients (W), run
# apart; a compiled layer's backward is one autograd node torch cannot split (devlogs/pp-ft.md, Notes), so there the
# layers run eager.
PP_ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")
PP_ZERO_BUBBLE_EAGER_BECAUSE = (
    "a zero-bubble schedule computes each layer's input and weight gradients apart, and a compiled layer's backward "
    "is one autograd node that torch cannot split"
)

# The runs whose decoder layers run eager whatever --compile says, each for a reason of its own, passed to
# compile_layers: tp-sp-ft and cp-ft (collectives inside hand-written autograd Functions), and assets/hf_baseline.py,
# which never compiles.
ALWAYS_EAGER = ("tp-sp-ft", "cp-ft", "hf-baseline")


def resolve_checkpointing(args: argparse.Namespace) -> None:
    """--checkpointing all|none|every-K (`lora.checkpoint_every`), checked; --no-grad-checkpointing is its old spelling
    of none, and the two given at odds are refused. Sets `args.checkpointing` (the spec) and `args.grad_checkpointing`
    (True where any layer is checkpointed). A run recorded before --checkpointing has grad_checkpointing only."""
    given = set(getattr(args, "explicit_flags", ()))
    spec = getattr(args, "checkpointing", None)
    every = None if spec is None else checkpoint_every(spec)
    if "grad_checkpointing" in given and not args.grad_checkpointing:
        if "checkpointing" in given and every:
            raise RunError(
                f"--checkpointing {spec} and --no-grad-checkpointing disagree: --no-grad-checkpointing is the old "
                "spelling of --checkpointing none; give one of them"
            )
        spec, every = "none", 0
    elif spec is None:
        spec, every = ("all", 1) if args.grad_checkpointing else ("none", 0)
    args.checkpointing = {0: "none", 1: "all"}.get(every, f"every-{every}")
    args.grad_checkpointing = every > 0


def eager_because(args: argparse.Namespace) -> str | None:
    """Why this run's decoder layers run eager with --compile on, where it depends on the flags: fsdp-ft on a 4-bit
    base (FSDP_NF4_EAGER_BECAUSE), pp-ft under a zero-bubble schedule (PP_ZERO_BUBBLE_EAGER_BECAUSE); None where they
    compile."""
    if args.experiment == "fsdp-ft" and getattr(args, "quant", "none") == "nf4":
        return FSDP_NF4_EAGER_BECAUSE
    if args.experiment == "pp-ft" and getattr(args, "schedule", None) in PP_ZERO_BUBBLE:
        return PP_ZERO_BUBBLE_EAGER_BECAUSE
    return None


def layers_compiled(args: argparse.Namespace) -> bool:
    """Whether this run's decoder layers run compiled: --compile on, and a technique and base that compile them."""
    return bool(args.compile) and args.experiment not in ALWAYS_EAGER and eager_because(args) is None


def check_compiled_dropout(args: argparse.Namespace) -> None:
    """Refuse LoRA dropout in compiled, checkpointed layers on a torch whose compiled dropout is wrong there
    (COMPILED_DROPOUT_BROKEN): the run would train on gradients of masks the forward never applied, with no error."""
    if not (layers_compiled(args) and args.grad_checkpointing and args.lora_dropout > 0):
        return
    version = torch.__version__
    if tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups()) not in COMPILED_DROPOUT_BROKEN:
        return
    raise RunError(
        f"--compile with activation checkpointing and --lora-dropout {args.lora_dropout} on torch {version}: "
        "torch 2.13 and 2.14 compile dropout on CUDA so that the recompute in backward can draw another mask than "
        "the forward applied, and the gradients are silently wrong (pytorch/pytorch#198333). Drop one of the three: "
        "--lora-dropout 0, --no-compile, or --no-grad-checkpointing (memory permitting); or use another torch (the "
        "lock's 2.15, `uv sync`, or 2.11)"
    )


def load_experiment(name: str):
    """experiments/<name>/train.py as a module, so that another script (or ftkit.realscale) runs its own functions:
    one TP plan for tp-ft and fsdp-tp-ft, not a copy. Needs a repository checkout."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "experiments" / name / "train.py"
    if not path.exists():
        raise RunError(f"{path} not found: the experiments are scripts of a repository checkout, not of the package")
    module_name = f"{name.replace('-', '_')}_train"
    if module_name not in sys.modules:  # loaded once per process, as an import would be
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    return sys.modules[module_name]


def torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def check_micro_batch_tokens(args: argparse.Namespace) -> None:
    """--micro-batch-tokens N: one packed row of N positions per micro-batch (`batching.global_batches`), so
    --micro-batch-size becomes 1; refused where every example would not fit a row, beside a --micro-batch-size of
    more than one row, or where the rows are not packed."""
    tokens = getattr(args, "micro_batch_tokens", None)
    if tokens is None:
        return
    if tokens < args.max_length:
        raise RunError(
            f"--micro-batch-tokens {tokens} is less than --max-length {args.max_length}: a micro-batch must hold any "
            f"example; give at least {args.max_length}, or lower --max-length"
        )
    if "micro_batch_size" in getattr(args, "explicit_flags", ()) and args.micro_batch_size != 1:
        raise RunError(
            "--micro-batch-tokens and --micro-batch-size both size the micro-batch: give one of them "
            f"(--micro-batch-tokens {tokens} is one row of {tokens} positions)"
        )
    if not args.packing:
        raise RunError(
            f"--micro-batch-tokens packs examples into rows, and {args.experiment} runs one padded example per row "
            "(--no-packing, or its own layout): size its micro-batches with --micro-batch-size"
        )
    args.micro_batch_size = 1


def padded_only(args: argparse.Namespace, why: str) -> None:
    """A technique that cannot pack yet: it runs the padded layout, says why once, and records it (`padded_why`)."""
    if getattr(args, "micro_batch_tokens", None):
        raise RunError(f"--micro-batch-tokens: {why}; size its micro-batches with --micro-batch-size")
    if args.packing:
        args.packing, args.padded_why = False, why
        ranks.print0(f"note: {why}")


def resolve_microbatches(args: argparse.Namespace) -> None:
    """pp-ft's --microbatches m: the pipeline's micro-batches per step, which set --micro-batch-size to
    --batch-size / m; refused unless m divides the batch into equal micro-batches, or beside a --micro-batch-size
    given on the command line that disagrees."""
    if args.microbatches is None:
        return
    if args.microbatches <= 0 or args.batch_size % args.microbatches:
        raise RunError(
            f"--microbatches {args.microbatches} must divide --batch-size {args.batch_size} into equal micro-batches"
        )
    if "--micro-batch-size" in sys.argv and args.micro_batch_size * args.microbatches != args.batch_size:
        raise RunError("--microbatches and --micro-batch-size disagree; give one of them")
    args.micro_batch_size = args.batch_size // args.microbatches
