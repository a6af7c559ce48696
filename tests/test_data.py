"""AMI loading, Qwen3 chat formatting, masking, trimming and batching."""

from __future__ import annotations

import gzip
import json
import random
import shutil

import pytest
import torch

from ftkit import batching, cli, data, errors, models


@pytest.fixture(scope="module")
def splits(data_dir):
    return data.load_splits(str(data_dir))


@pytest.fixture(scope="module")
def tokenizer(splits):
    return models.load_tokenizer("tiny", data.corpus(splits["train"]))


# QMSum's own split of the 137 AMI "Product" meetings (data/Product/{val,test}/ at the pinned commit): four
# meetings (a-d) of each of these series; every other meeting is in train.
QMSUM_VAL = {f"{series}{x}" for series in ("ES2006", "ES2009", "IS1006", "TS3009", "TS3010") for x in "abcd"}
QMSUM_TEST = {f"{series}{x}" for series in ("ES2004", "ES2011", "IS1003", "TS3004", "TS3011") for x in "abcd"}


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to reach the hub fails the test."""
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError(f"hub access: load_dataset{args}")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)


@pytest.mark.usefixtures("offline")
def test_shipped_data_is_qmsums_ami_split_by_meeting(tmp_path, monkeypatch, splits, data_dir):
    """`qmsum-ami` is the shipped folder, read offline, wherever the command runs: 97/20/20 meetings with
    690/145/151 query-summary pairs, split exactly as QMSum splits them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / data.SHIPPED).mkdir()  # a local folder of the same name does not shadow the shipped data
    shipped = data.load_splits(data.SHIPPED)
    meetings = {s: {ex.meeting_id for ex in shipped[s]} for s in data.SPLITS}
    assert [len(meetings[s]) for s in data.SPLITS] == [97, 20, 20]
    assert [len(shipped[s]) for s in data.SPLITS] == [690, 145, 151]
    assert (meetings["val"], meetings["test"]) == (QMSUM_VAL, QMSUM_TEST)
    assert all(m[:2] in ("ES", "IS", "TS") for m in meetings["train"])
    assert data_dir == data.SHIPPED_DIR and shipped == splits  # the tests run on it; the name is that folder


def resolved(*flags: str):
    return cli.resolve(cli.common_parser("test", "test").parse_args(list(flags)))


@pytest.mark.parametrize("scale", [(), ("--smoke",)], ids=["real", "smoke"])
def test_default_data_is_the_shipped_data(scale):
    args = resolved(*scale)
    assert (args.data, args.data_revision) == (data.SHIPPED, None)
    # A hub dataset read from a revision other than its main branch gets that revision, unless one is given.
    assert resolved(*scale, "--data", "TalTechNLP/AMIsum").data_revision == "refs/convert/parquet"
    assert resolved(*scale, "--data", "TalTechNLP/AMIsum", "--data-revision", "main").data_revision == "main"
    assert resolved(*scale, "--data", "knkarthick/AMI").data_revision is None


@pytest.mark.usefixtures("offline")
def test_plain_json_qmsum_folder_loads_the_same(tmp_path, splits):
    """A clone of QMSum's data/Product holds plain .json files: the same meetings give the same examples."""
    clone = tmp_path / "Product"
    for split in data.SPLITS:
        (clone / split).mkdir(parents=True)
        for f in sorted((data.SHIPPED_DIR / split).glob("*.json.gz"))[:2]:
            (clone / split / f.name.removesuffix(".gz")).write_bytes(gzip.decompress(f.read_bytes()))
    loaded = data.load_splits(str(clone))
    for split in data.SPLITS:
        ids = {ex.meeting_id for ex in loaded[split]}
        assert len(ids) == 2
        assert loaded[split] == [ex for ex in splits[split] if ex.meeting_id in ids]


def test_splits_are_by_meeting(splits):
    meetings = {s: {ex.meeting_id for ex in exs} for s, exs in splits.items()}
    assert all(meetings.values())
    assert not meetings["train"] & meetings["val"]
    assert not meetings["train"] & meetings["test"]
    assert not meetings["val"] & meetings["test"]
    leaked = {"train": splits["train"][:1], "test": splits["train"][:1]}
    with pytest.raises(errors.DataError, match="both train and test"):
        data.check_split_by_meeting(leaked)


def test_examples_are_spans_and_whole_meetings(splits):
    kinds = {ex.kind for ex in splits["train"]}
    assert kinds == {"span", "meeting"}
    span = next(ex for ex in splits["train"] if ex.kind == "span")
    assert span.transcript and span.query and span.answer
    assert ":" in span.transcript.splitlines()[0]  # "Speaker: content" turns


def test_chat_format_and_loss_mask(tokenizer, splits):
    fmt = data.ChatFormatter(tokenizer, max_length=4096)
    ex = next(ex for ex in splits["train"] if ex.kind == "span")
    enc, why = fmt.encode(ex)
    assert why is None and len(enc.input_ids) == len(enc.labels)
    text = tokenizer.decode(enc.input_ids)
    # Qwen3's format with thinking off: user turn, then the assistant turn behind an empty think block.
    assert text.startswith("<|im_start|>user\nMeeting transcript:\n")
    assert f"{ex.query}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" in text
    # The loss is on the answer and its closing <|im_end|>, on nothing else.
    target = [t for t in enc.labels if t != data.IGNORE_INDEX]
    assert tokenizer.decode(target) == ex.answer + "<|im_end|>"
    first = enc.labels.index(target[0])
    assert all(t == data.IGNORE_INDEX for t in enc.labels[:first])
    assert enc.input_ids[first:] == target


def test_trimming_keeps_answers_whole(tokenizer, splits):
    fmt = data.ChatFormatter(tokenizer, max_length=256)
    encoded, stats = fmt.encode_all(splits["train"])
    assert stats.trimmed > 0 and stats.kept == len(encoded)
    assert stats.kept + sum(stats.dropped.values()) == stats.examples == len(splits["train"])
    assert all(len(e.input_ids) <= 256 for e in encoded)
    kept = [(ex, enc) for ex in splits["train"] for enc in [fmt.encode(ex)[0]] if enc is not None]
    assert [enc.input_ids for _, enc in kept] == [enc.input_ids for enc in encoded]
    for ex, enc in kept:
        answer = tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [fmt.eos_id]
        assert [t for t in enc.labels if t != data.IGNORE_INDEX] == answer
    # Whole-meeting summaries are kept only where the whole transcript fits.
    assert stats.dropped.get("whole meeting longer than --max-length", 0) > 0
    assert all(not ex.trimmable or ex.kind == "span" for ex, enc in kept if enc.trimmed)


@pytest.mark.parametrize("name", [models.TINY, models.QWEN3])
def test_a_transcript_is_cut_as_if_tokenized_whole(name, tokenizer, splits):
    """ChatFormatter tokenizes a prefix of a long transcript, not the whole meeting: its first tokens must be the
    whole text's, at every budget the scripts use (the held-out meetings: spans and whole meetings alike), with the
    tiny tokenizer's pre-tokenizer (GPT-2's) and Qwen3's own."""
    fmt = data.ChatFormatter(tokenizer if name == models.TINY else models.qwen3_tokenizer(), max_length=256)
    texts = sorted({ex.transcript for ex in splits["val"]}, key=len)
    assert len(texts[-1]) > 30_000  # whole meetings among them
    for text in texts:
        whole = fmt._ids(text)
        for budget in (0, 31, 180, 460, 1900, 8000):
            assert fmt.transcript_ids(text, budget) == whole[: budget + 1], (len(text), budget)


def test_answer_longer_than_max_length_is_dropped(tokenizer):
    fmt = data.ChatFormatter(tokenizer, max_length=64)
    ex = data.Example("m", "span", "What?", "A: hi\nB: hello", "word " * 200)
    enc, why = fmt.encode(ex)
    assert enc is None and why == "answer too long for --max-length"


def test_tiny_tokenizer_is_deterministic(tmp_path, monkeypatch, splits):
    texts = data.corpus(splits["val"])
    files = []
    for name in ("a", "b"):
        monkeypatch.setenv("FTKIT_CACHE", str(tmp_path / name))
        models.tiny_tokenizer(texts, vocab_size=1024)
        (built,) = (tmp_path / name).glob("tiny-tokenizer-*/tokenizer.json")
        files.append(built.read_text())
    assert files[0] == files[1]


@pytest.fixture(scope="module")
def encoded(tokenizer, splits):
    return data.ChatFormatter(tokenizer, max_length=256).encode_all(splits["train"])[0]


def test_batches_are_deterministic_for_a_seed(encoded):
    a, b = batching.GlobalBatches(encoded, 8, seed=3), batching.GlobalBatches(encoded, 8, seed=3)
    steps = range(0, 3 * a.per_epoch)  # across epoch boundaries
    assert [a.indices(s) for s in steps] == [b.indices(s) for s in steps]
    other = batching.GlobalBatches(encoded, 8, seed=4)
    assert [a.indices(s) for s in steps] != [other.indices(s) for s in steps]
    # Every epoch visits distinct examples, each once.
    epoch = [i for s in range(a.per_epoch) for i in a.indices(s)]
    assert len(epoch) == len(set(epoch)) == a.per_epoch * 8


def test_length_grouping_pads_less_than_random(tokenizer, splits):
    encoded = data.ChatFormatter(tokenizer, max_length=2048).encode_all(splits["train"])[0]

    def padding(batches):
        total = 0
        for s in range(batches.per_epoch):
            lens = [len(encoded[i].input_ids) for i in batches.indices(s)]
            total += max(lens) * len(lens) - sum(lens)
        return total

    grouped = batching.GlobalBatches(encoded, 8, seed=0)
    ungrouped = batching.GlobalBatches(encoded, 8, seed=0, group=1)
    assert padding(grouped) < padding(ungrouped)


@pytest.mark.parametrize("world,micro", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_rank_shards_union_is_the_global_batch(encoded, world, micro):
    batches = batching.GlobalBatches(encoded, 8, seed=1)

    def rows(mbs):
        return sorted(tuple(r[m.bool()].tolist()) for mb in mbs for r, m in zip(mb["input_ids"], mb["attention_mask"]))

    for step in (0, 1, batches.per_epoch + 1):
        single = rows(batches.micro_batches(step, micro_batch_size=1))
        shards = [batches.micro_batches(step, micro, rank=r, world=world) for r in range(world)]
        assert all(len(s) == 8 // (micro * world) for s in shards)
        assert sorted(x for r in range(world) for x in rows(shards[r])) == single
        n_target = sum(int((mb["labels"] != data.IGNORE_INDEX).sum()) for s in shards for mb in s)
        assert n_target == batches.n_target(step)


@pytest.mark.parametrize("world,micro,multiple", [(1, 2, 1), (1, 2, 4), (1, 4, 3), (2, 2, 1), (2, 1, 2)])
def test_padded_tokens_are_the_collated_micro_batches(world, micro, multiple):
    """The TP scripts' comm theory takes the step's [micro, seq] extent from `padded_tokens`, on the host: it is
    what the micro-batches hold once collated and padded to the multiple (tp-sp-ft's `pad_to_multiple`)."""
    rng = random.Random(0)
    lengths = [rng.randrange(5, 40) for _ in range(24)]
    examples = [
        data.Encoded(input_ids=[1] * n, labels=[data.IGNORE_INDEX] * (n - 1) + [1], trimmed=False) for n in lengths
    ]
    batches = batching.GlobalBatches(examples, 8, seed=2)
    for step in range(3):
        for rank in range(world):
            mbs = [batching.pad_to_multiple(mb, multiple) for mb in batches.micro_batches(step, micro, rank, world)]
            held = sum(mb["input_ids"].numel() for mb in mbs)
            assert batches.padded_tokens(step, micro, rank, world, multiple) == held
            if micro > 1:  # rows of different lengths: the collated micro-batches hold padding
                assert held > sum(sum(mb["lengths"]) for mb in mbs)


def test_answer_only_loss_equals_the_full_vocabulary_loss(encoded, tokenizer):
    """The lm_head on the answer positions only (`logits_to_keep=logit_positions`) gives the loss, and the gradient,
    of the full next-token loss over the whole sequence with the prompt masked out; on CPU in fp32 the only
    difference is the summation order."""
    batches = batching.GlobalBatches(encoded, 8, seed=0)
    mb = batches.micro_batches(2, micro_batch_size=4)[0]
    assert mb["lengths"] == mb["attention_mask"].sum(1).tolist()
    assert (mb["targets"] != data.IGNORE_INDEX).sum() == (mb["labels"] != data.IGNORE_INDEX).sum()
    model = models.load_model("tiny", quant="none", dtype=torch.float32, device=torch.device("cpu"), seed=0,
                              vocab_size=len(tokenizer))  # fmt: skip

    def loss_and_grad(keep: bool):
        model.zero_grad()
        ids, mask = mb["input_ids"], mb["attention_mask"]
        if keep:
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=mb["logit_positions"]).logits
            loss = batching.token_loss_sum(logits, mb["targets"])
            assert logits.shape[:2] == mb["targets"].shape and logits.shape[1] < ids.shape[1] // 2
        else:  # the whole sequence's logits, shifted by one against the labels
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = batching.token_loss_sum(logits[:, :-1], mb["labels"][:, 1:])
        loss.backward()
        return loss.item(), model.model.layers[0].mlp.up_proj.weight.grad.clone()

    (answer_only, grad_a), (full, grad_f) = loss_and_grad(True), loss_and_grad(False)
    print(f"answer-only {answer_only:.6f} vs full {full:.6f}; grad max |diff| {(grad_a - grad_f).abs().max():.2e}")
    assert grad_f.abs().sum() > 0
    assert abs(answer_only - full) <= 1e-6 * abs(full)
    assert torch.allclose(grad_a, grad_f, rtol=1e-5, atol=1e-8)


def test_batch_that_does_not_divide_is_refused():
    with pytest.raises(errors.DataError, match="not a multiple"):
        batching.accumulation_steps(batch_size=10, micro_batch_size=4, data_parallel=1)
    with pytest.raises(errors.DataError, match="not a multiple"):
        batching.accumulation_steps(batch_size=8, micro_batch_size=2, data_parallel=3)
    assert batching.accumulation_steps(16, 2, 4) == 2


def test_missing_and_malformed_data(tmp_path, data_dir):
    with pytest.raises(errors.DataError, match="does not exist"):
        data.load_splits(str(tmp_path / "nope"))
    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    victim = sorted((bad / "train").glob("*.json.gz"))[0]
    original = victim.read_bytes()
    for broken in (b"{not json", original[: len(original) // 2], gzip.compress(b"{not json")):
        victim.write_bytes(broken)  # not gzip, a truncated gzip, gzipped non-JSON
        with pytest.raises(errors.DataError, match=victim.name):
            data.load_splits(str(bad))
    meeting = json.loads(gzip.decompress(original))
    del meeting["meeting_transcripts"]
    victim.write_bytes(gzip.compress(json.dumps(meeting).encode()))
    with pytest.raises(errors.DataError, match="QMSum's meeting format"):
        data.load_splits(str(bad))
    # A meeting both gzipped and not (`gunzip -k`) would count twice.
    victim.write_bytes(original)
    victim.with_name(victim.name.removesuffix(".gz")).write_bytes(gzip.decompress(original))
    with pytest.raises(errors.DataError, match=f"{data.meeting_id(victim)} found as both"):
        data.load_splits(str(bad))


def test_hub_schema_parsing_offline(tmp_path, splits):
    """The hub path (`datasets.load_dataset(id)` -> splits) on a local parquet file of the same schema."""
    import datasets

    meetings = [ex for ex in splits["train"] + splits["val"] if ex.kind == "meeting"]
    rows = [{"id": ex.meeting_id, "transcript": ex.transcript, "summary": ex.answer} for ex in meetings]
    for name, part in (("train", rows[:-2]), ("validation", rows[-2:-1]), ("test", rows[-1:])):
        datasets.Dataset.from_list(part).to_parquet(str(tmp_path / f"{name}.parquet"))
    dd = datasets.load_dataset(
        "parquet", data_files={n: str(tmp_path / f"{n}.parquet") for n in ("train", "validation", "test")}
    )
    out = data.hub_dataset_to_splits(dd, "local-parquet")
    assert [len(out[s]) for s in data.SPLITS] == [len(rows) - 2, 1, 1]
    ex = out["val"][0]
    assert (ex.meeting_id, ex.answer, ex.kind, ex.trimmable) == (
        rows[-2]["id"],
        rows[-2]["summary"],
        "meeting",
        True,
    )
    # One split only: divided by a hash of the meeting id, never by example.
    single = data.hub_dataset_to_splits(datasets.DatasetDict({"train": dd["train"]}), "one-split")
    assert sum(len(v) for v in single.values()) == len(rows) - 2
    wrong = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"dialog_text": "x", "abstract": "y"}])})
    with pytest.raises(errors.DataError, match="no transcript column"):
        data.hub_dataset_to_splits(wrong, "wrong-schema")


def test_hub_ids_are_routed_to_datasets(monkeypatch, tmp_path):
    """`owner/name[:config]` that is not a local folder goes to `datasets.load_dataset` with the revision and
    HF_TOKEN; a hub failure becomes a DataError that says what to do offline."""
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, revision=None, token=None):
        calls.append((name, config, revision, token))
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    with pytest.raises(errors.DataError, match="local QMSum-format folder"):
        data.load_splits("TalTechNLP/AMIsum", revision="refs/convert/parquet")
    with pytest.raises(errors.DataError):
        data.load_splits("knkarthick/AMI:default")
    assert calls == [
        ("TalTechNLP/AMIsum", None, "refs/convert/parquet", "hf_test"),
        ("knkarthick/AMI", "default", None, "hf_test"),
    ]
    with pytest.raises(errors.DataError, match="does not exist"):
        data.load_splits(str(tmp_path / "a" / "b"))  # a path, not an owner/name id
