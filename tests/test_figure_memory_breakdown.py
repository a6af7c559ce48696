"""assets/memory_breakdown.png, the memory post's figure: every bar it draws is the memory model's prediction
(`ftkit.memory.predict`) for Qwen3-4B at the scripts' reference configuration, and the post shows the PNG."""

from __future__ import annotations

import runpy

import pytest
from conftest import ROOT

from ftkit import cli, realscale
from ftkit.memory import GIB, ModelShape, predict
from ftkit.plan import settings

FIGURE = runpy.run_path(str(ROOT / "assets" / "memory_breakdown.py"))  # not as __main__: nothing drawn or written
POST = ROOT / "blogs" / "what-fills-gpu-memory.md"

# The reference configuration, from where the scripts and the harness take it (not from the figure's script):
# the scripts' real-scale defaults (`ftkit.cli.REAL`), LoRA rank 16 on all seven projections, checkpointing on,
# the lm_head on ftkit.realscale's answer positions per sequence.
REFERENCE = dict(
    seq_len=cli.REAL["max_length"],
    micro_batch_size=cli.REAL["micro_batch_size"],
    lora_dropout=cli.REAL["lora_dropout"],
    lora_rank=16,
    grad_checkpointing=True,
    logit_positions=realscale.ANSWER_TOKENS,
)
# Each bar: its label and what it changes in the reference configuration (global batch 16 of micro-batch 2:
# FSDP on 2 ranks accumulates 4 micro-steps).
BARS = {
    "Full finetune, bf16 + AdamW, 1 GPU": dict(full_finetune=True),
    "LoRA, bf16 base, 1 GPU": dict(quant="none"),
    "QLoRA, NF4 base, 1 GPU": dict(quant="nf4"),
    "QLoRA, NF4, 1 GPU, no checkpointing": dict(quant="nf4", grad_checkpointing=False),
    "QLoRA, NF4, 1 GPU, peft's fp32 upcast": dict(quant="nf4", kbit_upcast=True),
    "QLoRA + DDP, 2 GPUs": dict(quant="nf4", technique="ddp", world_size=2),
    "FSDP LoRA bf16, 2 GPUs": dict(technique="fsdp", world_size=2, accumulation_steps=4),
    "FSDP LoRA bf16, 8 GPUs": dict(technique="fsdp", world_size=8),
    "TP LoRA bf16, 2 GPUs": dict(technique="tp", world_size=2),
    "TP+SP LoRA bf16, 2 GPUs": dict(technique="tp-sp", world_size=2),
    "PP LoRA bf16, 4 stages, 1F1B, 8 micro-batches": dict(technique="pp", world_size=4, num_microbatches=8),
    "PP LoRA bf16, 4 stages, GPipe, 8 micro-batches": dict(
        technique="pp", world_size=4, num_microbatches=8, pp_schedule="gpipe"
    ),
}
SEGMENTS = ("weights", "gathered", "lora", "gradients", "optimizer", "activations")


def drawn() -> list[tuple[str, dict[str, float]]]:
    return FIGURE["bars"](FIGURE["rows"]())


def test_the_figure_draws_the_reference_configuration():
    assert cli.REAL["model"] == "Qwen/Qwen3-4B"
    assert {k: FIGURE["COMMON"][k] for k in REFERENCE} == REFERENCE
    assert "seq 2048, micro-batch 2, LoRA r=16 (dropout 0.05)" in FIGURE["title"]()
    assert "the lm_head on 256 answer positions per sequence" in FIGURE["title"]()


def test_every_bar_is_the_memory_models_prediction():
    """Each segment of each bar, in GiB, is `predict`'s component for that configuration; the printed total is
    `predict`'s total; the bars come in the order the post's table lists them."""
    shape = ModelShape.from_config(settings.model_config("Qwen/Qwen3-4B"))
    bars = drawn()
    assert [label for label, _ in bars] == list(BARS)
    assert [field for field, _, _ in FIGURE["COMPONENTS"]] == list(SEGMENTS)
    for label, gib in bars:
        p = predict(shape, **{**REFERENCE, **BARS[label]})
        for field in SEGMENTS:
            assert gib[field] == pytest.approx(getattr(p, field) / GIB, abs=1e-9), (label, field)
        assert gib["total"] == pytest.approx(p.total / GIB, abs=1e-9), label


def test_the_bars_show_what_the_post_says():
    """The post's reading of the figure: the full finetune is mostly AdamW state, LoRA and QLoRA fit in a tenth of
    it, checkpointing and FSDP do what the post says."""
    bars = dict(drawn())
    full = bars["Full finetune, bf16 + AdamW, 1 GPU"]
    assert full["optimizer"] > full["total"] / 2 and round(full["total"], 2) == 61.62
    assert round(bars["LoRA, bf16 base, 1 GPU"]["total"], 2) == 9.63
    assert round(bars["QLoRA, NF4 base, 1 GPU"]["total"], 2) == 4.61
    no_ckpt = bars["QLoRA, NF4, 1 GPU, no checkpointing"]["activations"]
    assert (round(no_ckpt, 2), round(bars["QLoRA, NF4 base, 1 GPU"]["activations"], 2)) == (28.49, 1.64)
    assert round(bars["FSDP LoRA bf16, 8 GPUs"]["gathered"], 2) == round(bars["FSDP LoRA bf16, 2 GPUs"]["gathered"], 2)


def test_the_post_shows_the_figure():
    post = POST.read_text()
    assert "![" in post and "](../assets/memory_breakdown.png)" in post
    assert (ROOT / "assets" / "memory_breakdown.png").stat().st_size < 300_000
