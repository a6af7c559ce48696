"""The batch layouts: the optimizer steps a layout gives, each as rank 0's micro-batches (rows x width positions
computed), from the AMI training examples' lengths in the scripts' own global batches."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ftkit import batching, data, models
from ftkit.plan.settings import Setting

# The layouts: "auto" (the command's default), each script's own: "packed" where AMI's examples reach --max-length,
# pp-ft's "fixed" there, "full" beyond them (`resolve`); "fixed", one example per row right-padded to --max-length
# (pp-ft's one shape, batching.collate_pipeline); "full", every row --max-length real tokens (the planner's only layout
# before issue 30); "padded", the AMI training examples (AMI_LENGTHS) in the scripts' length-grouped global batches,
# one example per row, each micro-batch right-padded to its longest (--no-packing); "packed", the same global batches
# packed into rows of at most --max-length (batching.pack, first-fit decreasing), --micro-batch-size rows per
# micro-batch as wide as the fullest (batching.packed_width), each rank the same number of micro-steps; "masked",
# "padded" as the scripts ran it until issue 30, the padding mask passed (the H100 runs).
LAYOUTS = ("auto", "full", "padded", "packed", "masked", "fixed")
# The AMI training examples' token counts, per tokenizer: Qwen3's own (`qwen3`: what a Qwen3-4B run, and since issue 42
# a qwen3-4b-shape run, tokenizes; the planner's default) and the tiny tokenizer's (`tiny`: what the committed H100
# runs tokenized, as qwen3-4b-shape did before issue 42, so their batches are rebuilt from it). Written by
# assets/ami_lengths.py; per training example, in the training set's order, the tokens of its prompt and answer without
# the transcript, of its whole transcript, of its answer (with <|im_end|>: the targets), and whether its transcript may
# be cut: the rest of a prompt and its transcript apart, so that the length at any --max-length follows
# data.ChatFormatter's rule (`fit`).
AMI_LENGTHS = {
    models.QWEN3: Path(__file__).parents[1] / "ami_lengths.json",
    models.TINY: Path(__file__).parents[1] / "ami_lengths-tiny.json",
}


def length_row(formatter: data.ChatFormatter, count, ex: data.Example) -> list[int]:
    """One example's row of AMI_LENGTHS; `count(text)` is its number of tokens."""
    before, after = formatter.prompt_parts(ex.query)
    answer = count(ex.answer) + 1
    return [len(before) + len(after) + answer, count(ex.transcript), answer, int(ex.trimmable)]


def fit(row, max_length: int) -> tuple[int, int, bool] | None:
    """(tokens, target tokens, whether its transcript was cut) of an AMI_LENGTHS row as data.ChatFormatter encodes it
    at `max_length`; None where it drops the example (the transcript may not be cut, or no 32 tokens of it fit)."""
    fixed, transcript, answer, trimmable = row
    budget = max_length - fixed
    if budget < min(data.MIN_TRANSCRIPT_TOKENS, transcript) or (transcript > budget and not trimmable):
        return None
    return fixed + min(transcript, budget), answer, transcript > budget


@functools.cache
def ami_rows(tokenizer: str = models.QWEN3) -> tuple[tuple[int, ...], ...]:
    """AMI_LENGTHS[tokenizer]'s rows."""
    return tuple(map(tuple, json.loads(AMI_LENGTHS[tokenizer].read_text())["examples"]))


@functools.cache
def ami_examples(max_length: int, tokenizer: str = models.QWEN3) -> tuple[tuple[int, int], ...]:
    """(tokens, target tokens) of each AMI training example data.ChatFormatter keeps at `max_length`, in order."""
    return tuple(kept[:2] for row in ami_rows(tokenizer) if (kept := fit(row, max_length)) is not None)


@functools.cache
def longest(tokenizer: str = models.QWEN3) -> int:
    """The longest AMI training example, whole, in the tokenizer's tokens (20,632 in Qwen3's)."""
    return max(fixed + transcript for fixed, transcript, _, _ in ami_rows(tokenizer))


def resolve(s: Setting, technique: str | None = None) -> Setting:
    """The setting with "auto" made the layout the technique's script runs (None: the other scripts'): where AMI's
    examples reach --max-length or a token budget packs rows, "packed" (their default), and for pp-ft "fixed" (its
    stages are built for one shape); beyond the longest example, "full": --max-length is then for data longer than
    AMI's examples (whole meetings, cp-ft's), every row --max-length real tokens."""
    if s.layout != "auto":
        return s
    if not (s.micro_batch_tokens or s.max_length <= longest(s.tokenizer)):
        return dataclasses.replace(s, layout="full")
    return dataclasses.replace(s, layout="fixed" if technique == "pp" else "packed")


@dataclass(frozen=True)
class Micro:
    """One micro-batch on one rank: rows x width positions computed, and the positions the lm_head runs at."""

    rows: int
    width: int
    answers: int
    segments: tuple[int, ...] = ()  # a token-budget row's examples: a varlen kernel's attention is over each alone


@dataclass(frozen=True)
class Step:
    micros: tuple[Micro, ...]  # rank 0's (its micro-batches are the widest)
    tokens: int  # real tokens of the global batch
    positions: int  # positions computed, padding included, all ranks


class _Example:
    """A stand-in for data.Encoded that batching.GlobalBatches can sort: its length."""

    def __init__(self, n: int):
        self.input_ids = range(n)


def layout_steps(s: Setting, dp: int) -> tuple[Step, ...]:
    """The optimizer steps the layout gives, each as rank 0's micro-batches: the first `s.steps` (one epoch if None)
    of the scripts' global batches (batching.GlobalBatches at s.seed) for the AMI layouts, one step for "full"."""
    if s.micro_batch_tokens and s.layout != "packed":  # one packed row per micro-batch (cli.check_micro_batch_tokens)
        raise ValueError(f"--micro-batch-tokens packs rows: the packed layout, not {s.layout!r}")
    layout = (s.layout, s.batch_size, s.micro_batch_size, s.micro_batch_tokens, s.max_length)
    return _layout_steps(*layout, s.tokenizer, s.seed, s.steps, dp)


@functools.cache  # the planner prices one layout for every technique and checkpointing the fit tries
def _layout_steps(
    layout: str,
    batch: int,
    m: int,
    tokens: int | None,
    length: int,
    tokenizer: str,
    seed: int,
    steps: int | None,
    dp: int,
) -> tuple[Step, ...]:
    m = 1 if tokens else m
    accum = batching.accumulation_steps(batch, m, dp)
    if layout == "full":
        micro = Micro(m, length, m * length)  # the convention's lm_head at every token
        return (Step((micro,) * accum, batch * length, batch * length),)
    examples = ami_examples(length, tokenizer)
    lengths = [n for n, _ in examples]
    pack_to = (tokens or length) if layout == "packed" else None
    batches = batching.GlobalBatches([_Example(n) for n in lengths], batch, seed, pack_to=pack_to)
    out = []
    for step in range(batches.per_epoch if steps is None else steps):
        rows = batches.rows(step)  # longest first; packed, batching.pack's rows
        per_rank = batches.micro_steps(step, m, dp)
        parts = [rows[j * dp * m : (j * dp + 1) * m] for j in range(per_rank)]  # rank 0's
        if pack_to:  # each micro-batch as wide as its fullest row, rounded up (batching.packed_width)
            micros = tuple(
                Micro(
                    m,
                    batching.packed_width([sum(lengths[i] for i in row) for row in p], pack_to),
                    m * max(sum(examples[i][1] for i in row) for row in p),
                    tuple(lengths[i] for row in p for i in row) if tokens else (),
                )
                for p in parts
            )
            positions = sum(batches.padded_tokens(step, m, r, dp) for r in range(dp))
        else:  # one example per row, as wide as the micro-batch's longest ("fixed": --max-length)
            width = [length if layout == "fixed" else lengths[rows[k * m][0]] for k in range(per_rank * dp)]
            micros = tuple(Micro(m, width[j * dp], m * max(examples[i][1] for [i] in p)) for j, p in enumerate(parts))
            positions = sum(m * w for w in width)
        out.append(Step(micros, sum(lengths[i] for row in rows for i in row), positions))
    return tuple(out)
