"""Micro-batches: the run's global batches (a pure function of seed and step, so every rank computes the same one
and a resumed run needs only the step), packing several examples into one row, collating, and the token loss.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

import torch

from ftkit.data import IGNORE_INDEX, Encoded
from ftkit.errors import DataError

# A packed micro-batch is as wide as its fullest row rounded up to a multiple of this (at most --max-length): the
# last rows of a step are part-filled, and a fixed --max-length width made ~18% of the positions padding at the
# reference configuration (devlogs/runs/data/packing-layout.json). A multiple of 64 keeps matmul shapes aligned.
ROW_MULTIPLE = 64


class GlobalBatches:
    """Length-grouped global batches, a pure function of (seed, step).

    Each epoch is a seeded permutation; it is cut into groups of `group` global batches, each group sorted by
    length and cut into batches, and the batches of the epoch shuffled again - so a batch holds sequences of
    similar length (little padding) while the order stays random. The last partial batch of an epoch is
    dropped so every optimizer step sees exactly `batch_size` sequences.

    `pack_to` (--max-length, or --micro-batch-tokens; None with --no-packing) lays each global batch out as packed
    rows of at most that many positions, several examples per row (`pack`, `collate_packed`): the same examples and
    the same loss, fewer micro-steps. A micro-batch is then `micro_batch_size` rows as wide as its fullest one
    (`packed_width`), and a step has as many micro-steps as its rows need: with --micro-batch-tokens N, one row of
    up to N positions, so a step of T real tokens runs about T / N micro-steps. Without it, a row is one example,
    right-padded to the micro-batch's longest.

    `max_segment` (--max-length): the longest example, so the longest segment the varlen kernels are told of
    (`collate_packed`).
    """

    def __init__(
        self,
        data: Sequence[Encoded],
        batch_size: int,
        seed: int,
        group: int = 16,
        pack_to: int | None = None,
        max_segment: int | None = None,
    ):
        if len(data) < batch_size:
            raise DataError(f"only {len(data)} training examples for a global batch of {batch_size}")
        self.data, self.batch_size, self.seed, self.group, self.pack_to = data, batch_size, seed, group, pack_to
        self.max_segment = max_segment or pack_to
        self.per_epoch = len(data) // batch_size
        self._epoch_cache: tuple[int, list[list[int]]] | None = None

    def _epoch(self, epoch: int) -> list[list[int]]:
        if self._epoch_cache and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        rng = random.Random(f"{self.seed}-{epoch}")
        order = list(range(len(self.data)))
        rng.shuffle(order)
        order = order[: self.per_epoch * self.batch_size]
        span = self.group * self.batch_size
        batches = []
        for g in range(0, len(order), span):
            chunk = sorted(order[g : g + span], key=lambda i: (-len(self.data[i].input_ids), i))
            batches += [chunk[b : b + self.batch_size] for b in range(0, len(chunk), self.batch_size)]
        rng.shuffle(batches)
        self._epoch_cache = (epoch, batches)
        return batches

    def indices(self, step: int) -> list[int]:
        """The examples of optimizer step `step` (0-based), longest first."""
        return self._epoch(step // self.per_epoch)[step % self.per_epoch]

    def n_target(self, step: int) -> int:
        """Target (answer) tokens in the whole global batch: the loss denominator on every rank."""
        return sum(self.data[i].n_target for i in self.indices(step))

    def lengths(self, step: int) -> list[int]:
        """Real (non-pad) tokens of each sequence of the global batch: every rank knows them without a collective."""
        return [len(self.data[i].input_ids) for i in self.indices(step)]

    def n_tokens(self, step: int) -> int:
        return sum(self.lengths(step))

    def micro_batches(self, step: int, micro_batch_size: int, rank: int = 0, world: int = 1) -> list[dict]:
        """This rank's micro-batches of step `step`. Micro-step j of rank r takes rows
        [(j*world + r)*m, (j*world + r + 1)*m) of the step's rows - its examples sorted longest first, or the packed
        rows, which `pack` fills longest first - so the ranks' micro-batches at one micro-step are alike and their
        union over ranks and micro-steps is the global batch. Packed, every rank runs the same number of micro-steps
        (a collective in each, for DDP and FSDP), the last ones topped up with empty rows, and every micro-batch is
        [m, width], width its fullest row's rounded up (`packed_width`): the rows' count fixed for the whole run,
        their width a multiple of ROW_MULTIPLE (the compiled layers take it as a dynamic size)."""
        if self.pack_to is None:
            rows = self._micro_rows(step, micro_batch_size, rank, world)
            return [collate([self.data[i] for [i] in mb]) for mb in rows]
        return [
            collate_packed([[self.data[i] for i in row] for row in rows], self._width(rows), self.max_segment)
            for rows in self._micro_rows(step, micro_batch_size, rank, world)
        ]

    def micro_steps(self, step: int, micro_batch_size: int, world: int = 1) -> int:
        """Micro-steps of step `step`, the same on every rank: batch / (micro x ranks) padded, the packed rows'
        share of each rank packed (so it varies from step to step)."""
        if self.pack_to is None:
            return accumulation_steps(self.batch_size, micro_batch_size, world)
        return -(-len(self.rows(step)) // (micro_batch_size * world))

    def rows(self, step: int) -> list[list[int]]:
        """The rows of step `step`: examples (indices) per row. Padded, one example each; packed, `pack`'s rows."""
        if self.pack_to is None:
            return [[i] for i in self.indices(step)]
        return pack(self.indices(step), [len(e.input_ids) for e in self.data], self.pack_to)

    def layout(self, step: int, micro_batch_size: int, rank: int = 0, world: int = 1, multiple: int = 1) -> dict:
        """This rank's micro-steps at step `step`, and the share of the positions they compute that are padding
        (`padded_tokens` positions in all), from the host-side lengths: the metrics rows' `micro_batches` and
        `padding_fraction`."""
        rows = [r for mb in self._micro_rows(step, micro_batch_size, rank, world) for r in mb]
        real = sum(len(self.data[i].input_ids) for row in rows for i in row)
        positions = self.padded_tokens(step, micro_batch_size, rank, world, multiple)
        return {
            "micro_batches": self.micro_steps(step, micro_batch_size, world),
            "padding_fraction": 1 - real / positions,
        }

    def padded_tokens(self, step: int, micro_batch_size: int, rank: int = 0, world: int = 1, multiple: int = 1) -> int:
        """Positions, padding included, of this rank's micro-batches of step `step` as `micro_batches` collates them
        (each right-padded to its longest row, packed to `packed_width`, then to a multiple of `multiple`,
        `pad_to_multiple`): the [micro, seq] extent of the step's activations, known on the host."""
        micro_rows = self._micro_rows(step, micro_batch_size, rank, world)
        return sum(len(mb) * -(-self._width(mb) // multiple) * multiple for mb in micro_rows)

    def _width(self, rows: Sequence[Sequence[int]]) -> int:
        """The positions of a micro-batch of `rows` (examples per row) as collated: padded, its longest example;
        packed, `packed_width` of its rows' real tokens."""
        fills = [sum(len(self.data[i].input_ids) for i in row) for row in rows]
        return max(fills) if self.pack_to is None else packed_width(fills, self.pack_to)

    def _micro_rows(self, step: int, m: int, rank: int, world: int) -> list[list[list[int]]]:
        """Rows (examples per row) of this rank's micro-steps; packed, topped up to m rows with empty ones."""
        rows = self.rows(step)
        parts = [
            rows[(j * world + rank) * m : (j * world + rank + 1) * m] for j in range(self.micro_steps(step, m, world))
        ]
        return parts if self.pack_to is None else [part + [[]] * (m - len(part)) for part in parts]


def accumulation_steps(batch_size: int, micro_batch_size: int, data_parallel: int) -> int:
    per_step = micro_batch_size * data_parallel
    if batch_size % per_step:
        raise DataError(
            f"--batch-size {batch_size} is not a multiple of --micro-batch-size {micro_batch_size} x "
            f"{data_parallel} data-parallel rank(s) = {per_step}; pick a global batch that divides, e.g. "
            f"{max(per_step, batch_size // per_step * per_step)}"
        )
    return batch_size // per_step


def pack(indices: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: the examples `indices` (lengths[i] tokens each, at most `capacity`) laid into as few
    rows of `capacity` positions as it finds, longest first, each into the first row with room. FFD uses at most
    11/9 of the optimal number of rows plus one (Johnson 1973; Dosa 2007 for the tight bound). A pure function of its
    input: every rank packs the same rows."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise DataError(f"an example of {lengths[i]} tokens does not fit a packed row of {capacity}")
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if row is None:
            rows.append([])
            free.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= lengths[i]
    return rows


def packed_width(fills: Sequence[int], pack_to: int) -> int:
    """The width of a packed micro-batch whose rows hold `fills` real tokens: the fullest rounded up to a multiple of
    ROW_MULTIPLE, at most `pack_to` (a row never holds more), at least ROW_MULTIPLE (a micro-batch of empty rows)."""
    return min(pack_to, max(1, -(-max(fills) // ROW_MULTIPLE)) * ROW_MULTIPLE)


def collate_packed(
    rows: Sequence[Sequence[Encoded]], width: int, max_segment: int | None = None, pad_id: int = 0
) -> dict:
    """Packed rows of `width` positions, several examples per row, as `collate` lays out one per row, with
    `position_ids` restarting at 0 at each example (RoPE sees each example at the positions it has alone) and the
    example boundaries worked out here, on the host, for the attention kernels (`attention.model_inputs`):

    - `cu_seq_lens` (int32): the cumulative lengths of the segments of the rows flattened into one sequence, each
      example and each padding run its own segment (FlashAttention-2's varlen layout);
    - `packed`: whether some row holds two examples or more (else every row is plain causal: one example, then a
      padding tail whose positions continue the example's, so no kernel needs a mask for it);
    - `max_segment`, where given: a bound on every segment the varlen kernels may size their grid by (the longest an
      example can be, the same for every micro-batch, so a compiled layer sees one constant); a padding run longer
      than it is cut into segments of at most that many. Without it, the kernels take the row width.

    The loss positions are each example's own (`collate`'s), so no example's first token is trained to follow the
    previous one. An empty row (a rank's last micro-step topped up) is all padding and has no target.

    `lengths` are the examples' real tokens (not the rows'): attention's cost is per example."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    positions: list[list[int]] = []
    targets_of: list[list[int]] = []
    cu_seq_lens = [0]
    cap = min(width, max_segment or width)
    for r, row in enumerate(rows):
        start, pos, tgt = 0, [], []
        for e in row:
            n = len(e.input_ids)
            ids[r, start : start + n] = torch.tensor(e.input_ids)
            labels[r, start : start + n] = torch.tensor(e.labels)
            position_ids[r, start : start + n] = torch.arange(n)
            pos += [start + p for p in range(n - 1) if e.labels[p + 1] != IGNORE_INDEX]
            tgt += [e.labels[p + 1] for p in range(n - 1) if e.labels[p + 1] != IGNORE_INDEX]
            start += n
            cu_seq_lens.append(r * width + start)
        last = len(row[-1].input_ids) if row else 0
        position_ids[r, start:] = torch.arange(last, last + width - start)  # the padding tail continues the last one
        cu_seq_lens += range(r * width + start + cap, (r + 1) * width, cap)  # a long padding run, cut to `cap`
        if start < width:
            cu_seq_lens.append((r + 1) * width)
        positions.append(pos)
        targets_of.append(tgt)
    k = max(1, max(len(p) for p in positions))
    logit_positions = torch.zeros((len(rows), k), dtype=torch.long)
    targets = torch.full((len(rows), k), IGNORE_INDEX, dtype=torch.long)
    for r, (pos, tgt) in enumerate(zip(positions, targets_of)):
        logit_positions[r, : len(pos)] = torch.tensor(pos, dtype=torch.long)
        targets[r, : len(tgt)] = torch.tensor(tgt, dtype=torch.long)
    return {
        "input_ids": ids,
        "position_ids": position_ids,
        "labels": labels,
        "logit_positions": logit_positions,
        "targets": targets,
        "lengths": [len(e.input_ids) for row in rows for e in row],
        "cu_seq_lens": torch.tensor(cu_seq_lens, dtype=torch.int32),
        "packed": any(len(row) > 1 for row in rows),
        **({"max_segment": max_segment} if max_segment else {}),
    }


def collate(items: Sequence[Encoded], pad_id: int = 0) -> dict:
    """Right-padded tensors (padding masked out of attention and of the labels), and what the loss needs,
    worked out here on the host so that the training step never has to ask the GPU:

    - `lengths`: real tokens per row, Python ints (for the token and FLOP counts);
    - `logit_positions` [rows, k]: the positions whose next token is a target (k = the most targets in a row),
      short rows padded with position 0;
    - `targets` [rows, k]: those next tokens, IGNORE_INDEX where padded.

    The lm_head then runs on the answer positions only (`logits_to_keep=logit_positions`): with Qwen3's 151,936-
    word vocabulary, logits for every position of a 2 x 2048 micro-batch are 2.5 GB in fp32, and all but the
    answer's few hundred positions would be thrown away by the loss."""
    width = max(len(e.input_ids) for e in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    positions = [[p for p in range(len(e.labels) - 1) if e.labels[p + 1] != IGNORE_INDEX] for e in items]
    k = max(1, max(len(p) for p in positions))
    logit_positions = torch.zeros((len(items), k), dtype=torch.long)
    targets = torch.full((len(items), k), IGNORE_INDEX, dtype=torch.long)
    for row, (e, pos) in enumerate(zip(items, positions)):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
        logit_positions[row, : len(pos)] = torch.tensor(pos, dtype=torch.long)
        targets[row, : len(pos)] = torch.tensor([e.labels[p + 1] for p in pos], dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "logit_positions": logit_positions,
        "targets": targets,
        "lengths": [len(e.input_ids) for e in items],
    }


def pad_to_multiple(mb: dict, multiple: int) -> dict:
    """A collated micro-batch right-padded so that its sequence length is a multiple of `multiple`. The padding
    comes after every real token (causal attention never reaches it) and out of the loss (label -100): a step on
    it is unchanged."""
    extra = -mb["input_ids"].shape[1] % multiple
    if extra == 0:
        return mb
    # The [rows, seq] tensors; the rest as is. Padding positions 0: each pad a block of its own in a packed row.
    fill = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX, "position_ids": 0}
    padded = {k: torch.nn.functional.pad(v, (0, extra), value=fill[k]) if k in fill else v for k, v in mb.items()}
    if "cu_seq_lens" in mb:  # each row's segments at its new offset, then the new padding run: a segment of its own
        rows, width = mb["input_ids"].shape
        cu = [0]
        for r in range(rows):
            ends = [int(b) - r * width for b in mb["cu_seq_lens"][1:] if r * width < b <= (r + 1) * width]
            cu += [r * (width + extra) + e for e in ends] + [(r + 1) * (width + extra)]
        padded["cu_seq_lens"] = torch.tensor(cu, dtype=torch.int32)
    return padded


# Why pp-ft lays its batches out padded (`cli.padded_only` says it once, and its summary keeps it).
PIPELINE_PADDED_WHY = (
    "pp-ft runs padded batches (one example per row), not packed ones: its schedule is built for a fixed number of "
    "micro-batches per step, and a packed step has as many as its rows need"
)


def collate_pipeline(items: Sequence[Encoded], width: int, rows: int | None = None) -> dict:
    """A pipeline's batch (experiments/pp-ft), which the schedule cuts into its micro-batches along dim 0: the
    input ids right-padded to `width` (--max-length), the one shape its stages are built for, and a `target` that
    packs, per row, the positions whose logits the loss needs and the tokens they predict ([rows, 2, k]), so that
    the schedule cuts both with the inputs. `rows`: filled up to that many rows with copies of the last item that
    have no target tokens (the eval's last group)."""
    n = len(items)
    mb = collate(list(items) + [items[-1]] * ((rows or n) - n))
    batch = {
        "input_ids": torch.nn.functional.pad(mb["input_ids"], (0, width - mb["input_ids"].shape[1])),
        "target": torch.stack([mb["logit_positions"], mb["targets"]], dim=1),
    }
    batch["target"][n:, 1] = IGNORE_INDEX
    return batch


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device` (Python values as they are). On CUDA the copy goes from pinned memory
    with non_blocking=True: a copy from pageable memory makes the host wait for it."""
    if device.type != "cuda":
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return {
        k: v.pin_memory().to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of cross-entropy over target tokens, in fp32. `logits` [rows, k, vocab] are the model's
    logits at a batch's `logit_positions` and `targets` [rows, k] the tokens that follow them (see `collate`).
    Divided by the target tokens of the whole global batch, the sum makes every split of the batch (micro-steps,
    ranks, stages) give the same gradient as one big batch."""
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def global_batches(args: argparse.Namespace, train_set: list):
    """The run's global batches (`batching.GlobalBatches`, a function of --seed and the step): packed into rows of
    --max-length (of --micro-batch-tokens, one row per micro-batch, where given), or one padded example per row
    with --no-packing."""
    pack_to = (getattr(args, "micro_batch_tokens", None) or args.max_length) if args.packing else None
    return GlobalBatches(train_set, args.batch_size, args.seed, pack_to=pack_to, max_segment=args.max_length)
