"""Attention over packed rows: the example boundaries, worked out on the host when a micro-batch is collated
(`batching.collate_packed`'s `cu_seq_lens`), handed to whichever attention kernel the model runs, so that no
example attends to another on any of them, and nothing in the forward asks the GPU where an example starts.

- A varlen kernel (CUDA, bf16/fp16): the rows flattened into one sequence of segments, each example and each
  padding run its own, cut by `cu_seq_lens` (the cumulative lengths; FlashAttention-2's varlen interface, Dao 2023,
  arXiv 2307.08691). flash-attn's `flash_attn_varlen_func` where it is installed, else torch's own
  `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10). It is registered with transformers' attention interface
  as `VARLEN` (`varlen_attention`); padded rows, which carry no `cu_seq_lens`, take SDPA's causal kernel there.
- SDPA (CPU, or a GPU with no varlen kernel): a block-diagonal causal mask, built on the device from `cu_seq_lens`,
  for micro-batches that pack two examples or more into a row; a micro-batch of one example per row gets no mask
  at all (`is_causal`: SDPA's flash kernel on CUDA). Eager attention (the boundary tests) has no causal flag: it
  always gets a mask, causal per row where the rows are not packed.

`model_inputs` passes the mask (or none) to the model as a mapping, `{layer type: mask}`, which transformers takes
as prepared: it then never runs `masking_utils.find_packed_sequence_indices`, whose `.all()` is a host sync.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VARLEN = "ftkit_varlen"  # the attention implementation registered with transformers (`register`)


def varlen_backend() -> str:
    """The varlen kernel `varlen_attention` runs: "flash-attn" where it is installed, else "torch" (varlen_attn)."""
    return "flash-attn" if importlib.util.find_spec("flash_attn") is not None else "torch"


def torch_has_varlen() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def varlen_kernel(backend: str):
    """The varlen kernel of `backend` as one signature: (q, k, v [tokens, heads, dim], cu_seq_lens, max_len, scale,
    dropout) -> [tokens, heads, dim], causal inside each segment. Chosen once, outside the compiled layers."""
    if backend == "flash-attn":
        from flash_attn import flash_attn_varlen_func

        def flash(q, k, v, cu, max_len, scale, dropout):
            return flash_attn_varlen_func(
                q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scale, causal=True
            )

        return flash
    from torch.nn.attention.varlen import varlen_attn

    gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters  # torch 2.10/2.11: K and V at the query's heads

    def torch_varlen(q, k, v, cu, max_len, scale, dropout):
        if gqa:
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0), enable_gqa=True)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0))

    return torch_varlen


_kernel = None  # the varlen kernel `register` chose, and its backend's name
_backend = None


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-interface signature (query [rows, heads, width, dim], key and value at the KV heads;
    returns [rows, width, heads, dim]). With `cu_seq_lens_q` (a packed micro-batch) the rows are flattened and each
    segment attends causally to itself alone; without (padded rows, an eval, a pipeline stage), SDPA as transformers
    runs it. The kernels take the longest segment only to size their grid (one block of queries per segment and
    tile of that length): `max_length_q`, the longest an example may be (`batching.collate_packed`'s
    `max_segment`: the same int every micro-batch, so a compiled layer sees one constant and compares it with
    nothing, where a comparison with the width would guard and recompile), else the row width (a dynamic size under
    torch.compile). A row of --micro-batch-tokens 16384 holding examples of at most 2048 sized by its width would
    launch 8x the blocks, seven in eight idle."""
    cu_seq_lens = kwargs.pop("cu_seq_lens_q", None)
    kwargs.pop("cu_seq_lens_k", None)
    max_segment = kwargs.pop("max_length_q", None)
    kwargs.pop("max_length_k", None)
    if cu_seq_lens is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, width, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(rows * width, t.shape[1], dim) for t in (query, key, value))
    out = _kernel(q, k, v, cu_seq_lens, max_segment or width, scaling, dropout)
    return out.view(rows, width, heads, dim), None


def register(backend: str | None = None) -> None:
    """`VARLEN` in transformers' attention interface (a model built with it calls `varlen_attention`), its kernel
    `backend`'s [`varlen_backend()`]."""
    from transformers import AttentionInterface

    global _kernel, _backend
    _backend = backend or varlen_backend()
    _kernel = varlen_kernel(_backend)
    AttentionInterface.register(VARLEN, varlen_attention)


def kernels(implementation: str) -> dict[str, str]:
    """What each layout runs under `implementation` (the run prints it once and its summary records it)."""
    if implementation == VARLEN:
        packed = "flash-attn flash_attn_varlen_func" if _backend == "flash-attn" else "torch varlen_attn"
        return {"packed": f"{packed} (cu_seq_lens)", "padded": "sdpa, is_causal"}
    mask = {
        "sdpa": "sdpa, block-diagonal bool mask",
        "eager": "eager, block-diagonal additive mask",
    }
    if implementation not in mask:  # a technique's own (cp-ft's cp_attention): it lays its rows out itself
        return {"packed": implementation, "padded": implementation}
    return {
        "packed": mask[implementation] + " (one example per row: causal)",
        "padded": f"{implementation}, causal",
    }


def model_inputs(mb: dict, config) -> dict:
    """The model's inputs for a collated micro-batch (`batching.collate` or `collate_packed`) beside the logits'
    positions: the ids, the position ids, and the attention layout as a mapping transformers takes as it is."""
    implementation = config._attn_implementation
    inputs = {"input_ids": mb["input_ids"], "position_ids": mb.get("position_ids")}
    rows, width = mb["input_ids"].shape
    mask = None
    if implementation == VARLEN and "cu_seq_lens" in mb:
        inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = mb["cu_seq_lens"]
        if "max_segment" in mb:
            inputs["max_length_q"] = inputs["max_length_k"] = mb["max_segment"]
    elif mb.get("packed"):
        mask = block_causal_mask(mb["cu_seq_lens"], rows, width, implementation)
    elif implementation == "eager":  # no is_causal of its own: a mask makes it causal
        whole_rows = torch.arange(0, rows * width + 1, width, dtype=torch.int32, device=mb["input_ids"].device)
        mask = block_causal_mask(whole_rows, rows, width, implementation)
    inputs["attention_mask"] = {kind: mask for kind in set(getattr(config, "layer_types", None) or ["full_attention"])}
    return inputs


def block_causal_mask(cu_seq_lens: torch.Tensor, rows: int, width: int, implementation: str):
    """The block-diagonal causal mask of packed rows, from the segments' cumulative lengths, on their device: a
    position attends to the ones before it in its own segment. SDPA takes it as bool [rows, 1, width, width] (True:
    attend), eager as an additive float mask."""
    device = cu_seq_lens.device
    flat = torch.arange(rows * width, device=device, dtype=cu_seq_lens.dtype)
    segment = torch.searchsorted(cu_seq_lens[1:], flat, right=True).view(rows, width)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = (segment[:, None, :, None] == segment[:, None, None, :]) & causal
    if implementation == "eager":
        return torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask


register()  # every process that imports ftkit.models can build a model with VARLEN
