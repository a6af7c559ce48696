"""The planner's input: the job (the model, its batches, its LoRA flags), the GPUs and their links, and how the host
and the batch layout are modelled (`Setting`); the config keys of the Qwen3 models."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ftkit import hardware, models
from ftkit.lora import checkpoint_every
from ftkit.memory import GIB, ModelShape

# Shapes of the Qwen3 models beyond the 4B one, from each model's config.json on the Hugging Face hub.
QWEN3_CONFIGS = {
    "Qwen/Qwen3-4B": models.QWEN3_4B_CONFIG,
    "Qwen/Qwen3-8B": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-14B": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-32B": dict(
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Setting:
    config: SimpleNamespace  # the model's config keys (num_hidden_layers, ...)
    gpu: hardware.GPU
    gpus: int
    nodes: int
    link: hardware.Link
    inter_node_link: hardware.Link
    memory_bytes: float
    batch_size: int = 16
    micro_batch_size: int = 2
    # False: the command gave no --micro-batch-size, so each experiment runs its script's own (fitting.OWN_MICRO_BATCH)
    micro_batch_given: bool = True
    micro_batch_tokens: int | None = None  # --micro-batch-tokens: one packed row of that many positions per micro-batch
    max_length: int = 2048
    answer_tokens: int = 256
    lora_rank: int = 16
    lora_dropout: float = 0.05
    grad_checkpointing: bool = True
    checkpoint_every: int = 1  # --checkpointing every-K: layers 0, K, 2K, ... checkpointed (1: all of them)
    mfu: float | None = None  # the GPU kernels' fraction of the dense bf16 peak [the host's calibration, or 0.4]
    link_efficiency: float = 0.8
    reserve_bytes: float = GIB
    # The host and the batch layout (issue 30). The defaults are the GPU-only model on the scripts' own layout.
    layout: str = "auto"  # auto | full | padded | packed | masked: see LAYOUTS (auto: layouts.resolve)
    # The decoder layers compiled where the script compiles them (techniques.compiled; the host's count of compiled
    # layers a prediction), as the scripts do on CUDA and the command's default; False: every layer eager.
    compile: bool = False
    # Each experiment at the layout its run's --fit auto chooses (plan.fitting), as the scripts do on CUDA and the
    # command's default; False: every experiment at the flags' layout.
    fit: bool = False
    host: str | None = None  # a calibrated host (HOSTS), or None: the host is not modelled (its cost 0)
    host_op_s: float | None = None  # seconds per op on the host [the host's calibration]
    seed: int = 0  # the global batches' seed (the scripts' --seed), for the AMI layouts
    tokenizer: str = models.QWEN3  # whose token counts the AMI layouts use (layouts.AMI_LENGTHS): qwen3 or tiny
    steps: int | None = None  # optimizer steps predicted with the AMI layouts [one epoch]
    ops_source: str = "tree"  # whose op counts: "tree" (this code), "h100-session1" or "-session2" (the H100 runs')

    @property
    def shape(self) -> ModelShape:
        return ModelShape.from_config(vars(self.config))

    @property
    def recomputed(self) -> float:
        """The fraction of the decoder layers that checkpointing recomputes in backward: 1 (all), 0 (none, or
        grad_checkpointing off), ceil(layers / K) / layers (every-K)."""
        layers, every = self.config.num_hidden_layers, self.checkpoint_every * self.grad_checkpointing
        return -(-layers // every) / layers if every else 0.0

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def legacy(self) -> bool:
        """The planner as it was before it modelled the host: no host, every row --max-length real tokens."""
        return self.host is None and self.host_op_s is None and self.layout == "full"


# The Setting fields a run records under the same names (config.json's and summary.json's "config").
RUN_FLAGS = (
    "batch_size",
    "micro_batch_size",
    "micro_batch_tokens",
    "max_length",
    "answer_tokens",
    "lora_rank",
    "lora_dropout",
    "grad_checkpointing",
    "seed",
)


def run_flags(config: dict) -> dict:
    """A run's recorded configuration as Setting fields: those of RUN_FLAGS it has (--checkpointing every-K as
    checkpoint_every)."""
    flags = {k: config[k] for k in RUN_FLAGS if k in config}
    if config.get("checkpointing", "none") != "none":
        flags["checkpoint_every"] = checkpoint_every(config["checkpointing"])
    return flags


def model_config(name: str) -> SimpleNamespace:
    """The config keys of a Qwen3 model: from the table above, else its config.json (hub id or local path)."""
    if name in QWEN3_CONFIGS:
        return SimpleNamespace(**QWEN3_CONFIGS[name])
    cfg = models.model_config(name)
    return SimpleNamespace(**{k: getattr(cfg, k) for k in QWEN3_CONFIGS["Qwen/Qwen3-8B"]})
