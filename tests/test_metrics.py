"""FLOPs/MFU convention on a hand-computed case, and the memory/hardware readings."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ftkit import hardware, metrics


def test_step_flops_by_hand():
    cfg = SimpleNamespace(
        num_hidden_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=16,
        vocab_size=10,
    )
    # Per layer: q and o are 8x(2*4) = 64 each, k and v 8x(1*4) = 32 each, gate/up/down 8x16 = 128 each.
    per_layer = 64 + 64 + 32 + 32 + 3 * 128
    assert per_layer == 576
    n_frozen = 2 * per_layer + 10 * 8  # + lm_head
    assert metrics.matmul_params(cfg) == n_frozen == 1232
    n_lora = 100
    # Two sequences of 3 and 5 real tokens: 4*N_frozen + 6*N_lora per token, plus causal attention
    # 6 * layers * (heads * head_dim) * s per token, i.e. 6 * 2 * 8 * s^2 per sequence.
    expected = (3 + 5) * (4 * 1232 + 6 * 100) + 6 * 2 * 8 * (3**2 + 5**2)
    assert expected == 47488
    assert metrics.step_flops([3, 5], cfg, n_lora) == expected
    # The MFU counts the lm_head (10 x 8) at the answer positions only, 4 of them here, as the step computes it.
    at_answers = expected - 4 * 80 * (3 + 5) + 4 * 80 * 4
    assert metrics.step_flops([3, 5], cfg, n_lora, logit_positions=4) == at_answers
    row = metrics.step_row(step=1, loss=1.0, grad_norm=1.0, lr=0.0, target_tokens=4, lengths=[3, 5], config=cfg,
                           n_lora=n_lora, seconds=2.0, peak=1e4, devices=1, device=torch.device("cpu"))  # fmt: skip
    assert row["mfu"] == at_answers / (2.0 * 1e4)


def test_palms_count_against_this_projects_at_the_reference_configuration():
    """PaLM's 6N + 12 L H Q T per token credits a frozen base with weight gradients, the lm_head at every token and
    unmasked attention. At Qwen3-4B's shape, 16 sequences of 2048 tokens with 256 answer positions each (realscale's
    runs), it counts 1.66x what this project's MFU counts: a PaLM-convention MFU of 1.66 x ours is the same step."""
    from ftkit import models

    cfg = models.model_config(models.QWEN3_4B_SHAPE)
    lengths, answers = [2048] * 16, 256 * 16
    ours = metrics.step_flops(lengths, cfg, n_lora=33_030_144, logit_positions=answers)
    palm = metrics.palm_step_flops(lengths, cfg)
    print(f"PaLM's count / this project's: {palm / ours:.3f}")
    assert round(palm / ours, 2) == 1.66


def test_peak_flops_table():
    assert metrics.peak_flops(torch.device("cpu")) is None
    # Matched on the whole torch.cuda.get_device_name(), so an H100 PCIe is not read as an SXM H100 nor an L40S as
    # an L4 (tests/test_hardware.py has the rest).
    names = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA L40S": 362e12,
        "NVIDIA L4": 121e12,
        "NVIDIA GeForce RTX 4090": 165.2e12,
    }
    for name, flops in names.items():
        assert hardware.gpu_for_device_name(name).bf16_flops == flops, name
    assert hardware.gpu_for_device_name("Tesla T4") is None


def test_cpu_peak_memory_sees_an_allocation():
    cpu = torch.device("cpu")
    metrics.reset_peak_memory(cpu)
    before = metrics.peak_memory(cpu)["peak_rss"]
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = metrics.peak_memory(cpu)["peak_rss"]
    assert after - before >= 60 * 2**20
    del block


def test_hardware_names_the_cpu_model():
    from pathlib import Path

    info = hardware.describe(torch.device("cpu"), world_size=1)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "model name" in cpuinfo.read_text():
        assert info["cpu"] in cpuinfo.read_text() and info["cpu"] not in ("x86_64", "")
    assert info["cpu"]
