"""How long the AMI examples are: transcripts, queries and answers, per split and kind, in words and in tokens.

    uv run python assets/ami_lengths.py            # prints the table, writes devlogs/runs/data/ami-lengths.json

The data is QMSum's AMI meetings as the package ships them (`ftkit/qmsum-ami`). Tokens are the tiny tokenizer's
(`models.load_tokenizer("tiny", ...)`: a byte-level BPE trained on the training transcripts, as the --smoke runs
build it); Qwen3's own tokenizer is not available offline here, so Qwen3 token counts are not given. Words are
whitespace-separated. A whole-meeting example's transcript is the whole meeting; a span example's is its span.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ftkit import data, models

OUT = Path(__file__).resolve().parents[1] / "devlogs" / "runs" / "data" / "ami-lengths.json"


def describe(values: list[int]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": ordered[0],
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
    }


def main() -> None:
    splits = data.load_splits(data.SHIPPED)
    tokenizer = models.load_tokenizer("tiny", data.corpus(splits["train"]))
    result = {"data": data.SHIPPED, "tokenizer": f"tiny (byte-level BPE, {len(tokenizer)} tokens)", "splits": {}}
    for split, examples in splits.items():
        for kind in ("meeting", "span"):
            chosen = [e for e in examples if e.kind == kind]
            if not chosen:
                continue
            texts = {"transcript": [e.transcript for e in chosen], "answer": [e.answer for e in chosen]}
            result["splits"][f"{split}/{kind}"] = {
                "examples": len(chosen),
                **{
                    f"{field} {unit}": describe([count(t) for t in values])
                    for field, values in texts.items()
                    for unit, count in (
                        ("words", lambda t: len(t.split())),
                        ("tokens", lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"])),
                    )
                },
            }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"AMI (QMSum), {result['tokenizer']}: min / median / p90 / max")
    print("| split / kind | examples | transcript words | transcript tokens | answer words | answer tokens |")
    print("|---|---|---|---|---|---|")
    for name, r in result["splits"].items():
        cells = [" / ".join(f"{v:,.0f}" for v in r[key].values()) for key in list(r)[1:]]
        print(f"| {name} | {r['examples']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
