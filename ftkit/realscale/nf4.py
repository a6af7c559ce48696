"""The 4-bit (NF4) base of QLoRA on fake tensors, as bitsandbytes stores and computes it: the meta model's
projections made `Linear4bit` layers by transformers' quantizer (`quantize_meta`), their packed codes for FSDP2 to
shard (`pack_meta`), their weights quantized by bitsandbytes' own `quantize_4bit` (`quantize_fake`) and reported
beside the memory model (`quantization_report`); and, for fake tensors, the 4-bit matmul as bitsandbytes' CUDA
kernel runs it at these row counts (`dequantising_gemm_4bit`) and FSDP's recovery of a weight's quantization
state (`fsdp_quant_state`)."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from unittest import mock

import torch

from ftkit import comm, memory, models
from ftkit.realscale import RealScaleError


def linear4bit_layers(model) -> list[torch.nn.Module]:
    """The model's bitsandbytes `Linear4bit` layers. None without bitsandbytes (the lent GPU machines have none), where
    no layer can be one: a bf16 base's run needs no bitsandbytes."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return []
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def quantize_meta(model, dtype: torch.dtype) -> None:
    """The meta model's projections made bitsandbytes `Linear4bit` layers by transformers' own quantizer, as
    `from_pretrained(quantization_config=models.bnb_config(dtype))` makes them before loading the weights (the
    lm_head stays bf16); `quantize_fake` gives them their 4-bit weights."""
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(models.bnb_config(dtype))
    quantizer.preprocess_model(model, device_map={"": "cpu"}, dtype=dtype)
    quantizer.postprocess_model(model)


def settings_4bit(w) -> dict:
    """A `Params4bit`'s quantization settings, kept on its layer: replacing the parameter (`to_empty`, `pack_meta`)
    drops them."""
    return dict(
        blocksize=w.blocksize,
        compress_statistics=w.compress_statistics,
        quant_type=w.quant_type,
        quant_storage=w.quant_storage,
    )


def pack_meta(model) -> None:
    """Each meta `Linear4bit`'s weight as bitsandbytes stores it once quantized, for FSDP2 to shard as fsdp-ft shards
    the loaded 4-bit base: the packed codes, two per byte in uint8 (`bnb_4bit_quant_storage`'s default), shape
    [out * in / 2, 1], a frozen plain parameter. The layer's settings are kept for `quantize_fake`, which gives the
    layer its quantization constants once there is storage."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            settings = module.settings_4bit = settings_4bit(module.weight)
            storage = settings["quant_storage"]
            packed = (module.out_features * module.in_features + 1) // (2 * storage.itemsize)
            weight = torch.empty(packed, 1, dtype=storage, device="meta")
            module.weight = torch.nn.Parameter(weight, requires_grad=False)


def quantize_fake(model) -> list[torch.Tensor]:
    """Each `Linear4bit`'s weight quantized by bitsandbytes' own `quantize_4bit` from a fake bf16 weight, with the
    layer's settings (NF4, double quantization, blocksize 64), so the packed weight and its quantization constants
    have the shapes and dtypes bitsandbytes gives a loaded checkpoint. Call inside FakeTensorMode: bitsandbytes
    registers fake kernels for its 4-bit ops. The packed weight is a plain frozen parameter carrying its
    `quant_state`, which `Linear4bit.forward` reads (a `Params4bit` cannot wrap a fake tensor); the layer keeps the
    state too (`module.quant_state`), as bitsandbytes' quantization leaves it. A weight FSDP2 has sharded already
    (`pack_meta`) stays: the packed codes must have its shape, and the state is the module's only, whole on every
    rank (`fsdp_quant_state`). Returns the constants' tensors (absmax codes, their fp32 absmax, code book and
    offset), which live beside the parameter."""
    layers = linear4bit_layers(model)
    if not layers:
        return []
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor import DTensor

    with unset_fake_temporarily():  # double quantization's 8-bit code book, which bitsandbytes computes once and caches
        bnb.functional.name2qmap.setdefault("dynamic", bnb.functional.create_dynamic_map())
    constants = []
    for module in layers:
        settings = module.settings_4bit
        # the checkpoint's weight, in the dtype the scripts load it in (their compute dtype)
        weight = torch.empty(module.out_features, module.in_features, dtype=module.compute_dtype)
        packed, state = bnb.functional.quantize_4bit(weight, **settings)
        module.quant_state = state
        if isinstance(module.weight, DTensor):  # sharded by FSDP2: its packed codes, as bitsandbytes packs them
            if module.weight.shape != packed.shape or module.weight.dtype != packed.dtype:
                raise RealScaleError(
                    f"sharded 4-bit weight {tuple(module.weight.shape)} {module.weight.dtype}, bitsandbytes packs "
                    f"{tuple(packed.shape)} {packed.dtype}"
                )
        else:
            module.weight = torch.nn.Parameter(packed, requires_grad=False)
            module.weight.quant_state = state
        constants += [state.absmax, state.offset, state.state2.absmax, state.state2.code]
    return constants


def quantization_report(model, constants: list[torch.Tensor]) -> dict:
    """The 4-bit base's bytes per quantized weight as bitsandbytes stores them (packed codes and constants), beside
    the memory model's NF4_BYTES_PER_PARAM."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    params = sum(m.in_features * m.out_features for m in layers)
    packed = sum(comm.nbytes([m.weight]) for m in layers)
    constant_bytes = comm.nbytes(constants)
    return {
        "quantized": {
            "linear_params": params,
            "packed_bytes": packed,
            "constants_bytes": constant_bytes,
            "bytes_per_param": (packed + constant_bytes) / params,
            "model_bytes_per_param": memory.NF4_BYTES_PER_PARAM,
        }
    }


# Rows above which bitsandbytes' CUDA gemm_4bit always dequantizes the weight and calls F.linear; at or below it a
# per-GPU heuristic picks that or its fused kernel (bitsandbytes/backends/cuda/ops.py, `_gemm_4bit_custom_max_m`,
# `_gemm_4bit_use_custom_cuda`).
GEMM_4BIT_FUSED_MAX_ROWS = 1536


class DequantisingGemm4bit(threading.local):
    """bitsandbytes' `gemm_4bit` op as its CUDA kernel runs it past GEMM_4BIT_FUSED_MAX_ROWS rows
    (`_dequant_linear_fallback`): the 8-bit absmax dequantized to fp32, the weight dequantized to a new tensor in
    the activation dtype, F.linear. Its fake kernel returns an empty output, allocating and computing nothing.
    It runs inside bitsandbytes' autograd Function, where grad mode is off even in checkpointing's recompute:
    `in_forward` tells MatmulDtypes that its matmul is a forward."""

    in_forward = False

    def default(self, A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, **nested):
        ops = torch.ops.bitsandbytes
        if absmax_8bit is not None:
            absmax = (
                ops.dequantize_blockwise(absmax_8bit, absmax, nested["absmax_code"], 256, torch.float32)
                + nested["absmax_offset"]
            )
        weight = ops.dequantize_4bit(B, absmax, blocksize, quant_type, shapeB, A.dtype)
        self.in_forward = True
        try:
            return torch.nn.functional.linear(A, weight, bias)
        finally:
            self.in_forward = False


GEMM_4BIT = DequantisingGemm4bit()


@contextlib.contextmanager
def dequantising_gemm_4bit():
    with mock.patch.object(torch.ops.bitsandbytes, "gemm_4bit", GEMM_4BIT):
        yield


@contextlib.contextmanager
def fsdp_quant_state():
    """bitsandbytes' recovery of a 4-bit weight's quantization state under FSDP, for fake tensors. FSDP2 replaces a
    `Linear4bit`'s weight with its own parameters (the shard, the gathered one), which carry no `quant_state`;
    `Linear4bit.forward` then wraps the gathered weight in a `Params4bit` (sharing its storage) and gives it the
    module's `quant_state` (`fix_4bit_weight_quant_state_from_module`). A `Params4bit` cannot wrap a fake tensor:
    here the gathered parameter is given the module's state as it is. Nothing is allocated either way."""
    import bitsandbytes as bnb

    def attach(module) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            module.weight.quant_state = module.quant_state

    with mock.patch.object(bnb.nn.modules, "fix_4bit_weight_quant_state_from_module", attach):
        yield
