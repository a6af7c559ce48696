"""A memory model: predicted bytes per GPU for LoRA/QLoRA finetuning of a Qwen3-style decoder.

Everything here is arithmetic on the model shape; nothing is measured. The components:

- weights: the frozen base. bf16 = 2 B/param, fp32 = 4. NF4 (QLoRA, Dettmers et al. 2023, arXiv 2305.14314)
  stores the seven projections at 4 bits = 0.5 B/param, plus the quantization constants: one absmax per
  block of 64 weights, itself quantized to 8 bits with one fp32 constant per 256 absmaxes ("double
  quantization"), i.e. 8/64 + 32/(64*256) = 0.127 bits/param (paper, Sec. 3). Embeddings, the tied
  lm_head and the norms are not quantized (transformers converts the nn.Linear layers but the lm_head)
  and stay in the compute dtype, as the scripts keep them (`lora.freeze_base`); `kbit_upcast` models
  peft's `prepare_model_for_kbit_training` instead, which upcasts them to fp32. Under FSDP only the packed codes
  (0.5 B/param, a uint8 parameter) are sharded: the constants are bitsandbytes' `quant_state`, an attribute of
  each `Linear4bit` module, not a parameter, so FSDP2 neither shards nor all-gathers them and every rank keeps
  all of them (`Linear4bit.forward` re-attaches them to the gathered weight on every call).
- lora: the adapters, fp32 (4 B/param): PEFT keeps adapter weights in fp32 even on a bf16 base
  (`autocast_adapter_dtype=True`); they are the optimizer's master weights, and compute in the stream dtype.
- gradients: fp32, LoRA only (the base is frozen). DDP adds its bucket copy of them.
- optimizer: AdamW's two fp32 moments per trainable param, 8 B/param.
- gathered: FSDP only, parameters all-gathered for compute on top of the resident shards (a 4-bit layer's as
  its packed bytes: the quantization constants are resident already).
- activations: tensors saved for backward, derived op by op in `layer_activation_bytes` (ftkit/activations.py),
  plus the logits.

`full_finetune=True` is the contrast case: every parameter trainable, mixed precision as in ZeRO
(Rajbhandari et al. 2020, arXiv 1910.02054): bf16 weights and gradients plus fp32 master weights and two
Adam moments, 2 + 2 + 12 B/param. `zero_bytes` gives that paper's per-GPU model-state formulas.

The peak is the larger of backward's two peaks: at the loss (every saved activation, the loss's own tensors and
its gradients) and, with checkpointing, in the first layer backward recomputes (the kept inputs, one layer's full
activations and the gradients its backward holds). At Qwen3-4B's shape on fake tensors (`ftkit.realscale`) this
is what torch's memory trackers count, to the byte.

Not modelled: the CUDA context and NCCL buffers, allocator fragmentation, transients outside those two peaks
(the dequantized 4-bit weight during a matmul, unsharded gradients and all-reduce/reduce-scatter buffers), a
padding attention mask (with one, transformers builds a 4-D mask and repeats k and v to every head: on an H100,
72 MiB more at the peak at 2 x 2048, whatever the layer count), and what CUDA's libraries allocate for themselves
(on an H100, cuBLAS's 64 MiB workspace): on the committed H100 runs the CUDA peak is 0.5-3.2% above `total` from
step 2 on (devlogs/single-gpu-ft.md). Under tensor parallelism at long sequences the first layer's backward holds
19-23 KB per token more than counted here (devlogs/runs/realscale).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftkit.activations import FP32, layer_saved_bytes
from ftkit.lora import LORA_TARGETS, ROW_PARALLEL

GIB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
# NF4 with double quantization, QLoRA paper Sec. 3: 4 bits + 8/64 + 32/(64*256) bits of constants per weight.
NF4_BYTES_PER_PARAM = (4 + 8 / 64 + 32 / (64 * 256)) / 8
NF4_PACKED_BYTES = 4 / 8  # of which the codes, two per byte: the parameter FSDP shards; the rest, its constants
TECHNIQUES = ("single", "ddp", "fsdp", "tp", "tp-sp", "pp", "cp")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Qwen3 decoder that memory depends on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """From a transformers `Qwen3Config` or a dict with the same keys."""
        get = cfg.get if isinstance(cfg, Mapping) else lambda key, default=None: getattr(cfg, key, default)
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        return cls(
            layers=get("num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads,
            intermediate=get("intermediate_size"),
            vocab=get("vocab_size"),
            tied_embeddings=bool(get("tie_word_embeddings", False)),
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the seven projections of one decoder layer."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def linear_params(self) -> int:
        """Projection weights of one layer (Qwen3 has no biases)."""
        return sum(n_in * n_out for n_in, n_out in self.linears().values())

    def norm_params(self) -> int:
        """One layer's two RMSNorms (hidden each) plus q_norm and k_norm (head_dim each)."""
        return 2 * self.hidden + 2 * self.head_dim

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def n_params(self) -> int:
        """All parameters: embeddings (+ lm_head unless tied), layers, final norm."""
        head = 0 if self.tied_embeddings else self.embedding_params()
        layers = self.layers * (self.linear_params() + self.norm_params())
        return self.embedding_params() + head + layers + self.hidden


QWEN3_4B = ModelShape(
    layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936, tied_embeddings=True
)


def lora_params(shape: ModelShape, rank: int, targets: Sequence[str] = LORA_TARGETS, tp: int = 1) -> int:
    """LoRA parameters on one rank: r*(in + out) per targeted projection per layer (A: r x in, B: out x r).

    Under tensor parallelism the adapter is split like its base (Megatron-style): a column-parallel base
    shards B's output rows and replicates A; a row-parallel base shards A's input columns and replicates B."""
    dims = shape.linears()
    per_layer = 0
    for name in targets:
        n_in, n_out = dims[name]
        per_layer += rank * (n_in // tp + n_out) if name in ROW_PARALLEL else rank * (n_in + n_out // tp)
    return shape.layers * per_layer


def zero_bytes(psi: float, k: float = 12, n_d: int = 64, stage: int = 0) -> float:
    """Model-state bytes per GPU in ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054, Fig. 1).

    psi parameters in mixed precision: 2 B weights + 2 B gradients + K B of optimizer state (Adam: fp32
    master weights, momentum, variance, K = 12), data-parallel degree n_d. Stage 0 is plain data
    parallelism, 1 partitions the optimizer states (P_os), 2 also the gradients (P_os+g), 3 also the
    parameters (P_os+g+p)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n_d
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n_d
    if stage == 3:
        return (2 + 2 + k) * psi / n_d
    raise ValueError(f"ZeRO stage must be 0-3, got {stage}")


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes on the busiest GPU, by component."""

    weights: float
    lora: float
    gradients: float
    optimizer: float
    activations: float
    gathered: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gathered + self.lora + self.gradients + self.optimizer + self.activations

    def as_dict(self) -> dict[str, float]:
        """Bytes per component plus the total, as plain floats (JSON-ready)."""
        return {**{k: float(v) for k, v in dataclasses.asdict(self).items()}, "total": float(self.total)}

    def gib(self, digits: int = 2) -> dict[str, float]:
        """The same in GiB (2**30 bytes), rounded."""
        return {k: round(v / GIB, digits) for k, v in self.as_dict().items()}


def predict(
    shape: ModelShape,
    *,
    technique: str = "single",
    quant: str = "none",
    dtype: str = "bf16",
    world_size: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    lora_rank: int = 16,
    lora_targets: Sequence[str] = LORA_TARGETS,
    lora_dropout: float = 0.0,
    full_finetune: bool = False,
    fp32_adapter_compute: bool = False,
    kbit_upcast: bool = False,
    logit_positions: int | None = None,
    micro_batch_size: int = 1,
    seq_len: int = 2048,
    grad_checkpointing: bool = True,
    checkpoint_every: int = 1,
    pp_schedule: str = "1f1b",
    num_microbatches: int | None = None,
    pp_stage: str | None = None,
    reshard_after_forward: bool = True,
    accumulation_steps: int = 1,
) -> MemoryPrediction:
    """Predicted per-GPU memory for one training configuration, on the busiest rank / pipeline stage.

    technique: "single"; "ddp" (replicas); "fsdp" (frozen base, adapters, gradients and optimizer state
    sharded over the data-parallel ranks, each decoder layer its own FSDP2 unit); "tp" / "tp-sp" (the seven
    projections sharded over tp ranks, norms and embeddings replicated, as in transformers' Qwen3 tp_plan;
    "tp-sp" adds sequence parallelism); "pp" (layers split over pp stages, embedding on the first, final
    norm + lm_head on the last, which holds its own copy of a tied embedding); "cp" (cp-ft: each sequence cut
    into 2 x cp chunks, a rank holding seq_len / cp of its tokens and, in the layer it runs, every rank's K and V
    repeated to the query heads: see `_Setup._layer`). For "tp"/"tp-sp"/"pp"/"cp" the degree defaults to
    world_size; the data-parallel degree is world_size / (tp * pp * cp).
    quant: "nf4" (QLoRA) or "none"; dtype: the base / compute dtype, "bf16" or "fp32".
    lora_dropout > 0 costs activation memory (see `layer_activation_bytes`); full_finetune: the ZeRO baseline;
    grad_checkpointing with checkpoint_every K: layers 0, K, 2K, ... checkpointed (1: every one; 0: none);
    fp32_adapter_compute: the adapters computing in fp32 as PEFT does by default (runs measured before the
    scripts switched to `lora.adapters_compute_in`).

    The assumptions, each a choice the experiment scripts make or a framework default, are stated with the step
    that makes it: `_Setup._precision` (the activation dtype), `_Setup._layer` (checkpointing, sequence
    parallelism, every layer alike), `_Setup.stage` (pipeline parallelism, FSDP2's gradients), `_Setup._loss`
    (the logits) and `_Setup._fsdp_unsharded` (FSDP2's peak).
    """
    setup = _Setup(**locals())  # the arguments, as given: checked and resolved
    if pp_stage is not None:
        return setup.stage(pp_stage == "first", pp_stage == "last")
    candidates = [setup.stage(True, True)] if setup.pp == 1 else [setup.stage(True, False), setup.stage(False, True)]
    return max(candidates, key=lambda p: p.total)


@dataclass
class _Setup:
    """`predict`'s arguments, checked, and what they imply for every pipeline stage: the parallel degrees, the bytes
    of each kind of state, one decoder layer's parameters and saved activations (`__post_init__`'s steps)."""

    shape: ModelShape
    technique: str
    quant: str
    dtype: str
    world_size: int
    tp: int  # resolved: the degree of "tp" / "tp-sp", world_size unless given
    pp: int  # resolved: the degree of "pp", world_size unless given
    cp: int  # resolved: the degree of "cp", world_size unless given
    sequence_parallel: bool  # resolved: on with "tp-sp"
    lora_rank: int
    lora_targets: Sequence[str]
    lora_dropout: float
    full_finetune: bool
    fp32_adapter_compute: bool
    kbit_upcast: bool
    logit_positions: int | None
    micro_batch_size: int
    seq_len: int
    grad_checkpointing: bool
    checkpoint_every: int  # resolved: layers 0, K, 2K, ... checkpointed (--checkpointing every-K); 0 with none
    pp_schedule: str
    num_microbatches: int | None
    pp_stage: str | None
    reshard_after_forward: bool
    accumulation_steps: int

    def __post_init__(self) -> None:
        self._check()
        self._precision()
        self._layer()
        if self.pp_schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"pp_schedule must be 'gpipe' or '1f1b', got {self.pp_schedule!r}")
        if self.pp_stage not in (None, "first", "last") or (self.pp_stage is not None and self.pp == 1):
            raise ValueError(f"pp_stage must be 'first' or 'last' (of pp > 1 stages) or None, got {self.pp_stage!r}")

    def _check(self) -> None:
        """The arguments' values, and the parallel degrees: tp and pp (world_size for the technique that splits by
        them, unless given), the data-parallel ranks FSDP shards over (`shards`)."""
        shape, technique, quant, dtype = self.shape, self.technique, self.quant, self.dtype
        if technique not in TECHNIQUES:
            raise ValueError(f"technique must be one of {TECHNIQUES}, got {technique!r}")
        if quant not in ("nf4", "none") or dtype not in DTYPE_BYTES:
            raise ValueError(f"quant must be 'nf4' or 'none' and dtype 'bf16' or 'fp32', got {quant!r}, {dtype!r}")
        if self.full_finetune and quant != "none":
            raise ValueError("a full finetune trains every weight: it cannot use a frozen 4-bit base")
        self.tp = self.world_size if technique in ("tp", "tp-sp") and self.tp == 1 else self.tp
        self.pp = self.world_size if technique == "pp" and self.pp == 1 else self.pp
        self.cp = self.world_size if technique == "cp" and self.cp == 1 else self.cp
        tp, pp, cp = self.tp, self.pp, self.cp
        if shape.layers % pp or shape.kv_heads % tp:
            raise ValueError(f"pp={pp} must divide {shape.layers} layers and tp={tp} the {shape.kv_heads} KV heads")
        if self.world_size % (tp * pp * cp):
            raise ValueError(f"world_size={self.world_size} is not a multiple of tp*pp*cp={tp * pp * cp}")
        if cp > 1 and (technique != "cp" or self.seq_len % (2 * cp)):
            raise ValueError(f"cp={cp} is technique 'cp' only, with seq_len a multiple of 2 x cp, got {self.seq_len}")
        self.sequence_parallel = self.sequence_parallel or technique == "tp-sp"
        if not (isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0):
            raise ValueError(f"checkpoint_every must be 0 (none), 1 (all) or K > 1, got {self.checkpoint_every!r}")
        self.checkpoint_every *= self.grad_checkpointing  # without checkpointing, no layer is
        dp = self.world_size // (tp * pp * cp)
        self.shards = dp if technique == "fsdp" else 1

    def _precision(self) -> None:
        """Bytes per element of each kind of state: activations (`act`), projection weights (`linear_bytes`, and
        under FSDP a 4-bit weight's `constant_bytes` apart), the other weights (`other_bytes`: embeddings and
        norms), gradients and optimizer state (`grad_bytes`, `optim_bytes`, per trainable parameter).

        Activation dtype: `dtype`, except NF4 with `kbit_upcast` (peft's prepare_model_for_kbit_training): the
        upcast fp32 embedding makes the residual stream, and so every activation, fp32 (peft's recipe has no
        autocast). The LoRA adapters compute in the activation dtype (`lora.adapters_compute_in`)."""
        quant, full_finetune, kbit_upcast = self.quant, self.full_finetune, self.kbit_upcast
        base_bytes = DTYPE_BYTES[self.dtype]
        self.act = FP32 if quant == "nf4" and kbit_upcast else base_bytes
        if full_finetune:  # ZeRO's mixed precision: bf16 weights and grads, fp32 master + 2 moments (K = 12)
            linear_bytes = self.other_bytes = self.grad_bytes = base_bytes
            self.optim_bytes = 12 if base_bytes == 2 else 8  # an fp32 model needs no master copy
        else:
            linear_bytes = NF4_BYTES_PER_PARAM if quant == "nf4" else base_bytes
            self.other_bytes = FP32 if quant == "nf4" and kbit_upcast else base_bytes  # embeddings and norms
            self.grad_bytes, self.optim_bytes = FP32, 8  # on the fp32 adapters only

        # FSDP shards a 4-bit layer's packed codes only: its quantization constants are a module attribute
        # (`Linear4bit.quant_state`), not a parameter, replicated on every rank and never gathered.
        self.constant_bytes = linear_bytes - NF4_PACKED_BYTES if quant == "nf4" and self.technique == "fsdp" else 0.0
        self.linear_bytes = linear_bytes - self.constant_bytes

    def _layer(self) -> None:
        """One decoder layer on one rank: its parameters (`layer_weights`, `layer_constants`, `layer_lora`), what it
        saves for backward (`layer_acts`), what it keeps checkpointed (`layer_input`) and the bf16 copies of the
        adapters (`copies`); the stage's layers and micro-batches.

        - Checkpointing is non-reentrant and per decoder layer: each checkpointed layer (all, or every K-th from
          layer 0) keeps its input (a*h per token), the others their saved activations, and backward recomputes one
          layer at a time, so one layer's full activations count once, at the recompute peak (`stage`).
        - Sequence parallelism (tp-sp-ft's) splits the norms' saved inputs by tp, and the layer input checkpointing
          keeps; the LoRA inputs inside the blocks are the all-gathered sequence, saved whole. (Megatron-LM saves
          them sequence-sharded and all-gathers again in backward: Korthikanti et al.'s 34sbh/t.)
        - Every layer is counted alike, though layer 0 saves a little less: its input, the frozen embedding's
          output, needs no gradient, so autograd skips its first norm's input (and q/k/v dropout masks)."""
        shape, tp, pp, act = self.shape, self.tp, self.pp, self.act
        self.layers = shape.layers // pp
        self.layer_weights = shape.linear_params() / tp * self.linear_bytes + shape.norm_params() * self.other_bytes
        self.layer_constants = shape.linear_params() / tp * self.constant_bytes
        lora = 0 if self.full_finetune else lora_params(shape, self.lora_rank, self.lora_targets, tp) // shape.layers
        self.layer_lora = lora
        self.tokens = tokens = self.micro_batch_size * self.seq_len // self.cp
        self.layer_acts = layer_saved_bytes(
            shape,
            tokens,
            tp=tp,
            sequence_parallel=self.sequence_parallel,
            act_bytes=act,
            lora_targets=self.lora_targets,
            lora_rank=self.lora_rank,
            lora_dropout=self.lora_dropout,
            full_finetune=self.full_finetune,
            fp32_adapter_compute=self.fp32_adapter_compute,
        )
        if self.technique == "cp":
            # cp-ft's attention: SDPA saves no local K and V (kv wide) but slices of the whole sequence's, gathered
            # from every rank and repeated to the query heads (q wide): the repeated tensors, kept whole.
            self.layer_acts += 2 * act * (self.micro_batch_size * self.seq_len * shape.q_dim - tokens * shape.kv_dim)
        self.sp = tp if self.sequence_parallel else 1
        # The bf16 copies autocast makes of a layer's fp32 adapter weights, saved by its LoRA matmuls (FSDP gathers
        # the adapters in param_dtype instead: in `gathered`). They live while autocast caches them or backward
        # needs them: one recomputed layer's with checkpointing, every layer's without; around pp's schedule.step
        # autocast spans the whole step, so every layer of the stage keeps its copies cached.
        no_copies = act == FP32 or self.full_finetune or self.fp32_adapter_compute or self.technique == "fsdp"
        copies = 0 if no_copies else act * lora
        self.copies, self.layer_input = copies, tokens * act * shape.hidden / self.sp
        self.m = self.num_microbatches or pp

    def stage(self, first: bool, last: bool) -> MemoryPrediction:
        """One pipeline stage (the whole model when pp == 1).

        - PP: GPipe keeps all m micro-batches in flight on every stage; 1F1B keeps min(m, p - k) on stage k, so
          min(m, p) on the first and 1 on the last. num_microbatches (m) defaults to pp. pp_stage: "first" or
          "last" predicts that stage (the first holds the embedding and the most micro-batches in flight, the last
          the lm_head and the loss), None the busier of the two. The last stage keeps its output (the normed
          sequence) until that micro-batch's backward: pp-ft asks for no merged output of the step. Under 1F1B a
          stage that receives activations and computes the loss (the last) keeps every micro-batch's received
          activation to the step's end: torch's schedule keeps each loss with its autograd graph, whose
          AccumulateGrad holds that leaf.
        - FSDP2 with accumulation_steps > 1: the scripts skip the reduce-scatter until the last micro-step
          (`set_requires_gradient_sync`), so the gradients accumulate unsharded, whole on every rank."""
        shape, layers, layer_lora, shards = self.shape, self.layers, self.layer_lora, self.shards
        in_flight = self.m if self.pp_schedule == "gpipe" else min(self.m, self.pp if first else 1)
        # Outside the layers: the embedding on the first stage; the final norm and the lm_head on the last,
        # where a tied lm_head is the embedding itself unless the two sit on different stages.
        outside = first * shape.embedding_params()
        if last:
            outside += shape.hidden + (0 if shape.tied_embeddings and first else shape.embedding_params())
        weights = layers * self.layer_weights + outside * self.other_bytes
        n_base = layers * (shape.linear_params() / self.tp + shape.norm_params()) + outside
        trainable = n_base if self.full_finetune else layers * layer_lora
        lora = FP32 * layers * layer_lora
        grads = self.grad_bytes * trainable * (2 if self.technique == "ddp" else 1)  # DDP: + its gradient buckets
        optim = self.optim_bytes * trainable

        # RoPE's cos and sin: cp-ft's position ids are [rows, its tokens], the other scripts' [1, seq]
        rope = 2 * shape.head_dim * self.act * (self.tokens if self.technique == "cp" else self.seq_len)
        # A checkpointed layer (i a multiple of checkpoint_every) keeps its input, another all it saves (`_layer`)
        start, every = (0 if first else shape.layers - layers), self.checkpoint_every
        chosen = [every > 0 and i % every == 0 for i in range(start, start + layers)]
        acts = in_flight * sum(self.layer_input if c else self.layer_acts for c in chosen) + rope
        acts += self.copies * (layers if self.technique == "pp" else chosen.count(False) + chosen[-1])
        # Backward has two peaks, and the larger one counts: at the loss, and in the first layer it runs (the first
        # it recomputes, with checkpointing), once the loss's tensors are freed.
        loss_peak = 0.0
        if last:
            acts, loss_peak = self._loss(acts, first, in_flight)
        layer_peak = self._layer_peak(recomputed=chosen[-1])
        root, layer_set = self._fsdp_unsharded(outside)
        at_loss = 0.0 if self.reshard_after_forward else layer_set
        if loss_peak + at_loss >= layer_peak + layer_set:
            acts, gathered = acts + loss_peak, root + at_loss
        else:
            acts, gathered = acts + layer_peak, root + layer_set
        return MemoryPrediction(
            weights=weights / shards + layers * self.layer_constants,
            lora=lora / shards,
            gradients=grads / (1 if self.accumulation_steps > 1 else shards),
            optimizer=optim / shards,
            activations=acts,
            gathered=gathered,
        )

    def _loss(self, acts: float, first: bool, in_flight: int) -> tuple[float, float]:
        """The last stage's activations (`acts`) with what it keeps for the loss, and the loss backward's own peak.

        Logits: cross-entropy saves its fp32 log-softmax, and its backward adds two fp32 tensors of the same size:
        12 bytes per logit at the loss peak (the model's own bf16 logits are freed before backward: the scripts
        drop the output, pp-ft's loss function its logits). Beside them the final norm's fp32 input and the
        lm_head's input picked at the answer positions (`logits_to_keep`), which saves the whole normed sequence.
        `logit_positions` is how many positions per sequence the lm_head runs on, None counting every position
        (seq_len), an upper bound. Under TP the lm_head is replicated: every rank computes the full-vocabulary
        logits (tp-sp-ft all-gathers the final norm's output first)."""
        shape, act, tokens, sp, m = self.shape, self.act, self.tokens, self.sp, self.m
        technique, logit_positions = self.technique, self.logit_positions
        positions = self.micro_batch_size * (logit_positions or self.seq_len // self.cp)
        n_logits = shape.vocab * positions
        # Saved until the loss backward: the final norm's fp32 input and 1/rms; the lm_head's input picked at
        # the answer positions (a gather that saves the whole normed sequence and an int64 index of the picked
        # rows' shape); cross-entropy's fp32 log-softmax. The model's own bf16 logits are freed before backward
        # (the scripts drop the output; pp-ft's loss function makes them from its stage output and drops them).
        final_norm = tokens * (FP32 * (shape.hidden + 1) + (2 * act * shape.hidden if self.full_finetune else 0)) / sp
        normed = tokens * act * shape.hidden
        # pp's stage output is the normed sequence, which the schedule keeps until the micro-batch's backward
        # (pp-ft passes return_outputs=False, so no merged output): counted below, once per micro-batch in flight.
        picked = 0.0 if logit_positions is None else 8 * positions * shape.hidden
        picked += normed if logit_positions is not None and technique != "pp" else 0.0
        picked += normed if self.sequence_parallel else 0.0  # the sequence all-gather's copy
        saved = final_norm + picked + FP32 * n_logits
        acts += (in_flight - 1) * saved + (in_flight * normed if technique == "pp" else 0.0)
        if technique == "pp" and not first and self.pp_schedule == "1f1b":
            # torch's schedule keeps each micro-batch's loss, with its graph, until the step ends, and the
            # graph's AccumulateGrad holds the activation the stage received: the m - 1 micro-batches done keep
            # theirs (GPipe's in-flight count has them already).
            acts += (m - 1) * tokens * act * shape.hidden
        # The last micro-batch's loss backward: the log-softmax's gradient and its input's, fp32, beside it.
        return acts, saved + 2 * FP32 * n_logits

    def _layer_peak(self, recomputed: bool) -> float:
        """The first layer backward runs (`recomputed` where checkpointed): its saved activations and the gradients
        its backward holds beside them. A later checkpointed layer's recompute peaks lower: the layers above it, at
        least one of them not checkpointed, have freed at least as much as it recomputes."""
        # The layer's backward holds gradients beside what it saved; at its peak, inside down_proj's LoRA backward:
        # A's input gradient (the MLP's width, in the adapters' dtype), five of the hidden width in the stream
        # dtype, one fp32 value per token (counted on ftkit.realscale's fake-tensor runs, to the byte).
        act, shape = self.act, self.shape
        lora_a = FP32 if self.fp32_adapter_compute else act
        working = self.tokens * (lora_a * shape.intermediate / self.tp + 5 * act * shape.hidden / self.sp + FP32)
        return working + (self.layer_acts if recomputed else 0.0)

    def _fsdp_unsharded(self, outside: float) -> tuple[float, float]:
        """FSDP's unsharded copies for compute, on top of the resident shards: (the root unit's, the layers' at the
        layer peak). 0 without FSDP.

        FSDP2: at peak the current layer and the prefetched next one are unsharded (all layers with
        reshard_after_forward=False), and the root unit (embeddings, final norm) stays unsharded throughout,
        FSDP2's default for the root module."""
        # The root unit (embeddings, final norm) throughout; the layers at the layer peak, the current one and the
        # prefetched next (all of them, at both peaks, with reshard_after_forward=False, which keeps them from
        # forward on). A group of one prefetches nothing: FSDP2 skips the all-gather and copies a unit's shards into
        # its unsharded parameters when the unit runs, so only the current layer is unsharded. A 4-bit layer is
        # gathered as its packed codes (its quantization constants are resident on every rank, not gathered).
        root = layer_set = 0.0
        if self.technique == "fsdp":
            root = outside * self.other_bytes
            held = (2 if self.shards > 1 else 1) if self.reshard_after_forward else self.layers
            layer_set = (self.layer_weights + self.act * self.layer_lora) * held
        return root, layer_set
