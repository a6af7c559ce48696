"""--fit auto's choice, shared by a run (ftkit/fit.py, before its model loads) and the planner (`--fit auto`, its
default as the scripts'): the layouts a run may take, a micro-batch by tokens (one packed row of N positions:
FIT_TOKENS) or the --micro-batch-size rows, each with activation checkpointing on every layer, every other one or
none (FIT_CHECKPOINTING), and the fastest of them that the memory model, with the planner's margin, says fits.

The planner compares experiments each at the layout its run would choose, not at the flags' reference layout (2 rows,
every layer checkpointed), so that its recommendation is what a reader's run does: on 2 x 24 GB a 4-bit base frees
the memory that lets the run checkpoint fewer layers. The choice is made as the run makes it (`as_run_chooses`: its
host, links and reserve, whatever the planner's flags assume), and the chosen layout priced as the planner's flags
say."""

from __future__ import annotations

import dataclasses

from ftkit import hardware, lora
from ftkit.memory import GIB
from ftkit.plan.layouts import resolve
from ftkit.plan.settings import Setting
from ftkit.plan.techniques import evaluate

FIT_TOKENS = (None, 4096, 8192, 16384, 32768)  # None: --micro-batch-size rows of --max-length
FIT_CHECKPOINTING = ("all", "every-2", "none")
# The experiments whose scripts lay out their batches with --fit auto; pp-ft and cp-ft run padded rows of their own.
TECHNIQUES = ("single", "ddp", "fsdp", "tp", "tp-sp", "fsdp-tp")
# A script's own --micro-batch-size where it is not the common 2: cp-ft's, one whole meeting per micro-batch.
OWN_MICRO_BATCH = {"cp": 1}


def host_for(gpu: hardware.GPU) -> str:
    """The planner's calibrated host (plan/hosts.py) a run on this GPU chooses with: the lent H200 machines'
    (h200-vm), else the H100 machines' (h100-vm), the GPU machines' hosts the devlog measured."""
    return "h200-vm" if gpu.key == "h200" else "h100-vm"


def candidates(base: Setting) -> list[Setting]:
    """Every layout and checkpointing FIT_TOKENS and FIT_CHECKPOINTING give, a token budget only where it is more
    than a row of --max-length and less than the whole global batch's positions."""
    most = base.batch_size * base.max_length
    budgets = [t for t in FIT_TOKENS if t is None or base.max_length < t < 2 * most]
    out = []
    for tokens in budgets:
        for spec in FIT_CHECKPOINTING:
            every = lora.checkpoint_every(spec)
            out.append(
                dataclasses.replace(
                    base, micro_batch_tokens=tokens, grad_checkpointing=every > 0, checkpoint_every=max(every, 1)
                )
            )
    return out


def describe_checkpointing(s: Setting) -> str:
    if not s.grad_checkpointing:
        return "none"
    return "all" if s.checkpoint_every == 1 else f"every-{s.checkpoint_every}"


def chosen(s: Setting) -> dict:
    """The chosen layout as a record (a run's config.json `fit_choice`, a planner row's `fit`)."""
    return {"micro_batch_tokens": s.micro_batch_tokens, "checkpointing": describe_checkpointing(s)}


def describe(choice: dict, rows: int) -> str:
    """A chosen layout as the scripts' flags; `rows`: --micro-batch-size, where it has no token budget."""
    tokens = choice["micro_batch_tokens"]
    layout = f"--micro-batch-tokens {tokens}" if tokens else f"{rows} rows"
    return f"{layout} --checkpointing {choice['checkpointing']}"


def fastest(base: Setting, technique: str, mesh: dict[str, int], quant: str) -> dict:
    """The candidates of `base` priced for one experiment: `chosen` (the fastest that fits, its Setting and row, or
    None where none fits: the run keeps its flags), `fits` (how many fit) and `reference` (the row of --micro-batch-size
    rows with every layer checkpointed, None where the experiment refuses it)."""
    rows = []
    for s in candidates(base):
        row = evaluate(s, technique, mesh, quant)
        if "refused" not in row:
            rows.append((s, row))
    fits = [(s, r) for s, r in rows if r["fits"]]
    reference = next(
        (r for c, r in rows if c.micro_batch_tokens is None and c.grad_checkpointing and c.checkpoint_every == 1), None
    )
    chosen = max(fits, key=lambda sr: sr[1]["tokens_per_s"]) if fits else None
    return {"chosen": chosen, "fits": len(fits), "reference": reference}


def applies(s: Setting, technique: str) -> bool:
    """Whether the planner prices this experiment at --fit auto's layout: the command's --fit auto, an experiment that
    fits its layout, and the scripts' packed rows (beyond AMI's examples the planner plans longer data, full rows)."""
    return s.fit and technique in TECHNIQUES and resolve(s, technique).layout == "packed"


def as_run_chooses(s: Setting) -> Setting:
    """The setting a run's --fit auto chooses with (ftkit/fit.py's `setting` builds its own by it): its GPU's
    calibrated host and own link, InfiniBand NDR between nodes, the planner's default efficiency, reserve and answer
    positions; the job and the GPU's memory as the planner's flags give them."""
    return dataclasses.replace(
        s,
        link=hardware.LINKS[s.gpu.link],
        inter_node_link=hardware.LINKS["ib-ndr"],
        mfu=None,
        link_efficiency=0.8,
        reserve_bytes=GIB,
        answer_tokens=256,
        layout="packed",
        host=host_for(s.gpu),
        host_op_s=None,
        steps=None,
        ops_source="tree",
        fit=False,
    )


def row(s: Setting, technique: str, mesh: dict[str, int], quant: str) -> dict:
    """The planner's row for one experiment: at the layout its run's --fit auto chooses where that `applies` (the row
    says which, `fit`), else at the flags' layout (`techniques.evaluate`); without --micro-batch-size, at the script's
    own (OWN_MICRO_BATCH)."""
    if not s.micro_batch_given and technique in OWN_MICRO_BATCH:
        s = dataclasses.replace(s, micro_batch_size=OWN_MICRO_BATCH[technique])
    if not applies(s, technique):
        return evaluate(s, technique, mesh, quant)
    choice = fastest(as_run_chooses(s), technique, mesh, quant)["chosen"]
    if choice is None:  # no layout is predicted to fit: the run keeps its flags' layout
        return {**evaluate(dataclasses.replace(s, fit=False), technique, mesh, quant), "fit": None}
    c = choice[0]
    at = dataclasses.replace(
        s,
        fit=False,
        micro_batch_tokens=c.micro_batch_tokens,
        grad_checkpointing=c.grad_checkpointing,
        checkpoint_every=c.checkpoint_every,
    )
    return {**evaluate(at, technique, mesh, quant), "fit": chosen(c)}
