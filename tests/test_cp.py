"""experiments/cp-ft (context parallel: each whole meeting split over the ranks in 2 x cp chunks, K and V
all-gathered) on 2 and 4 CPU processes (torchrun, gloo): the same steps as the single-process LoRA reference on
the same whole meetings, resumed as uninterrupted, the answer tokens on one rank only, the chunk layout, the
attention at one rank equal to the model's own, the mask trap caught, and bad input refused before the model."""

from __future__ import annotations

import json
import runpy

import parity
import pytest
import torch
import torch.distributed as dist
from conftest import ROOT

from ftkit import batching, data, models

CP_TRAIN = "experiments/cp-ft/train.py"
# Whole meetings of the tiny tokenizer: at 2,592 tokens (a multiple of 2 x 4 chunks) the shortest of the training
# set (1,726 tokens) and of the held-out set (2,586) are kept; two steps of it, the second after an update.
STEPS, BATCH, MAX_LENGTH = 2, 1, 2592


def flags(*extra: str) -> list[str]:
    return [
        "--smoke",
        "--task",
        "meetings",
        "--max-steps",
        str(STEPS),
        "--max-length",
        str(MAX_LENGTH),
        "--batch-size",
        str(BATCH),
        "--micro-batch-size",
        "1",
        "--eval-every",
        str(STEPS),
        "--no-progress",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """single-gpu-ft's bf16-LoRA step (fp32 in --smoke) on the same meetings, one padded row each."""
    return parity.reference(tmp_path_factory.mktemp("cp-ref"), *flags("--no-packing"), quant="none")


@pytest.fixture(scope="module")
def script():
    return runpy.run_path(str(ROOT / CP_TRAIN))


def test_four_ranks_take_the_single_process_steps(tmp_path, reference):
    run = parity.torchrun(CP_TRAIN, *flags(), "--output-dir", str(tmp_path / "cp4"), nproc=4)
    assert run.returncode == 0, run.report()
    assert parity.compare_losses(run.run_dir, reference) <= parity.LOSS_TOL
    assert parity.compare_losses(run.run_dir, reference, "eval_loss") <= parity.LOSS_TOL
    assert parity.compare_adapters(run.run_dir / "adapter", reference / "adapter") <= parity.ADAPTER_TOL
    # What crossed the wire is what the summary's theory says (K and V gathered twice under checkpointing, their
    # gradients reduce-scattered once, the LoRA gradients all-reduced once).
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["comm_bytes_per_step"] == pytest.approx(summary["comm_theory_bytes_per_step"], rel=1e-12)
    assert set(summary["comm"]) == {"all_gather", "reduce_scatter", "all_reduce"}


def test_two_data_parallel_groups_of_two_take_the_single_process_steps(tmp_path):
    """--cp 2 on 4 ranks: ranks 0-1 and 2-3 each split two sequences of every step (a global batch of 4, two
    micro-batches a step), their gathers inside their group, the gradients summed over all four: single-gpu-ft's
    steps on the same sequences, with no host sync per micro-batch. Span queries at 512 tokens (`--task all`): what
    is tested is the grid, and short sequences keep it quick."""
    wider = flags()
    for flag, value in (("--task", "all"), ("--max-length", "512"), ("--batch-size", "4")):
        wider[wider.index(flag) + 1] = value
    (tmp_path / "ref").mkdir()
    ref = parity.reference(tmp_path / "ref", *wider, "--no-packing", quant="none")
    run = parity.torchrun(CP_TRAIN, *wider, "--cp", "2", "--output-dir", str(tmp_path / "dp2cp2"), nproc=4)
    assert run.returncode == 0, run.report()
    assert "dp 2 x cp 2" in run.ranks[0]["stdout"]
    assert parity.compare_losses(run.run_dir, ref) <= parity.LOSS_TOL
    assert parity.compare_losses(run.run_dir, ref, "eval_loss") <= parity.LOSS_TOL
    assert parity.compare_adapters(run.run_dir / "adapter", ref / "adapter") <= parity.ADAPTER_TOL
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["comm_bytes_per_step"] == pytest.approx(summary["comm_theory_bytes_per_step"], rel=1e-12)
    assert summary["accumulation_steps"] == 2  # a sync in each micro-batch would count 3
    assert max(parity.host_syncs(run.run_dir, save_every=10)) <= parity.MAX_HOST_SYNCS


def test_two_ranks_stopped_and_resumed_take_the_single_process_steps(tmp_path, reference):
    out = tmp_path / "cp2"
    first = parity.torchrun(CP_TRAIN, *flags("--stop-after", "1"), "--output-dir", str(out))
    assert first.returncode == 0, first.report()
    assert f"--resume {out}" in first.ranks[0]["stdout"]
    second = parity.torchrun(CP_TRAIN, *flags("--resume", str(out)), "--output-dir", str(out))
    assert second.returncode == 0, second.report()
    assert [r["step"] for r in parity.metrics(out)] == list(range(1, STEPS + 1))
    assert parity.compare_losses(out, reference) <= parity.LOSS_TOL
    assert parity.compare_adapters(out / "adapter", reference / "adapter") <= parity.ADAPTER_TOL


def test_the_answer_sits_on_one_rank_only(script):
    """A meeting's summary is its last tokens, so at cp 2 all its target tokens are in chunk 3, rank 0's: rank 1
    computes no loss, one position with no target, and must still run its backward (the reduce-scatters)."""
    splits = data.task_examples(data.load_splits(data.SHIPPED), "meetings")
    tokenizer = models.load_tokenizer("tiny", data.corpus(data.load_splits(data.SHIPPED)["train"]))
    encoded, _ = data.ChatFormatter(tokenizer, MAX_LENGTH).encode_all(splits["train"])
    mb = batching.collate(encoded[:1])
    parts = [script["shard"](mb, 2, rank) for rank in range(2)]
    real = (mb["targets"] != batching.IGNORE_INDEX).sum().item()
    assert (parts[0]["targets"] != batching.IGNORE_INDEX).sum().item() == real > 0
    assert parts[1]["targets"].shape == (1, 1) and (parts[1]["targets"] == batching.IGNORE_INDEX).all()


def test_each_rank_holds_a_head_and_a_tail_chunk(script):
    """Rank r of cp holds chunks r and 2cp-1-r of the sequence padded to a multiple of 2 x cp, at their global
    positions (RoPE's), and the targets of its positions are the next tokens of the whole sequence."""
    length = 21
    ids = torch.arange(100, 100 + length).unsqueeze(0)
    labels = torch.full_like(ids, batching.IGNORE_INDEX)
    labels[0, 15:] = ids[0, 15:]
    mb = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    cp = 3  # padded to 24: six chunks of 4
    seen = []
    for rank in range(cp):
        part = script["shard"](mb, cp, rank)
        chunks = (rank, 2 * cp - 1 - rank)
        expected = [p for c in chunks for p in range(4 * c, 4 * c + 4)]
        assert part["position_ids"][0].tolist() == expected
        assert part["input_ids"][0].tolist() == [100 + p if p < length else 0 for p in expected]
        for i, t in zip(part["logit_positions"][0].tolist(), part["targets"][0].tolist()):
            if t != batching.IGNORE_INDEX:
                seen.append(expected[i])
                assert t == 100 + expected[i] + 1
    assert sorted(seen) == list(range(14, length - 1))  # every target once, on whichever rank holds its position


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_at_one_rank_the_chunked_attention_is_the_models_own_and_the_mask_trap_is_caught(script, one_rank, monkeypatch):
    """With cp 1 the two chunks are the sequence's halves: cp_attention's logits are SDPA's on the same model. And
    the trap: at cp > 1 the chunks' position ids jump (0..31 then 96..127), which transformers reads as packed
    sequences and masks apart when it builds masks for the attention (as it does for its own, SDPA's). Without the
    no-mask mapping such a mask reaches cp_attention, which refuses it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register("cp", script["cp_attention"])  # this namespace's (each run of the script registers)
    ids = torch.randint(0, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    chunked = models.load_model("tiny", quant="none", dtype=torch.float32, device=cpu, seed=0, attn="cp")
    plain = models.load_model("tiny", quant="none", dtype=torch.float32, device=cpu, seed=0)
    part = script["shard"]({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}, 1, 0)
    no_mask = {"full_attention": None}
    jumped = torch.cat([torch.arange(0, 32), torch.arange(96, 128)]).unsqueeze(0)  # chunks 0 and 3 of cp 2
    with torch.no_grad():
        got = chunked(input_ids=part["input_ids"], position_ids=part["position_ids"], attention_mask=no_mask).logits
        assert (got - plain(input_ids=ids).logits).abs().max().item() < 1e-5
        masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        monkeypatch.setitem(masks, "cp", masks["sdpa"])  # transformers now builds masks for cp, as for SDPA
        chunked(input_ids=part["input_ids"], position_ids=jumped, attention_mask=no_mask)  # the mapping: no mask
        with pytest.raises(RuntimeError, match="attention_mask=\\{'full_attention': None\\}"):
            chunked(input_ids=part["input_ids"], position_ids=jumped)


@pytest.mark.parametrize(
    "world, argv, message",
    [
        (4, ["--cp", "3"], "--cp 3 must divide the world size 4"),
        (4, ["--cp", "2", "--batch-size", "1"], "--batch-size 1 is not a multiple of --micro-batch-size 1 x 2"),
        (2, ["--max-length", "4095"], "cannot be cut into 2 x --cp = 4 equal chunks: pass --max-length 4096"),
    ],
)
def test_bad_input_is_refused_before_the_model(monkeypatch, world, argv, message):
    assert message in parity.refused(monkeypatch, CP_TRAIN, "--smoke", *argv, world=world)


def test_a_model_with_sliding_window_layers_is_refused(monkeypatch):
    config = models.model_config("tiny")
    config.layer_types = ["sliding_attention"] + config.layer_types[1:]
    monkeypatch.setattr(models, "model_config", lambda *a, **k: config)
    assert "full causal attention" in parity.refused(monkeypatch, CP_TRAIN, "--smoke", world=2)


def test_infer_summarizes_held_out_whole_meetings_that_fit():
    """cp-ft's run has --task meetings: infer.py's held-out examples are whole meetings, the first ones in the
    dataset's order that fit the run's --max-length with the summary's room (a meeting is never trimmed)."""
    from ftkit import generation

    test = data.load_splits(data.SHIPPED)["test"]
    meetings = [ex for ex in test if ex.kind == "meeting"]
    short = {ex.meeting_id for ex in meetings if len(ex.transcript) < 30_000}
    chosen = generation.held_out(test, 2, "meetings", fits=lambda ex: ex.meeting_id in short)
    assert [ex.meeting_id for ex in chosen] == [ex.meeting_id for ex in meetings if ex.meeting_id in short][:2]
    assert all(ex.kind == "meeting" for ex in chosen) and len(chosen) == 2
    assert all(ex.kind == "span" for ex in generation.held_out(test, 3))  # the other tasks: spans first, as before
