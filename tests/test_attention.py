"""Packed rows on every attention kernel (issue 41): no example attends to another, whatever kernel the model runs;
the varlen kernels a GPU runs (flash-attn's, torch's) see the boundaries `batching.collate_packed` worked out; and
nothing in a micro-batch's forward and backward waits for the device (a host sync), library code included.

The varlen kernels run on CUDA only, so here they are replaced by a reference that honours only what it is given -
the rows flattened and cut at `cu_seq_lens` - the way a GPU's kernel would: a model that handed them no boundaries
would mix the examples, and the packed loss would not be the padded one."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ftkit import attention, batching, lora, models
from ftkit.data import IGNORE_INDEX, Encoded


def example(seed: int, n: int, answer: int) -> Encoded:
    """A synthetic example of n tokens whose last `answer` are the target."""
    ids = torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Encoded(ids, [IGNORE_INDEX] * (n - answer) + ids[n - answer :], False)


def tiny(attn: str, grad_checkpointing: bool = False):
    model = models.load_model("tiny", quant="none", dtype=torch.float32, device=torch.device("cpu"), seed=0, attn=attn)
    return lora.apply_lora(lora.freeze_base(model, grad_checkpointing), rank=8, alpha=16.0, dropout=0.0, seed=0)


def row_losses(model, mb: dict) -> torch.Tensor:
    """Each row's summed token loss (rows [rows])."""
    logits = lora.answer_logits(model, mb)
    losses = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), mb["targets"], ignore_index=IGNORE_INDEX, reduction="none"
    )
    return losses.sum(-1)


def reference_varlen(q, k, v, cu, max_len, scale, dropout):
    """What a varlen kernel computes, from nothing but the flattened rows and their segments' cumulative lengths:
    causal attention inside each segment (built as a mask on the device, so it has no host sync either)."""
    tokens = q.shape[0]
    segment = torch.searchsorted(cu[1:], torch.arange(tokens, dtype=cu.dtype), right=True)
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(tokens, tokens, dtype=torch.bool).tril()
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_no_example_attends_to_another(attn):
    """Row 0 packs examples A and B; changing A's tokens changes neither B's loss nor B's logits, on the kernels
    that run on a CPU without compiling (flex attention runs too, but compiles its kernel by inductor in every
    process, 30-60 s here, and no script chooses it)."""
    a, b, c = example(1, 40, 10), example(2, 30, 8), example(3, 60, 12)
    other_a = example(4, 40, 10)
    model = tiny(attn)
    base = batching.collate_packed([[a, b], [c]], 128)
    changed = batching.collate_packed([[other_a, b], [c]], 128)
    assert base["packed"] and base["cu_seq_lens"].tolist() == [0, 40, 70, 128, 188, 256]
    with torch.no_grad():
        logits = lora.answer_logits(model, base)[0]
        logits_changed = lora.answer_logits(model, changed)[0]
    b_rows = slice(10, 10 + 8)  # row 0's targets: A's 10 answer tokens, then B's 8
    assert not torch.allclose(logits[:10], logits_changed[:10])  # A's own logits do change
    torch.testing.assert_close(logits[b_rows], logits_changed[b_rows], rtol=0, atol=1e-6)
    # B alone in its own row (a padded micro-batch of one example): B's loss is the one it has when packed after A
    alone = batching.collate([b])
    with torch.no_grad():
        loss_alone = row_losses(model, alone)[0]
        b_loss = torch.nn.functional.cross_entropy(logits[b_rows], base["targets"][0, b_rows], reduction="sum")
    torch.testing.assert_close(b_loss, loss_alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_kv_cache_left_on_changes_no_packed_logit(attn):
    """fsdp-ft's --use-cache (a silent failure) costs memory, not correctness: within one forward the cache holds the
    keys and values the layer attends to anyway, and packed examples stay apart (its help and the FSDP post say so)."""
    a, b = example(1, 40, 10), example(2, 30, 8)
    model = tiny(attn)
    mb = batching.collate_packed([[a, b]], 128)
    with torch.no_grad():
        off, on = (model(**attention.model_inputs(mb, model.config), use_cache=c) for c in (False, True))
    assert off.past_key_values is None and on.past_key_values is not None
    torch.testing.assert_close(on.logits, off.logits, rtol=0, atol=0)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """flash-attn 'installed': a module whose varlen function is the reference (and whose plain function, the
    kernel transformers' FA2 path runs on rows it takes for unpacked, attends across the whole row)."""
    module = types.ModuleType("flash_attn")
    module.__spec__ = types.SimpleNamespace(name="flash_attn")
    module.flash_attn_varlen_func = lambda q, k, v, cu, _cu, max_q, _max_k, dropout_p, softmax_scale, causal: (
        reference_varlen(q, k, v, cu, max_q, softmax_scale, dropout_p)
    )
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


@pytest.mark.parametrize("backend", ["flash-attn", "torch"])
def test_varlen_kernels_get_the_boundaries(monkeypatch, fake_flash_attn, backend):
    """The kernel the scripts choose on a CUDA GPU in bf16 (`models.attention_implementation`), built on the CPU,
    its varlen kernel (flash-attn's, or torch's varlen_attn) replaced by the reference: packed rows give the loss
    and the logits of the same examples padded one per row, to 1e-5."""
    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(
        torch_varlen,
        "varlen_attn",
        lambda q, k, v, cu, _cu, max_q, _max_k, scale, window_size, enable_gqa=False: reference_varlen(
            q, k, v, cu, max_q, scale, 0.0
        ),
    )
    monkeypatch.setattr(models, "flash_attn_installed", lambda: backend == "flash-attn")
    attn = models.attention_implementation(torch.device("cuda"), torch.bfloat16)
    assert attn == attention.VARLEN
    attention.register(backend)
    try:
        model = tiny(attn)
        items = [example(1, 40, 10), example(2, 30, 8), example(3, 60, 12), example(4, 20, 5)]
        packed = batching.collate_packed([items[:2], items[2:]], 128)
        padded = batching.collate(items)
        with torch.no_grad():
            packed_loss = row_losses(model, packed).sum()
            padded_loss = row_losses(model, padded).sum()
        assert attention.kernels(attn)["packed"].startswith(
            "flash-attn" if backend == "flash-attn" else "torch varlen_attn"
        )
    finally:
        attention.register()
    n_target = sum(e.n_target for e in items)  # the loss as the scripts normalise it
    torch.testing.assert_close(packed_loss / n_target, padded_loss / n_target, rtol=0, atol=1e-5)


class HostSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for the device: a tensor's value read on the host
    (`_local_scalar_dense`: .item(), bool(), int()) or an output whose size depends on the data (nonzero)."""

    SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::masked_select", "aten::unique2"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCS:
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("attn", ["sdpa", attention.VARLEN])
def test_no_host_sync_in_a_micro_batch(monkeypatch, layout, attn):
    """One micro-batch as the scripts run it - onto the device, the forward under autocast, the loss, backward, the
    loss summed - watched at the dispatcher, transformers' and peft's code included: no host sync. (VARLEN's kernel
    is the device-side reference here.)"""
    monkeypatch.setattr(attention, "_kernel", reference_varlen)
    model = tiny(attn)
    model.train()
    items = [example(1, 40, 10), example(2, 30, 8), example(3, 60, 12), example(4, 20, 5)]
    mb = batching.collate_packed([items[:2], items[2:]], 128) if layout == "packed" else batching.collate(items)
    loss_sum = torch.zeros(())
    with HostSyncs() as syncs:
        mb = batching.to_device(mb, torch.device("cpu"))
        with lora.compute_autocast(torch.device("cpu"), torch.float32):
            loss = batching.token_loss_sum(lora.answer_logits(model, mb), mb["targets"]) / 100
        loss.backward()
        loss_sum += loss.detach()
    assert syncs.ops == []


def test_compiled_layers_take_the_varlen_boundaries(monkeypatch):
    """The decoder layers compiled (`compilation.compile_layers`, dynamo + AOTAutograd) with VARLEN, the boundaries
    an input of the graph: packed micro-batches of two widths run one graph, no break, no recompile, and give the
    eager losses."""
    from torch._dynamo.utils import clear_compilation_metrics, counters

    from ftkit import compilation

    monkeypatch.setattr(attention, "_kernel", reference_varlen)
    monkeypatch.setenv(compilation.COMPILE_BACKEND_ENV, "aot_eager")
    items = [example(1, 40, 10), example(2, 30, 8), example(3, 60, 12), example(4, 20, 5), example(5, 50, 9)]
    micro_batches = [
        batching.collate_packed([items[:2], items[2:4]], 128),
        batching.collate_packed([items[4:], []], 64),
    ]
    eager = [row_losses(tiny(attention.VARLEN), mb).sum() for mb in micro_batches]
    torch._dynamo.reset()  # this process's compiled code and counts (other tests compiled in it)
    counters.clear()
    clear_compilation_metrics()
    model = tiny(attention.VARLEN, grad_checkpointing=True)  # as the scripts run them
    compiled = compilation.compile_layers(model, True)
    losses = [row_losses(model, mb).sum() for mb in micro_batches]
    report = compilation.compile_report(compiled)
    torch._dynamo.reset()
    assert (report["graphs"], report["graph_breaks"], report["recompiles"]) == (1, 0, 0), report.get(
        "recompile_reasons"
    )
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager), rtol=1e-6, atol=1e-5)
