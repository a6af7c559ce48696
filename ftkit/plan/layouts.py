"""The batch layouts: the optimizer steps a layout gives, each as rank 0's micro-batches (rows x width positions
computed), from the AMI training examples' lengths in the scripts' own global batches."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ftkit import batching, data, models
from ftkit.plan.settings import Setting

# The layouts: "full", every row --max-length real tokens (the planner's upper bound before issue 30); "padded", the
# AMI training examples (AMI_LENGTHS) in the scripts' length-grouped global batches, one example per row, each
# micro-batch right-padded to its longest (--no-packing); "packed", the same global batches packed into rows of
# at most --max-length (batching.pack, first-fit decreasing), --micro-batch-size rows per micro-batch as wide as the
# fullest (batching.packed_width), each rank the same number of micro-steps; "masked", "padded" as the scripts ran it
# until issue 30, the padding mask passed (the H100 runs).
LAYOUTS = ("full", "padded", "packed", "masked")
# The AMI training examples' token counts (the tiny tokenizer the qwen3-4b-shape runs use; Qwen3's own is not
# available offline): written by `write_ami_lengths`, the rest of a prompt and its transcript apart, so that the
# length at any --max-length follows data.ChatFormatter's rule.
AMI_LENGTHS = Path(__file__).parents[1] / "ami_lengths.json"


def write_ami_lengths(path: Path = AMI_LENGTHS) -> None:
    """AMI_LENGTHS from the shipped data: per training example, in the training set's order, the tokens of its prompt
    and answer without the transcript, of its whole transcript, of its answer (with <|im_end|>: the targets), and
    whether its transcript may be cut.
    `uv run python -c "from ftkit.plan import layouts; layouts.write_ami_lengths()"`."""
    splits = data.load_splits(data.SHIPPED)
    tokenizer = models.load_tokenizer(models.QWEN3_4B_SHAPE, data.corpus(splits["train"]))
    formatter = data.ChatFormatter(tokenizer, max_length=0)

    def n(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rows = []
    for ex in splits["train"]:
        before, after = formatter.prompt_parts(ex.query)
        answer = n(ex.answer) + 1
        rows.append([len(before) + len(after) + answer, n(ex.transcript), answer, int(ex.trimmable)])
    text = json.dumps(
        {
            "data": data.SHIPPED,
            "split": "train",
            "tokenizer": f"tiny (byte-level BPE, {len(tokenizer)} tokens; models.load_tokenizer('qwen3-4b-shape'))",
            "fields": ["prompt and answer without the transcript", "transcript", "answer with <|im_end|>", "trimmable"],
            "examples": rows,
        }
    )
    path.write_text(text.replace("], [", "],\n[") + "\n")


@functools.cache
def ami_examples(max_length: int) -> tuple[tuple[int, int], ...]:
    """(tokens, target tokens) of each AMI training example data.ChatFormatter keeps at `max_length`, in order: the
    transcript cut to fit where it may be, the example dropped where it may not or where no 32 tokens of it fit."""
    out = []
    for fixed, transcript, answer, trimmable in json.loads(AMI_LENGTHS.read_text())["examples"]:
        budget = max_length - fixed
        if budget < min(data.MIN_TRANSCRIPT_TOKENS, transcript) or (transcript > budget and not trimmable):
            continue
        out.append((fixed + min(transcript, budget), answer))
    return tuple(out)


@dataclass(frozen=True)
class Micro:
    """One micro-batch on one rank: rows x width positions computed, and the positions the lm_head runs at."""

    rows: int
    width: int
    answers: int


@dataclass(frozen=True)
class Step:
    micros: tuple[Micro, ...]  # rank 0's (its micro-batches are the widest)
    tokens: int  # real tokens of the global batch
    positions: int  # positions computed, padding included, all ranks


class _Example:
    """A stand-in for data.Encoded that batching.GlobalBatches can sort: its length."""

    def __init__(self, n: int):
        self.input_ids = range(n)


def layout_steps(s: Setting, dp: int) -> list[Step]:
    """The optimizer steps the layout gives, each as rank 0's micro-batches: the first `s.steps` (one epoch if None)
    of the scripts' global batches (batching.GlobalBatches at s.seed) for the AMI layouts, one step for "full"."""
    m, length = s.micro_batch_size, s.max_length
    accum = batching.accumulation_steps(s.batch_size, m, dp)
    if s.layout == "full":
        micro = Micro(m, length, m * length)  # the convention's lm_head at every token
        return [Step((micro,) * accum, s.batch_size * length, s.batch_size * length)]
    examples = ami_examples(length)
    lengths = [n for n, _ in examples]
    pack_to = length if s.layout == "packed" else None
    batches = batching.GlobalBatches([_Example(n) for n in lengths], s.batch_size, s.seed, pack_to=pack_to)
    out = []
    for step in range(batches.per_epoch if s.steps is None else s.steps):
        rows = batches.rows(step)  # longest first; packed, batching.pack's rows
        per_rank = batches.micro_steps(step, m, dp)
        parts = [rows[j * dp * m : (j * dp + 1) * m] for j in range(per_rank)]  # rank 0's
        if pack_to:  # each micro-batch as wide as its fullest row, rounded up (batching.packed_width)
            micros = tuple(
                Micro(
                    m,
                    batching.packed_width([sum(lengths[i] for i in row) for row in p], length),
                    m * max(sum(examples[i][1] for i in row) for row in p),
                )
                for p in parts
            )
            positions = sum(batches.padded_tokens(step, m, r, dp) for r in range(dp))
        else:
            micros = tuple(Micro(m, lengths[p[0][0]], m * max(examples[i][1] for [i] in p)) for p in parts)
            positions = sum(m * lengths[rows[k * m][0]] for k in range(per_rank * dp))
        out.append(Step(micros, sum(lengths[i] for row in rows for i in row), positions))
    return out
