"""The model presets and the 4-bit base on CPU."""

from __future__ import annotations

import re

import pytest
import torch

from ftkit import lora, models
from ftkit.errors import ModelError


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


def test_qlora_keeps_the_embedding_lm_head_and_norms_in_the_compute_dtype():
    """QLoRA in bf16: the 4-bit linears dequantize to bf16, and everything else of the base stays bf16 too, so the
    residual stream, the logits and the lm_head matmul (the step's largest: 151936 x 2560 at Qwen3-4B) run in
    bf16. peft's prepare_model_for_kbit_training would have cast the embedding, lm_head and norms to fp32."""
    from peft import prepare_model_for_kbit_training

    def qlora():
        return models.load_model("tiny", quant="nf4", dtype=torch.bfloat16, device=torch.device("cpu"), seed=0)

    model = lora.apply_lora(lora.freeze_base(qlora(), checkpointing="all"), 16, 32.0, 0.0, seed=0)
    inner = model.base_model.model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # tied, as in Qwen3-4B
    assert inner.lm_head.weight.dtype == torch.bfloat16
    assert {m.weight.dtype for n, m in model.named_modules() if n.endswith("norm")} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # peft's fp32 adapters
    seen = []
    inner.lm_head.register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)))
    model(input_ids=torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0)))
    assert seen == [(torch.bfloat16, torch.bfloat16)]  # the residual stream into lm_head, and the logits

    old = prepare_model_for_kbit_training(qlora(), use_gradient_checkpointing=False)
    assert old.lm_head.weight.dtype == torch.float32  # what freeze_base avoids


def test_qwen3_4b_shape_is_drawn_in_its_dtype_on_the_cpu(monkeypatch):
    """Random weights come from the CPU generator in the target dtype and are then moved: the same weights on any
    device, and no fp32 copy of a bf16 model on the GPU. Checked on the tiny config (same code path)."""
    from transformers import Qwen3ForCausalLM

    built = []
    real = Qwen3ForCausalLM._from_config.__func__

    def spy(cls, config, **kwargs):
        net = real(cls, config, **kwargs)
        built.append((next(net.parameters()).device.type, next(net.parameters()).dtype))
        return net

    monkeypatch.setattr(Qwen3ForCausalLM, "_from_config", classmethod(spy))
    bf16 = models.load_model("tiny", quant="none", dtype=torch.bfloat16, device=torch.device("cpu"), seed=3)
    assert built == [("cpu", torch.bfloat16)]
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    again = models.load_model("tiny", quant="none", dtype=torch.bfloat16, device=torch.device("meta"), seed=3)
    assert all(p.is_meta for p in again.parameters())  # the meta build draws nothing


def test_random_init_draws_qwen3s_init_in_parallel_blocks(monkeypatch):
    """The random init is Qwen3's (matrices from N(0, initializer_range), norms 1, a tied lm_head drawn once, as
    the embedding) and does not depend on how many threads draw it: each block of rows has its own generator."""
    from concurrent import futures

    config = models.model_config("tiny")
    config.tie_word_embeddings = True
    model = models._random_init(config, 7, torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = {n: p for n, p in model.named_parameters()}
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in weights.items() if p.ndim == 1)
    matrices = torch.cat([p.flatten() for p in weights.values() if p.ndim > 1])
    assert abs(matrices.std().item() - config.initializer_range) < 0.002 and abs(matrices.mean().item()) < 0.001
    embedding = weights["model.embed_tokens.weight"]
    assert not torch.equal(embedding[0], embedding[1])  # every row its own draw, not one block repeated

    monkeypatch.setattr(models, "ThreadPoolExecutor", lambda max_workers: futures.ThreadPoolExecutor(1))
    again = models._random_init(config, 7, torch.float32, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_a_transformers_older_than_5_23_is_refused():
    """Before 5.21, transformers indexes every row with every row's answer positions (on a GPU session: 'Expected
    input batch_size (900) to match target batch_size (450)'); 5.21 and 5.22 checkpoint a decoder layer's
    `__call__`, not the `forward` that --compile compiles inside the checkpoint. The scripts refuse them before
    building anything; 5.23 (pyproject.toml's floor, the lock's) runs."""
    for old in ("5.20.2", "5.22.1"):
        with pytest.raises(ModelError, match=rf"transformers {re.escape(old)} is installed.*5\.23 or newer.*uv sync"):
            models.check_transformers(old)
    models.check_transformers("5.23.0")
    models.check_transformers("5.24.0.dev0")
    models.check_transformers()  # the installed one, the lock's


def tiny_lora(dtype: torch.dtype, dropout: float = 0.0):
    """The tiny model with LoRA as the scripts build it, B drawn at random (PEFT inits it to zero, which would
    leave A without a gradient)."""
    model = models.load_model("tiny", quant="none", dtype=dtype, device=torch.device("cpu"), seed=0)
    model = lora.apply_lora(lora.freeze_base(model, checkpointing="all"), 16, 32.0, dropout, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.train()


def loss_and_grads(model, dtype: torch.dtype, x: torch.Tensor):
    """One training step's forward (under the helper's autocast, as the scripts run it) and backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks on every call
    with lora.compute_autocast(torch.device("cpu"), dtype):
        out = model(input_ids=x, labels=x)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), out.logits.detach(), grads


def test_adapters_compute_in_bf16_with_fp32_master_weights():
    """On a bf16 base the LoRA matmuls run in bf16 (no fp32 copy of an activation, no fp32 GEMM) in forward, in
    the checkpointed recompute and in backward, while the adapters' weights and gradients stay fp32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in matmuls:
                self.dtypes.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    x = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    reference, _, _ = loss_and_grads(tiny_lora(torch.bfloat16), torch.float32, x)  # PEFT's fp32 adapters

    model = lora.adapters_compute_in(tiny_lora(torch.bfloat16), torch.bfloat16)
    with MatmulDtypes() as mode:
        loss, _, grads = loss_and_grads(model, torch.bfloat16, x)
    assert set(mode.dtypes) == {torch.bfloat16}  # base and LoRA, forward, recompute and backward (306 matmuls)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert all(g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads.values())
    assert torch.allclose(loss.float(), reference.float(), rtol=1e-2)


def test_adapters_compute_in_fp32_changes_nothing():
    """The CPU walkthrough (fp32, which every parity test runs): the same logits and gradients to the bit."""
    x = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    model = tiny_lora(torch.float32, dropout=0.05)
    loss, logits, grads = loss_and_grads(model, torch.float32, x)
    grads = {n: g.clone() for n, g in grads.items()}
    lora.adapters_compute_in(model, torch.float32)
    loss2, logits2, grads2 = loss_and_grads(model, torch.float32, x)
    assert torch.equal(loss, loss2) and torch.equal(logits, logits2)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)
