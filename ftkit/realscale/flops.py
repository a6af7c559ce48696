"""FLOPs as the GPU computes them, counted on fake tensors: SDPA's formulas for the query-key pairs a causal mask
keeps (`causal_sdpa_formulas`, for torch's FlopCounterMode), and this command's own count of the same ops by
operand dtype and by component, with activation checkpointing's recompute kept apart (`MatmulDtypes`)."""

from __future__ import annotations

from collections import defaultdict

import torch

from ftkit.realscale.nf4 import GEMM_4BIT


def causal_pairs(s_q: int, s_k: int, lower_right: bool = False) -> int:
    """Query-key pairs a causal mask keeps (SDPA's is_causal: query i sees keys 0..i): the lower triangle with its
    diagonal, s(s+1)/2 of s x s when s_q == s_k. lower_right: the mask aligned at the bottom right, query i seeing
    keys 0..i + s_k - s_q (CUDA's flash kernel's is_causal; cp-ft's causal_lower_right)."""
    if lower_right and s_q <= s_k:
        return s_q * (s_k - s_q) + s_q * (s_q + 1) // 2
    if s_q <= s_k:
        return s_q * (s_q + 1) // 2
    return s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k


def causal_sdpa_formulas() -> dict:
    """FLOP formulas for PyTorch's SDPA ops (forward and backward, every backend) that count a causal call's kept
    query-key pairs only. FlopCounterMode's own formulas count the whole s x s whatever is_causal says; the causal
    kernels the scripts run on a GPU (flash, memory-efficient, cuDNN; flash-attn's) skip the tiles above the
    diagonal, so they do about half of it (the diagonal's tiles, computed whole, add about tile / s: 3% of the
    attention FLOPs for 64-row tiles at s = 2048). For FlopCounterMode (`custom_mapping`) and `MatmulDtypes`."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    ops = [
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_cudnn_attention,
    ]
    ops += [getattr(aten, f"{op.__name__}_backward") for op in ops]

    def causal(op):
        whole = flop_registry[op]
        # CUDA's flash kernel aligns a causal mask at the bottom right when the key sequence is longer (torch's
        # CausalBias calls it with is_causal for causal_lower_right); the others at the top left.
        lower_right = op.__name__.removesuffix("_backward") == "_scaled_dot_product_flash_attention"
        names = [a.name for a in op.default._schema.arguments]

        def formula(*args, out_val=None, **kwargs):
            flops = whole(*args, out_val=out_val, **kwargs)
            bound = {**dict(zip(names, args)), **kwargs}
            if not bound.get("is_causal"):
                return flops
            s_q, s_k = bound["query"].shape[-2], bound["key"].shape[-2]
            return flops * causal_pairs(s_q, s_k, lower_right) // (s_q * s_k)

        formula._get_raw = True  # FlopCounterMode passes the tensors themselves (and is_causal) to a raw formula
        return formula

    return {op: causal(op) for op in ops}


class MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """FLOPs of every op FlopCounterMode has a formula for (matmuls, attention), by the dtype of its two operands
    (the first two floating tensors of two or more dims: a and b of mm, the bias of addmm skipped; query and key of
    attention, grad_out and query of its backward), and by component: the lm_head (an operand with the vocabulary
    as a dim), attention (SDPA), and the rest (projections and adapters). FLOPs of activation checkpointing's
    recomputed forward are kept apart (`recompute`): ops that run inside backward with grad mode on (the autograd
    engine runs the backward functions with it off; torch.utils.checkpoint recomputes under enable_grad), and a
    4-bit layer's forward matmul there (bitsandbytes' autograd Function runs it with grad mode off,
    `DequantisingGemm4bit`).

    A DTensor op (tp-ft's sharded projections) is seen here, as by FlopCounterMode, at its logical (whole-tensor)
    shape, before DTensor runs it on the local shards: its FLOPs are counted on the local shards, this rank's
    work."""

    def __init__(self, vocab: int, formulas: dict):
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry, self.vocab = {**flop_registry, **formulas}, vocab
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.by_component: dict[str, int] = defaultdict(int)
        self.recompute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func._overloadpacket)
        if formula is not None:
            args, kwargs, local_out = torch.utils._pytree.tree_map_only(
                DTensor, lambda t: t.to_local(), (args, kwargs, out)
            )
            flops = formula(*args, **kwargs, out_val=local_out)
            if torch._C._current_graph_task_id() != -1 and (torch.is_grad_enabled() or GEMM_4BIT.in_forward):
                self.recompute += flops
                return out
            flat = torch.utils._pytree.tree_leaves((args, kwargs))
            operands = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2][:2]
            dtypes = "x".join(sorted({str(t.dtype).removeprefix("torch.") for t in operands}))
            self.by_dtype[dtypes] += flops
            if "attention" in func._overloadpacket.__name__:
                self.by_component["attention"] += flops
            elif any(self.vocab in t.shape for t in operands):
                self.by_component["lm_head"] += flops
            else:
                self.by_component["projections_and_adapters"] += flops
        return out
