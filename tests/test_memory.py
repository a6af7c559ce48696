"""The memory model: the ZeRO paper's figure, parameter counts against real modules, the sharding laws, and
the activation derivation against the tensors autograd actually saves on a tiny Qwen3."""

import functools
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from ftkit import lora
from ftkit.activations import layer_activation_bytes
from ftkit.memory import (
    LORA_TARGETS,
    NF4_BYTES_PER_PARAM,
    QWEN3_4B,
    ModelShape,
    lora_params,
    predict,
    zero_bytes,
)

TINY = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    intermediate_size=256,
    vocab_size=1024,
    tie_word_embeddings=True,
)
QWEN3_4B_CONFIG = dict(
    hidden_size=2560,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=9728,
    vocab_size=151936,
    tie_word_embeddings=True,
)


@pytest.fixture
def one_thread():
    """Tiny matmuls: a CPU thread pool only adds contention (seconds per forward on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_states(p) -> float:
    return p.weights + p.lora + p.gradients + p.optimizer


def test_zero_figure_1():
    # Rajbhandari et al. 2020, Fig. 1: a 7.5B model, K = 12, N_d = 64, in GB (1e9 bytes), one decimal.
    gb = [round(zero_bytes(7.5e9, k=12, n_d=64, stage=s) / 1e9, 1) for s in range(4)]
    assert gb == [120.0, 31.4, 16.6, 1.9]


def test_qwen3_4b_param_count_matches_transformers():
    # embeddings 151936*2560 = 388,956,160 (tied lm_head) + 36 layers * (100,925,440 projection weights
    # + 5,376 norm weights) + final norm 2,560 = 4,022,468,096
    assert QWEN3_4B.n_params() == 4_022_468_096
    config = Qwen3Config(**QWEN3_4B_CONFIG)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == QWEN3_4B.n_params()
    assert ModelShape.from_config(config) == QWEN3_4B
    assert ModelShape.from_config(QWEN3_4B_CONFIG) == QWEN3_4B


def tiny_lora_model(dtype: torch.dtype, rank: int, dropout: float, layers: int = 4, peft_default: bool = False):
    """peft_default: the adapters compute as PEFT does by default (fp32, its input cast on), not as the scripts."""
    torch.manual_seed(0)
    config = Qwen3Config(**{**TINY, "num_hidden_layers": layers}, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config).to(dtype)
    adapter = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=list(LORA_TARGETS))
    model = get_peft_model(model, adapter)
    return (model if peft_default else lora.adapters_compute_in(model, dtype)).train()


def test_lora_params_match_peft(one_thread):
    model = tiny_lora_model(torch.float32, rank=8, dropout=0.0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(ModelShape.from_config(TINY), 8) == trainable


def test_qwen3_4b_lora_and_per_layer_activations():
    # The numbers quoted in ftkit/memory.py's docstrings.
    assert lora_params(QWEN3_4B, 16) == 33_030_144
    assert sum(layer_activation_bytes(QWEN3_4B, act_bytes=2)) == 150_024
    assert sum(layer_activation_bytes(QWEN3_4B, act_bytes=2, lora_dropout=0.05)) == 200_200
    assert sum(layer_activation_bytes(QWEN3_4B, act_bytes=4)) == 258_792


def measured_activation_bytes(model, input_ids: torch.Tensor, dtype: torch.dtype, autocast: bool = True) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward, run as the scripts run it
    (`lora.compute_autocast`), parameters excluded, plus the logits the model returns: what stays allocated
    between forward and backward."""
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t  # kept alive by the graph, so its address cannot be reused by another saved tensor

    compute = lora.compute_autocast(input_ids.device, dtype if autocast else torch.float32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), compute:
        out = model(input_ids=input_ids, labels=input_ids)
    logits = out.logits.untyped_storage()
    saved[logits.data_ptr()] = logits.nbytes()
    return sum(saved.values())


@pytest.mark.parametrize("dtype, dropout", [("fp32", 0.0), ("fp32", 0.05), ("bf16", 0.0), ("bf16", 0.05)])
def test_activations_match_saved_tensors(dtype: str, dropout: float, one_thread):
    """Prediction vs measurement, LoRA on a frozen tiny Qwen3, no checkpointing. fp32 is the reference case;
    bf16 also runs on CPU, with the adapters computing in bf16 as in the scripts, and checks the fp32 copies
    that RMSNorm makes of a bf16 stream and the bf16 copies autocast makes of the fp32 adapter weights.

    Per layer, from the difference between a 4-layer and a 2-layer model, the derivation must hold to the
    byte. One platform difference is added to the prediction: dropout on CPU multiplies by a noise tensor
    in the input dtype and saves it, where CUDA's fused kernel saves a bool mask, 1 byte, which is what the
    model counts for the GPU.

    For the whole model the tolerance is 5%, for one simplification the model makes on purpose: it counts
    layer 0 like every other layer, but layer 0 reads the frozen embedding's output, which needs no gradient,
    so autograd does not save its input norm's input, nor (with dropout) the q/k/v dropout masks, nor (bf16)
    the weight copies of q/k/v's A, which only the input gradient needs. The model
    overestimates by 1.2-2.0% here without dropout and 3.1-3.3% with it; over Qwen3-4B's 36 layers instead
    of 4, about 9x less.
    """
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    batch, seq = 2, 64
    input_ids = torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    measured = {
        layers: measured_activation_bytes(
            tiny_lora_model(torch_dtype, 8, dropout, layers=layers), input_ids, torch_dtype
        )
        for layers in (2, 4)
    }
    shape = ModelShape.from_config(TINY)
    act = torch_dtype.itemsize
    n_in = sum(shape.linears()[name][0] for name in LORA_TARGETS)
    cpu_masks = batch * seq * (act - 1) * n_in if dropout > 0 else 0
    weight_copies = act * lora_params(shape, 8) // shape.layers if dtype == "bf16" else 0

    per_layer = (measured[4] - measured[2]) / 2
    layer = layer_activation_bytes(shape, act_bytes=act, lora_rank=8, lora_dropout=dropout)
    assert per_layer == batch * seq * sum(layer) + weight_copies + cpu_masks

    predicted = predict(
        shape,
        dtype=dtype,
        quant="none",
        lora_rank=8,
        lora_dropout=dropout,
        micro_batch_size=batch,
        seq_len=seq,
        grad_checkpointing=False,
    ).activations
    predicted += shape.layers * cpu_masks
    # The prediction is the loss backward's peak: two more fp32 tensors of the logits' size (the log-softmax's
    # gradient and its input's) than what forward leaves. And this forward keeps its logits (`out`), which the
    # scripts drop before backward.
    n_logits = batch * seq * shape.vocab
    predicted += (act - 2 * 4) * n_logits
    assert predicted == pytest.approx(measured[4], rel=0.05), f"predicted {predicted:,.0f}, measured {measured[4]:,}"


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_fp32_adapter_compute_matches_peft_default_saved_tensors(dropout: float, one_thread):
    """The model's `fp32_adapter_compute` branch, kept for runs measured before the scripts computed the adapters
    in bf16 (the single-GPU devlog's H100 runs), against what autograd saves with PEFT's default on a bf16
    stream: per layer, to the byte (plus CPU dropout's noise tensors, as above)."""
    batch, seq = 2, 64
    input_ids = torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    measured = {
        layers: measured_activation_bytes(
            tiny_lora_model(torch.bfloat16, 8, dropout, layers=layers, peft_default=True),
            input_ids,
            torch.bfloat16,
            autocast=False,
        )
        for layers in (2, 4)
    }
    shape = ModelShape.from_config(TINY)
    n_in = sum(shape.linears()[name][0] for name in LORA_TARGETS)
    cpu_masks = batch * seq * (4 - 1) * n_in if dropout > 0 else 0  # the noise is fp32, like the cast input
    layer = layer_activation_bytes(shape, act_bytes=2, lora_rank=8, lora_dropout=dropout, fp32_adapter_compute=True)
    assert (measured[4] - measured[2]) / 2 == batch * seq * sum(layer) + cpu_masks


def test_fsdp_model_states_scale_as_one_over_n():
    single = model_states(predict(QWEN3_4B))
    for n in (2, 4, 8):
        fsdp = predict(QWEN3_4B, technique="fsdp", world_size=n)
        assert model_states(fsdp) * n == pytest.approx(single)
        assert fsdp.gathered > 0  # the all-gathered units come on top of the shards


def test_fsdp_shards_a_4bit_bases_codes_and_keeps_its_constants_whole_on_every_rank():
    """QLoRA under FSDP: FSDP2 shards the packed 4-bit codes (a uint8 parameter, 0.5 B per weight) and gathers them
    as bytes, but the quantization constants (bitsandbytes' quant_state, an attribute of each Linear4bit module, not
    a parameter) stay whole on every rank and are never gathered."""
    shape = QWEN3_4B
    linear = shape.layers * shape.linear_params()
    constants = linear * (NF4_BYTES_PER_PARAM - 0.5)  # 0.127 bits per weight
    parameters = linear * 0.5 + (shape.n_params() - linear) * 2  # the codes, the bf16 embedding and norms

    def fsdp(n: int, quant: str = "nf4"):
        return predict(shape, technique="fsdp", quant=quant, world_size=n, logit_positions=256)

    two, four = fsdp(2), fsdp(4)
    assert two.weights == pytest.approx(parameters / 2 + constants, rel=1e-12)
    assert two.weights - four.weights == pytest.approx(parameters / 4, rel=1e-12)  # the constants do not shrink
    assert predict(shape, quant="nf4").weights == pytest.approx(parameters + constants, rel=1e-12)  # one GPU: all
    # Gathered at the layer peak: the root unit (the bf16 embedding and final norm) and two layers, each as its
    # packed codes with its bf16 norms and its adapters, gathered in the param dtype (bf16, as FSDP2's
    # MixedPrecisionPolicy casts them; their fp32 masters stay sharded); bf16 gathers 2 B per projection weight.
    layer = shape.linear_params() * 0.5 + shape.norm_params() * 2 + 2 * lora_params(shape, 16) // shape.layers
    assert two.gathered == pytest.approx((shape.embedding_params() + shape.hidden) * 2 + 2 * layer, rel=1e-12)
    assert fsdp(2, "none").gathered - two.gathered == pytest.approx(2 * shape.linear_params() * 1.5, rel=1e-12)


def test_full_finetune_matches_zero():
    psi = QWEN3_4B.n_params()
    assert model_states(predict(QWEN3_4B, full_finetune=True)) == zero_bytes(psi, stage=0)
    fsdp = predict(QWEN3_4B, full_finetune=True, technique="fsdp", world_size=8)
    assert model_states(fsdp) == pytest.approx(zero_bytes(psi, n_d=8, stage=3))


def test_sharding_and_checkpointing_laws():
    tp = predict(QWEN3_4B, technique="tp", world_size=2)
    tp_sp = predict(QWEN3_4B, technique="tp-sp", world_size=2)
    assert tp_sp.activations < tp.activations
    assert tp.weights < predict(QWEN3_4B).weights

    def pp(schedule: str, m: int) -> float:
        return predict(QWEN3_4B, technique="pp", world_size=4, pp_schedule=schedule, num_microbatches=m).activations

    assert pp("gpipe", 8) > pp("1f1b", 8)

    for quant in ("none", "nf4"):  # the lm_head at 256 answer positions, as the scripts run it (logits_to_keep)
        kept = predict(QWEN3_4B, quant=quant, grad_checkpointing=True, logit_positions=256).activations
        full = predict(QWEN3_4B, quant=quant, grad_checkpointing=False, logit_positions=256).activations
        assert kept < full / 4

    nf4, bf16 = predict(QWEN3_4B, quant="nf4"), predict(QWEN3_4B, quant="none")
    assert nf4.weights < bf16.weights / 2
    assert NF4_BYTES_PER_PARAM == pytest.approx((4 + 0.127) / 8, abs=1e-4)  # QLoRA paper: 0.127 bits/param


def test_as_dict_is_json_bytes():
    p = predict(QWEN3_4B, quant="nf4")
    d = json.loads(json.dumps(p.as_dict()))
    assert d["total"] == pytest.approx(sum(v for k, v in d.items() if k != "total"))
    assert p.gib()["total"] == round(p.total / 2**30, 2)


def test_the_framework_posts_per_token_items_add_up_to_the_models_layer():
    """blogs/what-fills-gpu-memory.md lists what a LoRA layer saves per token at Qwen3-4B's shape (bf16, no dropout)
    item by item; each item is the shape's arithmetic and together they are `layer_activation_bytes`' total."""
    import re
    from pathlib import Path

    from ftkit.activations import layer_activation_bytes
    from ftkit.memory import ModelShape
    from ftkit.plan import settings

    post = (Path(__file__).resolve().parents[1] / "blogs" / "what-fills-gpu-memory.md").read_text()
    found = re.search(
        r"the four norms ([\d,]+) B, attention \(q, k, v, output, logsumexp\) ([\d,]+),\s+SwiGLU ([\d,]+), the LoRA "
        r"`A` inputs ([\d,]+) \(q/k/v ([\d,]+), gate/up ([\d,]+), down_proj ([\d,]+)\) and the `B` inputs\s+([\d,]+)\. "
        r"The sum is \*\*([\d,]+) B",
        post,
    )
    assert found, "the post's per-token list"
    norms, sdpa, swiglu, lora_a, qkv, gate_up, down, lora_b, total = (int(x.replace(",", "")) for x in found.groups())
    shape = ModelShape.from_config(settings.model_config("Qwen/Qwen3-4B"))
    h, i = shape.hidden, shape.intermediate
    assert (qkv, gate_up, down, swiglu) == (2 * h, 2 * h, 2 * i, 3 * 2 * i)  # bf16 tensors h or i wide
    assert lora_b == 2 * 16 * 7  # rank 16, seven adapters
    assert norms == 2 * 4 * (h + 1) + 4 * (shape.q_dim + shape.heads + shape.kv_dim + shape.kv_heads)
    assert sdpa == 2 * (2 * shape.q_dim + 2 * shape.kv_dim) + 4 * shape.heads
    assert lora_a == qkv + gate_up + down and norms + sdpa + swiglu + lora_a + lora_b == total
    assert total == sum(layer_activation_bytes(shape, act_bytes=2))


def test_checkpointing_every_k_layers_lies_between_none_and_all():
    """--checkpointing every-K (`checkpoint_every=K`): layers 0, K, 2K, ... keep their input, the others what they
    save, so the activations grow with K from all's (K = 1) towards none's; every-1 is all, 0 (or grad_checkpointing
    off) none, whatever the technique. At 4 layers on ftkit.realscale (single, 2 x 2048, QLoRA) every-2's tracked
    peak is 1.00003 x this model's (devlogs/single-gpu-ft.md, "Checkpointing by layer")."""
    for technique, kw in (("single", {}), ("fsdp", {"world_size": 2}), ("pp", {"world_size": 2})):
        total = functools.partial(total_bytes, technique=technique, micro_batch_size=2, logit_positions=256, **kw)
        every = [total(checkpoint_every=k) for k in (1, 2, 4, 12)]
        none = total(grad_checkpointing=False)
        assert every[0] == total() and none == total(checkpoint_every=0) == total(
            grad_checkpointing=False, checkpoint_every=2
        )
        assert every == sorted(every) and len(set(every)) == 4 and every[-1] < none, technique
    with pytest.raises(ValueError, match="checkpoint_every"):
        predict(QWEN3_4B, checkpoint_every=-1)


def total_bytes(**kw) -> float:
    return predict(QWEN3_4B, **kw).total
