"""Packed batches (ftkit/batching.py `pack`, `collate_packed`, `GlobalBatches(pack_to=...)`): several examples per
row of --max-length positions, `position_ids` restarting at each example, no attention mask. The same examples and the
same loss as the padded layout, so the same step: shown on the model directly (loss and gradients), with the two
traps that silently let examples attend to each other (an all-ones mask beside the position restarts; a KV cache),
and on the scripts (single-gpu-ft packed against --no-packing, every technique packed against the single-process
packed reference). The data: `short_data_dir`, meetings cut to short spans so that a 512-position row holds
several examples (the shipped spans are trimmed to --max-length, one per row, where packing changes nothing)."""

from __future__ import annotations

import json
import statistics

import parity
import pytest
import torch
from conftest import run_script

from ftkit import batching, data, errors, lora, models

IGNORE = data.IGNORE_INDEX


def example(prompt: int, answer: int, start: int) -> data.Encoded:
    """A synthetic example: `prompt` tokens without loss, then `answer` tokens with it (ids from `start`)."""
    ids = [(start + i) % 97 + 3 for i in range(prompt + answer)]
    return data.Encoded(ids, [IGNORE] * prompt + ids[prompt:], trimmed=False)


def test_pack_fills_rows_first_fit_decreasing_and_keeps_every_example_once():
    lengths = [500, 30, 260, 250, 120, 400, 90, 12]
    rows = batching.pack(range(len(lengths)), lengths, capacity=512)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    assert rows == [[0, 7], [5, 6], [2, 3], [4, 1]]  # longest first, each into the first row with room
    assert batching.pack(range(len(lengths)), lengths, capacity=512) == rows  # a pure function: every rank agrees
    with pytest.raises(errors.DataError, match="does not fit"):
        batching.pack([0], [513], capacity=512)


def test_the_committed_layout_table_is_the_shipped_datas_and_meets_the_padding_bar():
    """assets/packing_layout.py on the shipped data in Qwen3's tokens (the host-side layout, no model) gives the
    committed JSON and the single-GPU devlog's table; at the reference micro-batch (2) the packed layout pads at most 5%
    of its positions (issue 30's bar: micro-batches as wide as their fullest row, `packed_width`) in half the padded
    micro-steps. The examples it encodes are the ones the planner rebuilds from ftkit/ami_lengths.json, token for token
    (the counts and data.ChatFormatter's rule at --max-length 2048 give every kept example's tokens and targets)."""
    import runpy

    from conftest import ROOT

    from ftkit.plan import layouts

    module = runpy.run_path(str(ROOT / "assets" / "packing_layout.py"))
    result, encoded = module["main"]()
    assert [(len(e.input_ids), e.n_target) for e in encoded] == list(layouts.ami_examples(2048, models.QWEN3))
    assert json.loads(module["OUT"].read_text()) == result
    assert module["table"](result) in (ROOT / "devlogs" / "single-gpu-ft.md").read_text()
    reference = next(r for r in result["rows"] if r["micro_batch_size"] == 2)
    devlog = " ".join((ROOT / "devlogs" / "single-gpu-ft.md").read_text().split())
    for said in (
        f"tokenized with Qwen3's own tokenizer (median example {result['examples']['median_tokens']:,.0f} tokens",
        f"the packed layout pads {reference['packed']['median_padding_fraction']:.1%} of its positions",
        f"the positions the padded layout computes ({reference['padded']['median_padding_fraction']:.1%} padding)",
    ):
        assert said in devlog, said
    assert reference["packed"]["median_padding_fraction"] <= 0.05
    assert reference["packed"]["median_micro_steps"] * 2 <= reference["padded"]["median_micro_steps"]


def test_a_packed_micro_batch_is_as_wide_as_its_fullest_row_rounded_up():
    assert batching.packed_width([100, 700], 2048) == 704 and batching.packed_width([704], 2048) == 704
    assert batching.packed_width([2000], 2048) == 2048 and batching.packed_width([500], 512) == 512
    assert batching.packed_width([0, 0], 2048) == batching.ROW_MULTIPLE  # a rank's micro-step of empty rows
    a, b = example(30, 10, 0), example(20, 5, 7)
    assert batching.collate_packed([[a, b], [b]], batching.packed_width([65, 25], 256))["input_ids"].shape == (2, 128)


def test_packed_rows_restart_positions_and_keep_each_examples_targets_to_itself():
    a, b = example(3, 2, 0), example(2, 3, 50)  # 5 tokens each
    mb = batching.collate_packed([[a, b], []], width=12)
    assert "attention_mask" not in mb  # a mask would undo the block-diagonal attention (see the trap test)
    # The padding tail continues the last example's positions (a one-example row is then plain causal) and is a
    # segment of its own for the kernels: the boundaries at 5, 10, the row's end, and the empty row's end.
    assert mb["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    assert mb["position_ids"][1].tolist() == list(range(12))  # an empty row: one block of padding
    assert mb["cu_seq_lens"].tolist() == [0, 5, 10, 12, 24] and mb["packed"]
    assert not batching.collate_packed([[a], [b]], width=8)["packed"]
    # The positions whose next token is a target: a's 2nd..4th, b's 1st..4th (b's first token is a prompt token,
    # never a target of a's last position).
    assert mb["logit_positions"][0].tolist() == [2, 3, 6, 7, 8]
    assert mb["targets"][0].tolist() == a.input_ids[3:] + b.input_ids[2:]
    assert mb["targets"][1].tolist() == [IGNORE] * 5
    assert mb["lengths"] == [5, 5]


@pytest.mark.parametrize("world, micro", [(1, 2), (2, 2), (2, 1)])
def test_packed_micro_batches_cover_the_global_batch_with_as_many_micro_steps_on_every_rank(world, micro):
    encoded = [example(20 + (7 * i) % 90, 5 + i % 13, i) for i in range(40)]
    batches = batching.GlobalBatches(encoded, 16, seed=0, pack_to=256)
    for step in range(3):
        shards = [batches.micro_batches(step, micro, rank=r, world=world) for r in range(world)]
        assert len({len(s) for s in shards}) == 1 == len({batches.micro_steps(step, micro, world)} | {len(shards[0])})
        for mb in (mb for s in shards for mb in s):  # micro rows, as wide as the fullest rounded up to 64
            fullest = max(sum(length for length in mb["lengths"]), 1) if micro == 1 else None
            width = mb["input_ids"].shape[1]
            assert mb["input_ids"].shape[0] == micro and width % batching.ROW_MULTIPLE == 0 and width <= 256
            assert fullest is None or width - batching.ROW_MULTIPLE < fullest <= width
        n_target = sum(int((mb["targets"] != IGNORE).sum()) for s in shards for mb in s)
        assert n_target == batches.n_target(step)
        assert sorted(n for s in shards for mb in s for n in mb["lengths"]) == sorted(batches.lengths(step))
        assert batches.micro_steps(step, micro, world) < batching.accumulation_steps(16, micro, world)
        layout = batches.layout(step, micro, 0, world)
        real = sum(n for mb in shards[0] for n in mb["lengths"])
        positions = sum(mb["input_ids"].numel() for mb in shards[0])
        assert layout["padding_fraction"] == pytest.approx(1 - real / positions)


def test_micro_batches_by_tokens_are_one_row_of_at_most_the_budget_each():
    """--micro-batch-tokens N (`GlobalBatches(pack_to=N, max_segment=--max-length)`, one row per micro-batch): each
    micro-batch holds at most N positions, together the global batch, in fewer micro-steps than rows of --max-length;
    no segment the varlen kernels are told of is longer than --max-length, a long padding run cut to it."""
    encoded = [example(20 + (7 * i) % 200, 5 + i % 13, i) for i in range(40)]
    budget = batching.GlobalBatches(encoded, 16, seed=0, pack_to=1024, max_segment=256)
    rows = batching.GlobalBatches(encoded, 16, seed=0, pack_to=256)
    for step in range(3):
        for world in (1, 2):
            shards = [budget.micro_batches(step, 1, rank=r, world=world) for r in range(world)]
            mbs = [mb for s in shards for mb in s]
            assert all(mb["input_ids"].shape[0] == 1 and mb["input_ids"].shape[1] <= 1024 for mb in mbs)
            assert sorted(n for mb in mbs for n in mb["lengths"]) == sorted(budget.lengths(step))
            assert sum(int((mb["targets"] != IGNORE).sum()) for mb in mbs) == budget.n_target(step)
            for mb in mbs:
                cu = mb["cu_seq_lens"]
                assert mb["max_segment"] == 256 and int((cu[1:] - cu[:-1]).max()) <= 256
                assert int(cu[-1]) == mb["input_ids"].numel()
        assert budget.micro_steps(step, 1) < rows.micro_steps(step, 2)
    empty = batching.collate_packed([[], [example(10, 5, 0)]], width=640, max_segment=256)
    assert empty["cu_seq_lens"].tolist() == [0, 256, 512, 640, 655, 911, 1167, 1280]


@pytest.fixture(scope="module")
def tiny():
    model = models.load_model("tiny", quant="none", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    return lora.apply_lora(model, 8, 16.0, 0.0, seed=0)


def loss_and_grads(model, mb: dict, **forward) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    inputs = {"input_ids": mb["input_ids"], "position_ids": mb.get("position_ids"), "use_cache": False, **forward}
    logits = model(**inputs, logits_to_keep=mb["logit_positions"]).logits
    loss = batching.token_loss_sum(logits, mb["targets"])
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_a_packed_row_computes_what_the_padded_rows_do_and_the_traps_do_not(tiny):
    examples = [example(40, 20, 0), example(25, 30, 7), example(60, 10, 13)]
    padded, pads_grads = loss_and_grads(tiny, batching.collate(examples))
    packed_mb = batching.collate_packed([examples], width=200)
    packed, packed_grads = loss_and_grads(tiny, packed_mb)
    grad_diff = max((a - b).abs().max().item() for a, b in zip(packed_grads, pads_grads))
    grad_max = max(b.abs().max().item() for b in pads_grads)
    print(f"padded {padded:.6f}, packed {packed:.6f}; gradients max |diff| {grad_diff:.2e} of max {grad_max:.2e}")
    assert abs(packed - padded) <= 1e-5 * abs(padded)
    assert grad_max > 0 and grad_diff <= 1e-5 * grad_max
    # Trap 1: an all-ones mask beside the restarting positions. transformers then builds a plain causal mask, and
    # every example attends to the ones packed before it in its row.
    ones = torch.ones_like(packed_mb["input_ids"])
    masked, _ = loss_and_grads(tiny, packed_mb, attention_mask=ones)
    # Trap 2: a KV cache. With one, transformers does not look for packed sequences either.
    cached, _ = loss_and_grads(tiny, packed_mb, use_cache=True)
    print(f"all-ones mask {masked:.6f}, KV cache {cached:.6f}")
    assert abs(masked - padded) > 1e-3 and abs(cached - padded) > 1e-3


# Two steps: the first a batch of long examples (one per row), the second of shorter ones that share rows.
FLAGS = ("--smoke", "--max-steps", "2", "--max-length", "512", "--eval-every", "2", "--save-every", "2")
FLAGS += ("--no-progress",)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, short_data_dir):
    """single-gpu-ft, LoRA without 4-bit (the bf16-LoRA techniques' reference), packed, on short spans."""
    return parity.reference(tmp_path_factory.mktemp("ref"), "--data", str(short_data_dir), *FLAGS, quant="none")


def test_single_gpu_packed_equals_padded_with_fewer_micro_steps(reference, short_data_dir, tmp_path):
    out = tmp_path / "padded"
    proc = run_script(
        parity.REFERENCE, "--data", str(short_data_dir), *FLAGS, "--quant", "none", "--no-packing",
        "--output-dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert parity.compare_losses(reference, out) <= parity.LOSS_TOL
    assert parity.compare_losses(reference, out, key="eval_loss") <= parity.LOSS_TOL
    assert parity.compare_adapters(reference / "adapter", out / "adapter") <= parity.ADAPTER_TOL
    packed, padded = parity.metrics(reference), parity.metrics(out)
    report = [(p["micro_batches"], round(p["padding_fraction"], 3), q["micro_batches"]) for p, q in zip(packed, padded)]
    print(f"per step (packed micro-steps, packed padding fraction, padded micro-steps): {report}")
    # A global batch of long examples (length-grouped batches keep them together) packs one per row: as many
    # micro-steps as padded. Shorter ones share rows: fewer.
    assert all(p["micro_batches"] <= q["micro_batches"] for p, q in zip(packed, padded))
    assert sum(p["micro_batches"] for p in packed) < sum(q["micro_batches"] for q in padded)
    assert statistics.median(p["padding_fraction"] for p in packed) < 0.5


def test_single_gpu_by_tokens_takes_the_packed_step_in_fewer_micro_steps(reference, short_data_dir, tmp_path):
    """--micro-batch-tokens 1024 (one row of up to 1,024 positions per micro-batch, examples of at most 512): the
    same step as the packed reference (2 rows of up to 512), with fewer micro-steps where the examples are short."""
    out = tmp_path / "tokens"
    proc = run_script(
        parity.REFERENCE, "--data", str(short_data_dir), *FLAGS, "--quant", "none", *BY_TOKENS,
        "--output-dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert parity.compare_losses(reference, out) <= parity.LOSS_TOL
    assert parity.compare_adapters(reference / "adapter", out / "adapter") <= parity.ADAPTER_TOL
    rows, by_tokens = parity.metrics(reference), parity.metrics(out)
    assert all(t["micro_batches"] <= r["micro_batches"] for t, r in zip(by_tokens, rows))
    config = json.loads((out / "config.json").read_text())["args"]
    assert config["micro_batch_tokens"] == 1024 and config["micro_batch_size"] == 1


# The techniques' runs lay their micro-batches out by tokens: the packed reference's rows, regrouped, so the same
# parity proves both layouts (the collator, the boundaries and the kernels are the same code for both).
BY_TOKENS = ("--micro-batch-tokens", "1024")


@pytest.mark.parametrize(
    "script, flags",
    [
        ("experiments/ddp-ft/train.py", ("--quant", "none")),
        ("experiments/fsdp-ft/train.py", ()),
        ("experiments/tp-ft/train.py", ()),
        ("experiments/tp-sp-ft/train.py", ()),
        ("experiments/fsdp-tp-ft/train.py", ("--mesh-shape", "1,2")),
    ],
)
def test_every_technique_by_tokens_takes_the_single_process_packed_step(
    reference, short_data_dir, tmp_path, script, flags
):
    run = parity.torchrun(script, "--data", str(short_data_dir), *FLAGS, *flags, *BY_TOKENS, "--output-dir",
                          str(tmp_path / "run"))  # fmt: skip
    assert run.returncode == 0, run.report()
    rows = parity.metrics(run.run_dir)
    assert all(r["micro_batches"] >= 1 and 0 <= r["padding_fraction"] < 1 for r in rows)
    loss = parity.compare_losses(run.run_dir, reference)
    adapter = parity.compare_adapters(run.run_dir / "adapter", reference / "adapter")
    print(f"{script}: max |loss diff| {loss:.2e}, adapter {adapter:.2e}")
    assert loss <= parity.LOSS_TOL and adapter <= parity.ADAPTER_TOL
