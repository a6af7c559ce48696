"""AMI meeting data: loading, splitting by meeting, Qwen3 chat formatting, masking, trimming and batching.

Two sources give the same `Example`s:
- a QMSum-format folder (`train/ val/ test/` of per-meeting JSON, plain or gzipped; QMSum, Zhong et al. 2021,
  arXiv 2104.05938), which yields span-level query -> answer pairs and the whole-meeting summary. The package
  ships QMSum's 137 AMI meetings in this format (`ftkit/qmsum-ami/`, named `qmsum-ami`), the default data;
- a Hugging Face hub dataset of whole-meeting (transcript, summary) rows, read through `datasets`.

Batches are a pure function of (seed, step): every rank computes the same global batch and takes its own
slice, so the global batch is the same for any number of ranks and a resumed run needs only the step.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

SPLITS = ("train", "val", "test")
IGNORE_INDEX = -100
# The smallest transcript (in tokens) an example may be trimmed to before it is dropped instead.
MIN_TRANSCRIPT_TOKENS = 32
# QMSum's AMI meetings, shipped in the package (see its README for provenance and licenses): `--data qmsum-ami`.
SHIPPED = "qmsum-ami"
SHIPPED_DIR = Path(__file__).parent / "qmsum-ami"
MEETING_SUFFIXES = (".json", ".json.gz")
# A packed micro-batch is as wide as its fullest row rounded up to a multiple of this (at most --max-length): the
# last rows of a step are part-filled, and a fixed --max-length width made ~18% of the positions padding at the
# reference configuration (devlogs/runs/data/packing-layout.json). A multiple of 64 keeps matmul shapes aligned.
ROW_MULTIPLE = 64


class DataError(ValueError):
    """The data given cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Example:
    meeting_id: str
    kind: str  # "span": a span-level query; "meeting": the whole-meeting summary
    query: str
    transcript: str
    answer: str
    # Whole-meeting summaries from QMSum are kept only where the whole transcript fits: a summary of the
    # whole meeting trained against its first tenth teaches the model to invent the rest.
    trimmable: bool = True


# ---------------------------------------------------------------------------------------------- loading


def _turns_text(turns: Sequence[dict]) -> str:
    return "\n".join(f"{t['speaker']}: {t['content'].strip()}" for t in turns)


def meeting_id(path: Path) -> str:
    """`ES2002a` for `ES2002a.json` and `ES2002a.json.gz`."""
    return path.name.removesuffix(".gz").removesuffix(".json")


def read_meeting_file(path: str | os.PathLike) -> list[Example]:
    """Examples of one QMSum meeting file (`.json`, or `.json.gz` as shipped); a malformed file raises DataError
    naming the file and the field."""
    path = Path(path)
    mid = meeting_id(path)
    try:
        raw = path.read_bytes()
        meeting = json.loads((gzip.decompress(raw) if path.name.endswith(".gz") else raw).decode("utf-8"))
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable JSON meeting file ({type(e).__name__}: {e})") from e
    try:
        turns = meeting["meeting_transcripts"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{path}: 'meeting_transcripts' must be a non-empty list of turns")
        for t in turns:
            if not isinstance(t.get("speaker"), str) or not isinstance(t.get("content"), str):
                raise DataError(f"{path}: every turn needs string 'speaker' and 'content'")
        examples = []
        for q in meeting.get("specific_query_list", []):
            spans = []
            for start, end in q["relevant_text_span"]:
                a, b = int(start), int(end)
                if not 0 <= a <= b < len(turns):
                    raise DataError(f"{path}: span [{start}, {end}] outside the {len(turns)} turns")
                spans.append(_turns_text(turns[a : b + 1]))
            examples.append(Example(mid, "span", q["query"].strip(), "\n...\n".join(spans), q["answer"].strip()))
        whole = _turns_text(turns)
        for q in meeting.get("general_query_list", []):
            examples.append(Example(mid, "meeting", q["query"].strip(), whole, q["answer"].strip(), trimmable=False))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: not in QMSum's meeting format ({type(e).__name__}: {e})") from e
    if not examples:
        raise DataError(f"{path}: no query in 'specific_query_list' or 'general_query_list'")
    return examples


def load_qmsum_folder(root: str | os.PathLike) -> dict[str, list[Example]]:
    """`root/{train,val,test}/*.json` (or `*.json.gz`); QMSum's own split is by meeting, and that is checked."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(
            f"data folder {root} does not exist. Leave --data out for the AMI meetings the package ships "
            f"({SHIPPED}), or pass a QMSum-format folder (train/ val/ test/ of meeting JSON, e.g. a clone of "
            "QMSum's data/Product) or a hub dataset id (owner/name)."
        )
    missing = [s for s in SPLITS if not (root / s).is_dir()]
    if missing:
        raise DataError(f"data folder {root} has no {'/, '.join(missing)}/ subfolder: expected train/ val/ test/")
    splits = {}
    for split in SPLITS:
        files = sorted(f for f in (root / split).iterdir() if f.name.endswith(MEETING_SUFFIXES))
        if not files:
            raise DataError(f"{root / split} holds no meeting .json (or .json.gz) files")
        # e.g. after `gunzip -k` beside the shipped files: those meetings would be counted twice.
        twice = sorted(i for i, n in Counter(meeting_id(f) for f in files).items() if n > 1)
        if twice:
            raise DataError(f"{root / split}: meeting(s) {', '.join(twice)} found as both .json and .json.gz")
        splits[split] = [ex for f in files for ex in read_meeting_file(f)]
    check_split_by_meeting(splits)
    return splits


# Column names of the hub's AMI summarization datasets (whole meetings): the first that exists is used.
TRANSCRIPT_COLUMNS = ("transcript", "dialogue", "dialog", "text", "document", "meeting", "input")
SUMMARY_COLUMNS = ("summary", "abstract", "abstractive_summary", "target", "output")
ID_COLUMNS = ("meeting_id", "id", "meeting", "name")
HUB_SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val", "valid", "dev"), "test": ("test",)}


def _pick(columns: Iterable[str], candidates: Sequence[str], what: str, source: str) -> str:
    columns = list(columns)
    for c in candidates:
        if c in columns:
            return c
    raise DataError(f"{source}: no {what} column (looked for {', '.join(candidates)}; it has {', '.join(columns)})")


def rows_to_examples(rows, source: str, id_prefix: str) -> list[Example]:
    """Whole-meeting rows (a `datasets.Dataset` or a list of dicts) -> examples; the transcript may be trimmed,
    since these datasets have nothing shorter to learn from."""
    columns = rows.column_names if hasattr(rows, "column_names") else list(rows[0].keys()) if rows else []
    tcol = _pick(columns, TRANSCRIPT_COLUMNS, "transcript", source)
    scol = _pick(columns, SUMMARY_COLUMNS, "summary", source)
    icol = next((c for c in ID_COLUMNS if c in columns and c != tcol), None)
    examples = []
    for i, row in enumerate(rows):
        transcript, summary = row[tcol], row[scol]
        if not isinstance(transcript, str) or not isinstance(summary, str):
            raise DataError(f"{source}: row {i}: transcript and summary must be strings")
        meeting_id = str(row[icol]) if icol else f"{id_prefix}-{i}"
        examples.append(Example(meeting_id, "meeting", "Summarize the whole meeting.", transcript, summary))
    return examples


def split_for_meeting(meeting_id: str, val_fraction: float = 0.1, test_fraction: float = 0.1) -> str:
    """A stable split from a hash of the meeting id, for datasets that come as one split."""
    u = int(hashlib.sha256(meeting_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "test" if u < test_fraction else "val" if u < test_fraction + val_fraction else "train"


def hub_dataset_to_splits(dataset_dict, source: str) -> dict[str, list[Example]]:
    """A `datasets.DatasetDict` -> our splits: the dataset's own splits where it has them, else by meeting hash."""
    names = list(dataset_dict.keys())
    splits: dict[str, list[Example]] = {}
    for ours, theirs in HUB_SPLIT_NAMES.items():
        name = next((n for n in theirs if n in names), None)
        if name is not None:
            splits[ours] = rows_to_examples(dataset_dict[name], f"{source}[{name}]", f"{source}:{name}")
    if set(splits) != set(SPLITS):
        pool = [ex for name in names for ex in rows_to_examples(dataset_dict[name], source, f"{source}:{name}")]
        splits = {s: [ex for ex in pool if split_for_meeting(ex.meeting_id) == s] for s in SPLITS}
    check_split_by_meeting(splits)
    return splits


def load_hub(dataset_id: str, revision: str | None = None) -> dict[str, list[Example]]:
    """AMI from the hub, e.g. `TalTechNLP/AMIsum` with revision `refs/convert/parquet` (its main branch holds a
    loading script, which `datasets` no longer runs) or `knkarthick/AMI` (public); `owner/name:config` picks a
    config. HF_TOKEN, where set, is passed on (for a private or gated copy). Needs network access to the hub."""
    import datasets

    name, _, config = dataset_id.partition(":")
    try:
        dd = datasets.load_dataset(name, config or None, revision=revision, token=os.environ.get("HF_TOKEN"))
    except Exception as e:
        raise DataError(
            f"could not load hub dataset {dataset_id!r} (revision {revision}): {type(e).__name__}: {e}. "
            f"Without hub access, leave --data out for the AMI meetings the package ships ({SHIPPED}), "
            "or pass a local QMSum-format folder."
        ) from e
    return hub_dataset_to_splits(dd, dataset_id)


def load_splits(data: str, revision: str | None = None) -> dict[str, list[Example]]:
    """`data` is `qmsum-ami` (the shipped meetings), a local folder (QMSum format) or, if no such path exists and it
    looks like `owner/name`, a hub dataset id."""
    if data == SHIPPED:  # the name, wherever the command runs; a local folder of that name is `./qmsum-ami`
        return load_qmsum_folder(SHIPPED_DIR)
    path = Path(data).expanduser()
    if path.exists() or data.startswith((".", "/", "~")) or data.partition(":")[0].count("/") != 1:
        return load_qmsum_folder(path)
    return load_hub(data, revision)


def check_split_by_meeting(splits: dict[str, list[Example]]) -> None:
    seen: dict[str, str] = {}
    for split, examples in splits.items():
        for ex in examples:
            other = seen.setdefault(ex.meeting_id, split)
            if other != split:
                raise DataError(f"meeting {ex.meeting_id} is in both {other} and {split}: splits must be by meeting")


# ------------------------------------------------------------------------------- formatting and masking


def user_message(transcript: str, query: str) -> str:
    return f"Meeting transcript:\n{transcript}\n\n{query}"


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]  # IGNORE_INDEX on the prompt: the loss is on the answer and its <|im_end|> only
    trimmed: bool

    @property
    def n_target(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


@dataclass
class EncodeStats:
    examples: int = 0
    kept: int = 0
    trimmed: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "examples": self.examples,
            "kept": self.kept,
            "trimmed": self.trimmed,
            "dropped": self.dropped,
        }

    def describe(self) -> str:
        drops = ", ".join(f"{n} {why}" for why, n in self.dropped.items()) or "none"
        return f"{self.kept}/{self.examples} examples kept, {self.trimmed} with a trimmed transcript; dropped: {drops}"


class ChatFormatter:
    """Qwen3's chat format with thinking switched off: the user turn holds the transcript and the query, the
    assistant turn the answer. The prompt is rendered by the tokenizer's own chat template
    (`enable_thinking=False`, which renders Qwen3's empty think block), so the base model sees the format it was
    tuned on. The transcript is tokenized as its own segment so it can be cut to fit without touching the
    answer or the template."""

    SENTINEL = "\x00TRANSCRIPT\x00"

    def __init__(self, tokenizer, max_length: int):
        self.tok = tokenizer
        self.max_length = max_length
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if self.eos_id is None or self.eos_id == tokenizer.unk_token_id:
            raise DataError("tokenizer has no <|im_end|> token: it is not a Qwen3 chat tokenizer")

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_parts(self, query: str) -> tuple[list[int], list[int]]:
        """Token ids of the prompt before and after the transcript."""
        rendered = self.tok.apply_chat_template(
            [{"role": "user", "content": user_message(self.SENTINEL, query)}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        before, after = rendered.split(self.SENTINEL)
        return self._ids(before), self._ids(after)

    def transcript_ids(self, text: str, budget: int) -> list[int]:
        """The first `budget` + 1 token ids of `text` (all of them if it has fewer): enough to cut it to `budget`
        tokens and to know whether it was cut, without tokenizing a whole meeting (up to 83k characters) to keep
        a few thousand. A prefix that ends on a non-space character followed by a space tokenizes to the first
        tokens of the whole text: Qwen's (and GPT-2's) byte-level pre-tokenizer never puts a non-space character
        and the space after it in one piece, and BPE merges within pieces only. The prefix grows until it holds
        more than `budget` tokens. (tests/test_data.py checks this against whole-text tokenization.)"""
        chars = 8 * (budget + 1)
        while chars < len(text):
            cut = text.rfind(" ", 0, chars)
            while cut > 0 and text[cut - 1].isspace():
                cut = text.rfind(" ", 0, cut - 1)
            if cut > 0:
                ids = self._ids(text[:cut])
                if len(ids) > budget:
                    return ids[: budget + 1]
            chars *= 2
        return self._ids(text)[: budget + 1]

    def prompt_ids(self, ex: Example, reserve: int) -> list[int] | None:
        """The prompt, its transcript cut to leave `reserve` tokens for the answer (None if it cannot fit)."""
        before, after = self.prompt_parts(ex.query)
        budget = self.max_length - len(before) - len(after) - reserve
        transcript = self.transcript_ids(ex.transcript, max(budget, 0))
        if budget < min(MIN_TRANSCRIPT_TOKENS, len(transcript)) or (len(transcript) > budget and not ex.trimmable):
            return None
        return before + transcript[:budget] + after

    def encode(self, ex: Example) -> tuple[Encoded | None, str | None]:
        """(Encoded, None) or (None, why it was dropped)."""
        answer = self._ids(ex.answer) + [self.eos_id]
        before, after = self.prompt_parts(ex.query)
        budget = self.max_length - len(before) - len(after) - len(answer)
        transcript = self.transcript_ids(ex.transcript, max(budget, 0))
        if budget < min(MIN_TRANSCRIPT_TOKENS, len(transcript)):
            return None, "answer too long for --max-length"
        if len(transcript) > budget and not ex.trimmable:
            return None, "whole meeting longer than --max-length"
        prompt = before + transcript[:budget] + after
        return Encoded(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer, len(transcript) > budget), None

    def encode_all(self, examples: Sequence[Example]) -> tuple[list[Encoded], EncodeStats]:
        stats = EncodeStats(examples=len(examples))
        out = []
        for ex in examples:
            enc, why = self.encode(ex)
            if enc is None:
                stats.dropped[why] = stats.dropped.get(why, 0) + 1
                continue
            stats.kept += 1
            stats.trimmed += enc.trimmed
            out.append(enc)
        return out, stats


# -------------------------------------------------------------------------------------------- batching


class GlobalBatches:
    """Length-grouped global batches, a pure function of (seed, step).

    Each epoch is a seeded permutation; it is cut into groups of `group` global batches, each group sorted by
    length and cut into batches, and the batches of the epoch shuffled again - so a batch holds sequences of
    similar length (little padding) while the order stays random. The last partial batch of an epoch is
    dropped so every optimizer step sees exactly `batch_size` sequences.

    `pack_to` (--max-length; None with --no-packing) lays each global batch out as packed rows of at most that many
    positions, several examples per row (`pack`, `collate_packed`): the same examples and the same loss, fewer
    micro-steps. A micro-batch is then `micro_batch_size` rows as wide as its fullest one (`packed_width`), and a
    step has as many micro-steps as its rows need. Without it, a row is one example, right-padded to the
    micro-batch's longest.
    """

    def __init__(
        self, data: Sequence[Encoded], batch_size: int, seed: int, group: int = 16, pack_to: int | None = None
    ):
        if len(data) < batch_size:
            raise DataError(f"only {len(data)} training examples for a global batch of {batch_size}")
        self.data, self.batch_size, self.seed, self.group, self.pack_to = data, batch_size, seed, group, pack_to
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
            collate_packed([[self.data[i] for i in row] for row in rows], self._width(rows))
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


def collate_packed(rows: Sequence[Sequence[Encoded]], width: int, pad_id: int = 0) -> dict:
    """Packed rows of `width` positions, several examples per row, as `collate` lays out one per row, with
    `position_ids` restarting at 0 at each example (and at the padding that ends a row) and no attention mask:
    given `position_ids` and no mask and no KV cache, transformers builds a block-diagonal causal mask from the
    position restarts (`masking_utils.find_packed_sequence_indices`), so no example attends to another, and RoPE
    sees each example at the positions it has alone. The loss positions are each example's own (`collate`'s), so
    no example's first token is trained to follow the previous one. An empty row (a rank's last micro-step topped
    up) is all padding and has no target.

    `lengths` are the examples' real tokens (not the rows'): attention's cost is per example."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    positions: list[list[int]] = []
    targets_of: list[list[int]] = []
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
        position_ids[r, start:] = torch.arange(width - start)
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
    }


def collate(items: Sequence[Encoded], pad_id: int = 0) -> dict:
    """Right-padded tensors (padding masked out of attention and of the labels), and what the loss needs,
    worked out here on the host so that the training step never has to ask the GPU:

    - `lengths`: real tokens per row, Python ints (for the token and FLOP counts);
    - `logit_positions` [rows, k]: the positions whose next token is a target (k = the most targets in a row),
      short rows padded with position 0;
    - `targets` [rows, k]: those next tokens, IGNORE_INDEX where padded.

    The lm_head then runs on the answer positions only (`logits_to_keep=logit_positions`): with Qwen3's 151,936-
    word vocabulary, logits for every position of a 2 x 2048 micro-batch are 1.2 GB in fp32, and all but the
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
    return {k: torch.nn.functional.pad(v, (0, extra), value=fill[k]) if k in fill else v for k, v in mb.items()}


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


def corpus(examples: Sequence[Example]) -> list[str]:
    """The distinct texts of some examples, in order: what the tiny tokenizer is trained on."""
    seen = dict.fromkeys(t for ex in examples for t in (ex.transcript, ex.query, ex.answer))
    return list(seen)
