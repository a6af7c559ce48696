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
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ftkit.errors import DataError

SPLITS = ("train", "val", "test")
IGNORE_INDEX = -100


# The smallest transcript (in tokens) an example may be trimmed to before it is dropped instead.
MIN_TRANSCRIPT_TOKENS = 32


# QMSum's AMI meetings, shipped in the package (see its README for provenance and licenses): `--data qmsum-ami`.
SHIPPED = "qmsum-ami"


SHIPPED_DIR = Path(__file__).parent / "qmsum-ami"


MEETING_SUFFIXES = (".json", ".json.gz")


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
    answer or the template. (Qwen3's pre-tokenizer joins punctuation with the newlines after it, so where a
    transcript ends in punctuation its prompt holds two tokens where Qwen3's tokenization of the rendered prompt
    holds one: a token of the masked prompt, not of the loss. The tiny tokenizer's pre-tokenizer, GPT-2's, joins
    none.)"""

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


# --task: which kinds of example a run trains and evaluates on.
TASKS = {"all": ("span", "meeting"), "spans": ("span",), "meetings": ("meeting",)}


def task_examples(splits: dict[str, list[Example]], task: str) -> dict[str, list[Example]]:
    """Each split's examples of `task` (TASKS), in their order."""
    return {name: [ex for ex in examples if ex.kind in TASKS[task]] for name, examples in splits.items()}


def corpus(examples: Sequence[Example]) -> list[str]:
    """The distinct texts of some examples, in order: what the tiny tokenizer is trained on."""
    seen = dict.fromkeys(t for ex in examples for t in (ex.transcript, ex.query, ex.answer))
    return list(seen)
