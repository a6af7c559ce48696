"""How long the shipped AMI examples are, in Qwen3's tokens (assets/ami_lengths.py): the committed counts are what the
script gives (devlogs/runs/data/ami-lengths.json, and ftkit/ami_lengths.json, the planner's per-example counts); the
summary's training-set figures are the per-example counts' (for the tiny tokenizer's files too, which the committed
H100 runs tokenized); and what the posts, devlogs and READMEs say of the data is the summary's."""

from __future__ import annotations

import json
import runpy

import pytest
from conftest import ROOT

from ftkit import models
from ftkit.plan import layouts

SCRIPT = runpy.run_path(str(ROOT / "assets" / "ami_lengths.py"))  # not as __main__: nothing written


def committed(tokenizer: str) -> tuple[dict, dict]:
    return tuple(json.loads(path.read_text()) for path in SCRIPT["outputs"](tokenizer))


def test_the_committed_counts_are_qwen3s_of_the_shipped_data():
    """Every text of the shipped data tokenized by Qwen3's tokenizer, once (~10 s on 2 cores)."""
    summary, per_example = SCRIPT["main"](models.QWEN3)
    assert (summary, per_example) == committed(models.QWEN3)
    assert summary["tokenizer"] == "qwen3 (151,669 tokens)"


@pytest.mark.parametrize("tokenizer", list(layouts.AMI_LENGTHS))
def test_the_summarys_training_set_is_the_per_example_counts(tokenizer):
    """What --max-length keeps, trims and drops, and the answer fraction: data.ChatFormatter's rule (`layouts.fit`,
    which tests/test_packing.py holds to the formatter's own encoding at 2,048) on the per-example counts; the whole
    meetings' lengths are the counts' transcripts that may not be cut."""
    summary, per_example = committed(tokenizer)
    rows = per_example["examples"]
    assert rows == [list(row) for row in layouts.ami_rows(tokenizer)]
    meetings = [row for row in rows if not row[3]]
    spans = [row for row in rows if row[3]]
    for length, tasks in summary["train at --max-length"].items():
        for task, chosen in (("all", rows), ("spans", spans), ("meetings", meetings)):
            assert tasks[task] == SCRIPT["at_length"](chosen, int(length)), (tokenizer, length, task)
    train = summary["splits"]["train/meeting"]
    assert train["examples"] == len(meetings) == 97
    assert train["transcript tokens"] == SCRIPT["describe"]([row[1] for row in meetings])


def flat(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def says(path: str, *quoted: str) -> None:
    text = flat(path)
    for q in quoted:
        assert q in text, (path, q)


def hundreds(n: float) -> str:
    return f"{round(n, -2):,.0f}"


def test_the_docs_state_the_shipped_data_in_qwen3s_tokens():
    """The README, the memory and CP posts and the single-GPU and cp-ft devlogs, on the training split: examples kept,
    trimmed and dropped at 2,048 (and at cp-ft's lengths), the whole meetings' lengths, the answer fraction; and the
    tiny tokenizer's counts where they are compared."""
    summary, per_example = committed(models.QWEN3)
    tiny, tiny_rows = committed(models.TINY)
    at, tiny_at = summary["train at --max-length"], tiny["train at --max-length"]
    a, m = at["2048"]["all"], at["2048"]["meetings"]
    t = tiny_at["2048"]["all"]
    meetings = summary["splits"]["train/meeting"]["transcript tokens"]
    words = summary["splits"]["train/meeting"]["transcript words"]
    tiny_meetings = tiny["splits"]["train/meeting"]["transcript tokens"]
    assert (m["kept"], m["dropped"] + m["kept"], a["dropped"]) == (1, 97, m["dropped"])  # every drop a whole meeting
    kept = f"{a['kept']} of its {a['examples']} examples, {a['trimmed']} of them with a trimmed transcript, and drops"
    span = f"{meetings['min']:,.0f}-{meetings['max']:,.0f} tokens"
    says(
        "README.md",
        f"{kept} {a['dropped']}, the whole-meeting summaries of {m['dropped']} of its {m['examples']} meetings",
        f"answers are {a['answer_fraction']:.1%} of the kept tokens",
        f"The tiny tokenizer, which counted them before, trimmed {t['trimmed']} and dropped the same {t['dropped']}",
        f"4,096 would keep {at['4096']['all']['kept'] - a['kept']} more whole meetings and trim "
        f"{at['4096']['all']['trimmed']} transcripts",
        f"Whole meetings, {span} in the training split",
    )
    long = at["32768"]["meetings"]
    says(
        "blogs/cp.md",
        f"{words['min']:,.0f} to {words['max']:,.0f} words, {words['median']:,.0f} at the median. Qwen3's tokenizer "
        f"makes that {meetings['min']:,.0f} to {meetings['max']:,.0f} tokens, {meetings['median']:,.0f} at the median",
        f"keeps {kept} {a['dropped']}: the whole-meeting summaries of {m['dropped']} of the {m['examples']} training "
        "meetings",
        f"a cap of 32,768 tokens, which keeps all {long['kept']}",
        f"The summary is {long['answer_fraction']:.1%} of a whole meeting's tokens, against "
        f"{a['answer_fraction']:.1%} of the examples kept at 2,048",
    )
    assert long["kept"] == long["examples"]
    says(
        "devlogs/cp-ft.md",
        f"{words['min']:,.0f}-{words['max']:,.0f} words, {span.removesuffix(' tokens')} of Qwen3's tokens",
        f"the tiny tokenizer of the CPU runs counts {tiny_meetings['min']:,.0f}-{tiny_meetings['max']:,.0f}",
        f"{m['dropped']} of the {m['examples']} training meetings are dropped; 16,384 would keep "
        f"{at['16384']['meetings']['kept']}, and 32,768 keeps all {long['kept']}",
    )
    says(
        "devlogs/single-gpu-ft.md",
        f"{a['kept']} of {a['examples']} examples kept, {a['trimmed']} of them with a trimmed transcript, and "
        f"{a['dropped']} dropped, the whole-meeting summaries of {m['dropped']} of the {m['examples']} training "
        "meetings",
        f"are {a['answer_fraction']:.1%} of the kept examples' tokens",
        f"run {span}, {meetings['median']:,.0f} at the median",
        f"The tiny tokenizer counted {t['kept']} / {t['trimmed']} / {t['dropped']}, {t['answer_fraction']:.1%} and "
        f"{tiny_meetings['min']:,.0f}-{tiny_meetings['max']:,.0f}",
        f"{meetings['median']:,.0f} of Qwen3's tokens in the training split",
        "at 2048 (real) one of 97 does",
    )
    by_split = [summary["splits"][f"{s}/meeting"] for s in ("train", "val", "test")]
    medians = [s["transcript tokens"]["median"] for s in by_split]
    word_medians = [s["transcript words"]["median"] for s in by_split]
    says(
        "blogs/what-fills-gpu-memory.md",
        f"{hundreds(min(word_medians))}-{hundreds(max(word_medians))} words by split, "
        f"{hundreds(min(medians))}-{hundreds(max(medians))} of Qwen3's tokens (up to "
        f"{hundreds(max(s['transcript tokens']['max'] for s in by_split))})",
        f"2048 keeps {a['kept']} of AMI's {a['examples']} training examples, {a['trimmed']} with a trimmed transcript, "
        f"and drops {a['dropped']} whole-meeting summaries",
    )


def test_the_docs_say_what_the_tokenizers_cost_and_hold():
    """The answer positions the lm_head runs at (the longest answer; the most a packed row holds in an epoch of the
    reference batches) and their logits, the tiny model's weights with Qwen3's vocabulary, and the walkthrough's
    whole meetings in the tiny tokenizer's tokens."""
    import torch

    from ftkit import hardware
    from ftkit.memory import GIB
    from ftkit.plan import settings

    longest = max(row[2] for row in layouts.ami_rows(models.QWEN3))
    s = settings.Setting(
        config=settings.model_config(models.QWEN3_4B),
        gpu=hardware.gpu("h100-sxm"),
        gpus=1,
        nodes=1,
        link=hardware.LINKS["nvlink4"],
        inter_node_link=hardware.LINKS["nvlink4"],
        memory_bytes=hardware.gpu("h100-sxm").memory_bytes,
        layout="packed",
    )
    row = max(micro.answers // micro.rows for step in layouts.layout_steps(s, 1) for micro in step.micros)
    logits = 3 * 4 * models.QWEN3_4B_CONFIG["vocab_size"] * row * s.micro_batch_size / GIB  # the post's 3 x 4 x vocab
    says(
        "blogs/what-fills-gpu-memory.md",
        f"AMI's longest training answer is {longest} of Qwen3's tokens with its `<|im_end|>`, but a packed row of "
        f"several examples holds up to {row} answer positions: {logits:.2f} GiB at micro-batch 2",
    )
    realscale = (ROOT / "ftkit" / "realscale" / "__init__.py").read_text()
    assert f"AMI's longest answer is {longest} of Qwen3's tokens" in realscale and f"holds up to {row} (" in realscale
    qwen3 = len(models.qwen3_tokenizer())
    model = models.load_model(
        models.TINY, quant="none", dtype=torch.float32, device=torch.device("meta"), seed=0, vocab_size=qwen3
    )
    share = qwen3 * models.TINY_CONFIG["hidden_size"] / sum(p.numel() for p in model.parameters())
    for page in ("devlogs/single-gpu-ft.md", "ftkit/README.md"):
        says(page, f"{qwen3:,} x 128, {share:.0%} of", f"{qwen3 / models.TINY_VOCAB:.0f} times wider")
    whole = sorted(
        fixed + transcript for fixed, transcript, _, trimmable in layouts.ami_rows(models.TINY) if not trimmable
    )
    kept = sum(n <= 4096 for n in whole)
    comment = (
        f"whole-meeting examples are {whole[0] / 1000:.1f}k-{whole[-1] / 1000:.0f}k tokens; 4,096 keeps the {kept}"
    )
    assert comment in (ROOT / "experiments" / "cp-ft" / "train.py").read_text()
