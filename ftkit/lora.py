"""The adapter: PEFT's LoRA on Qwen3's seven projections, the frozen base around it (activation checkpointing), the
dtype the adapters compute in, the logits at the answer positions, and a merged model for inference."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from ftkit import attention, models
from ftkit.errors import RunError

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The same seven split for tensor parallelism (tp-ft, tp-sp-ft), as Megatron-LM splits them:
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features (heads, MLP columns) split
ROW_PARALLEL = ("o_proj", "down_proj")  # input features split; each rank adds its partial sum into the reduction


def checkpoint_every(spec: str) -> int:
    """--checkpointing's period: 0 for `none`, 1 for `all`, K for `every-K` (layers 0, K, 2K, ... checkpointed;
    `every-1` is `all`). Any other spelling is a RunError that names the allowed forms."""
    every = {"all": 1, "none": 0}.get(spec)
    if every is None:
        k = spec.removeprefix("every-") if isinstance(spec, str) else ""
        every = int(k) if k.isdigit() and k == str(int(k)) else 0
        if every < 1:
            raise RunError(f"--checkpointing {spec!r}: give all, none or every-K (K an integer >= 1, e.g. every-2)")
    return every


def checkpointed_layers(spec: str, n_layers: int) -> list[bool]:
    """Which of `n_layers` decoder layers --checkpointing `spec` recomputes in backward: layer i where K divides i."""
    every = checkpoint_every(spec)
    return [every > 0 and i % every == 0 for i in range(n_layers)]


def freeze_base(model, checkpointing: bool | str, reentrant: bool = False):
    """Freeze every base weight and switch on activation checkpointing (`checkpointing`: a --checkpointing spec,
    all, none or every-K, or True/False for all/none), for LoRA on a bf16 or a 4-bit base.

    In place of peft's prepare_model_for_kbit_training, which casts every non-4-bit weight to fp32: the tied
    embedding / lm_head (151936 x 2560) among them, so that the residual stream, the logits and the step's
    largest matmul would all run in fp32. Here they stay in the compute dtype; Qwen3's RMSNorm already takes its
    variance in fp32, and the LoRA adapters' weights are fp32 (peft's default; see `adapters_compute_in`)."""
    for p in model.parameters():
        p.requires_grad_(False)
    spec = {True: "all", False: "none"}.get(checkpointing, checkpointing)
    if checkpoint_every(spec):
        checkpoint_activations(model, reentrant, spec)
        if reentrant:  # the reentrant kind backpropagates only into a checkpoint whose input requires grad
            model.enable_input_require_grads()
    return model


def checkpoint_activations(model, reentrant: bool = False, checkpointing: str = "all") -> None:
    """transformers' activation checkpointing of the decoder layers --checkpointing chooses (`checkpointed_layers`:
    every one, or every K-th from layer 0), torch.utils.checkpoint, non-reentrant unless asked. transformers turns it
    on for every layer; the layers not chosen are turned off again (each layer checks its own `gradient_checkpointing`,
    eager and compiled alike: `compilation._CompiledForward`). transformers 5.2x calls it
    activation_checkpointing_enable, and its old name gradient_checkpointing_enable a deprecated alias that warns; the
    transformers that Python 3.10 resolves may have the old name only."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer, chosen in zip(layers, checkpointed_layers(checkpointing, len(layers))):
        layer.gradient_checkpointing = chosen


def lora_config(rank: int, alpha: float, dropout: float):
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(LORA_TARGETS),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model, rank: int, alpha: float, dropout: float, seed: int):
    """PEFT LoRA on all seven projections; the adapter's random init (lora_A) is seeded so that every
    technique starts from the same adapter. The scripts save it with save_embedding_layers=False: the embedding is
    neither targeted nor resized, and PEFT's default ("auto") looks for the base model's config.json at every save,
    on the hub unless --model is a local folder (a request for Qwen/Qwen3-4B, a warning for 'tiny')."""
    from peft import get_peft_model

    torch.manual_seed(seed + 1)
    return get_peft_model(model, lora_config(rank, alpha, dropout))


def adapters_compute_in(model, dtype: torch.dtype):
    """Let the LoRA adapters compute in the activation dtype while their weights stay fp32, the optimizer's master
    copy (fp32 gradients). Call once after `apply_lora`, and run every forward under `compute_autocast`.

    PEFT's LoRA forward casts a projection's input to the adapters' dtype: on a bf16 base each adapter would make
    an fp32 copy of a bf16 activation, apply dropout to it and run two fp32 matmuls off the tensor cores. With that
    cast switched off, autocast casts the small adapter weights to bf16 instead (once per autocast region).
    In fp32 nothing changes."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if dtype != torch.float32:
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = False
    return model


def compute_autocast(device: torch.device, dtype: torch.dtype):
    """The context every training and eval forward runs in, for `adapters_compute_in`: autocast to the compute
    dtype, which here only changes the LoRA matmuls (the base already is in `dtype`; Qwen3's RMSNorm and RoPE
    compute in fp32 themselves, the loss takes fp32 logits). Non-reentrant activation checkpointing restores it
    on recompute. In fp32, no autocast at all."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def answer_logits(model, mb: dict) -> torch.Tensor:
    """The logits the loss needs: the forward of a micro-batch (`batching.collate`'s or `collate_packed`'s) with
    the lm_head run on the answer positions only (`logits_to_keep`), so the [micro, seq, vocab] logits of whole
    sequences are never made. Only the logits are kept of the model's output: once the loss is taken, backward
    frees them. The attention layout is `attention.model_inputs`': packed rows' example boundaries handed to the
    kernel (varlen lengths, or a block-diagonal mask), padded rows plain causal (right-padded: no real token sees a
    pad), and no KV cache (`use_cache=False`)."""
    out = model(**attention.model_inputs(mb, model.config), logits_to_keep=mb["logit_positions"], use_cache=False)
    return out.logits


def merge_adapter(model: str, seed: int, adapter: Path, out: Path, vocab_size: int, dtype: torch.dtype) -> None:
    """Base + LoRA in one ordinary transformers checkpoint (`out`), built on the CPU with PEFT's own merge, so it
    is exactly what `PeftModel.merge_and_unload` would give any user; `out/ftkit.json` names the base."""
    from peft import PeftModel

    base = models.load_model(
        model, quant="none", dtype=dtype, device=torch.device("cpu"), seed=seed, vocab_size=vocab_size
    )
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(out)
    (out / "ftkit.json").write_text(json.dumps({"model": model, "seed": seed}))
