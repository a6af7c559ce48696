"""The model presets and the 4-bit base on CPU."""

from __future__ import annotations

import torch

from ftkit import models


def test_tiny_config_divides_for_tp_and_pp():
    cfg = models.model_config("tiny", vocab_size=4096)
    for degree in (2, 4):
        assert cfg.num_key_value_heads % degree == 0 and cfg.num_attention_heads % degree == 0
        assert cfg.num_hidden_layers % degree == 0
    assert cfg.tie_word_embeddings  # like Qwen3-4B


def test_qwen3_4b_shape_matches_the_real_config():
    from transformers import Qwen3ForCausalLM

    cfg = models.model_config("qwen3-4b-shape")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        36,
        2560,
        32,
        8,
    )
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (
        128,
        9728,
        151936,
        True,
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 4.0e9 < n < 4.03e9  # Qwen3-4B: 4.0B parameters


def test_eval_pass_does_not_change_4bit_training_numerics():
    """See models._keep_cpu_4bit_layout: without it, the eval forward repacks the CPU weights."""
    model = models.load_model("tiny", quant="nf4", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    x = torch.randint(0, 4096, (1, 24), generator=torch.Generator().manual_seed(0))
    model.train()
    before = model(x).logits
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    assert torch.equal(model(x).logits, before)


def test_random_init_is_a_function_of_the_seed():
    a = models.load_model("tiny", quant="none", dtype=torch.float32, device=torch.device("cpu"), seed=5)
    b = models.load_model("tiny", quant="none", dtype=torch.float32, device=torch.device("cpu"), seed=5)
    c = models.load_model("tiny", quant="none", dtype=torch.float32, device=torch.device("cpu"), seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
