"""The CUDA + NCCL path, checked on a machine without a GPU: each distributed train.py is run in this process as
rank 0 and rank 1 of 2, with what it touches faked - `torch.cuda` reports a GPU, the process-group constructor
is captured (and a fake group, which sends nothing, stands in), flash-attn is importable - up to the moment it
builds the model. What the scripts decide on the way is what a GPU run would do:

- the process group has both backends, "cpu:gloo,cuda:nccl", bound to the rank's GPU: a CPU tensor in a
  collective (a metric, a pickled object) takes gloo instead of crashing NCCL;
- the model and the data are fetched before the group exists (a first run downloads ~8 GB; ranks waiting in a
  collective meanwhile would hit NCCL's timeout);
- every rank builds the model with the same attention kernel, whatever device it builds it on (fsdp-ft's rank 0
  builds on the CPU, the others on the meta device), and flash-attention is refused for fp32.
"""

from __future__ import annotations

import datetime
import runpy
import sys
import types

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT
from torch.testing._internal.distributed.fake_pg import FakeStore

from ftkit import attention, data, errors, fit, models, prepare, ranks

SCRIPTS = ["ddp-ft", "fsdp-ft", "tp-ft", "tp-sp-ft", "pp-ft"]
WORLD = 2
# The real functions, before any test patches them.
REAL = {
    "init_process_group": dist.init_process_group,
    "fetch": models.fetch,
    "load_splits": data.load_splits,
    "encode_data": prepare.encode_data,
}
_encoded: dict = {}


def encoded_once(args, splits):
    """Every rank and script here encodes the same data with the same tokenizer and length: once per session."""
    key = (args.model, args.data, args.max_length)
    if key not in _encoded:
        _encoded[key] = REAL["encode_data"](args, splits)
    return _encoded[key]


class Reached(Exception):
    """Raised where the script builds its model: everything before it ran as it would on a GPU."""


def run_rank(script: str, rank: int, flags: list[str], monkeypatch) -> dict:
    """Run experiments/<script>/train.py's main() as `rank` of WORLD with CUDA faked; what it did, in order."""
    seen: dict = {"order": [], "load_model": []}
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": WORLD, "LOCAL_WORLD_SIZE": WORLD, "MASTER_PORT": 1}
    for key, value in {**env, "MASTER_ADDR": "localhost"}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    # What --fit auto reads of the GPU (ftkit/fit.py): an H100's name and memory, the same on every rank.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: rank)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(total_memory=85e9)
    )
    real_choose = fit.choose_for

    def choose_for(*args, **kwargs):
        seen["fit"] = real_choose(*args, **kwargs)
        return seen["fit"]

    monkeypatch.setattr(fit, "choose_for", choose_for)

    def init_process_group(backend=None, **kwargs):
        seen["order"].append("init_process_group")
        seen["backend"], seen["device_id"], seen["timeout"] = backend, kwargs.get("device_id"), kwargs.get("timeout")
        REAL["init_process_group"](backend="fake", store=FakeStore(), rank=rank, world_size=WORLD)

    def traced(name: str):
        def call(*args, **kwargs):
            seen["order"].append(name)
            return REAL[name](*args, **kwargs)

        return call

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(models, "fetch", traced("fetch"))
    monkeypatch.setattr(data, "load_splits", traced("load_splits"))
    monkeypatch.setattr(prepare, "encode_data", encoded_once)
    # The fake group carries no data, so rank 0's broadcast of the run directory cannot reach rank 1: each rank
    # computes it itself here (nothing is written before the model is built).
    monkeypatch.setattr(ranks, "on_rank0", lambda fn, *a, **k: fn(*a, **k))

    def load_model(*args, **kwargs):
        # The kernel the real load_model would use: the one passed, else the choice for the device it builds on.
        attn = kwargs.get("attn") or models.attention_implementation(kwargs["device"], kwargs["dtype"])
        seen["load_model"].append({**kwargs, "attn": attn})
        raise Reached

    monkeypatch.setattr(models, "load_model", load_model)
    monkeypatch.setattr(sys, "argv", [f"experiments/{script}/train.py", *flags])
    main = runpy.run_path(str(ROOT / "experiments" / script / "train.py"))["main"]
    try:
        with pytest.raises(Reached):
            main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return seen


def flags(tmp_path, *extra: str) -> list[str]:
    # The real scale's defaults (no --smoke) and data, on Qwen3-4B's exact shape, so nothing is downloaded.
    model = ["--model", "qwen3-4b-shape", "--max-length", "512"]
    return [*model, "--output-dir", str(tmp_path / "run"), *extra]


@pytest.fixture
def flash_attn_installed(monkeypatch):
    monkeypatch.setattr(models, "flash_attn_installed", lambda: True)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.usefixtures("flash_attn_installed")
def test_every_rank_starts_both_backends_and_the_same_attention(script, tmp_path, monkeypatch):
    ranks = [run_rank(script, rank, flags(tmp_path), monkeypatch) for rank in range(WORLD)]
    for rank, seen in enumerate(ranks):
        assert seen["backend"] == "cpu:gloo,cuda:nccl"
        assert seen["device_id"] == torch.device("cuda", rank)
        assert seen["timeout"] == datetime.timedelta(minutes=30)  # set, not torch's backend-dependent default
        assert seen["order"][:3] == ["fetch", "load_splits", "init_process_group"]
        assert len(seen["load_model"]) == 1
    attn = [seen["load_model"][0]["attn"] for seen in ranks]
    devices = [seen["load_model"][0]["device"] for seen in ranks]
    print(f"{script}: attention {attn}, built on {devices}")
    assert attn == [attention.VARLEN] * WORLD
    # --fit auto chose the same layout on every rank, before the model (a rank that chose another would hang)
    if script in fit.TECHNIQUE:  # pp-ft and cp-ft lay out padded rows of their own
        assert ranks[0]["fit"]["chosen"] and all(seen["fit"] == ranks[0]["fit"] for seen in ranks)
    if script == "fsdp-ft":  # rank 0 holds the real weights in host memory, the others only shapes
        assert [d.type for d in devices] == ["cpu", "meta"]


@pytest.mark.parametrize("script", ["fsdp-ft", "ddp-ft"])
@pytest.mark.usefixtures("flash_attn_installed")
def test_flash_attention_is_refused_for_fp32(script, tmp_path, monkeypatch, capsys):
    ranks = [run_rank(script, r, flags(tmp_path, "--dtype", "fp32"), monkeypatch) for r in range(WORLD)]
    assert [seen["load_model"][0]["attn"] for seen in ranks] == ["sdpa", "sdpa"]
    assert "the varlen attention kernels run bf16/fp16 only" in capsys.readouterr().out


@pytest.mark.usefixtures("flash_attn_installed")
def test_attention_choice_depends_on_the_training_device_only(monkeypatch):
    """A varlen kernel for packed rows on CUDA in bf16/fp16 - flash-attn's, else torch's own varlen_attn (torch >=
    2.10) - and SDPA where neither runs (fp32, the CPU, a torch without varlen_attn and no flash-attn)."""
    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert models.attention_implementation(cuda, torch.bfloat16) == attention.VARLEN
    assert models.attention_implementation(cuda, torch.float32) == "sdpa"
    assert models.attention_implementation(cpu, torch.bfloat16) == "sdpa"
    monkeypatch.setattr(models, "flash_attn_installed", lambda: False)
    assert models.attention_implementation(cuda, torch.bfloat16) == attention.VARLEN  # torch's varlen_attn
    monkeypatch.setattr(attention, "torch_has_varlen", lambda: False)
    assert models.attention_implementation(cuda, torch.bfloat16) == "sdpa"


def test_no_gpu_message_says_why_and_gives_the_smoke_command(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["experiments/ddp-ft/train.py", "--max-steps", "5"])
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr("ftkit.gpu.explain_no_cuda", lambda: "DRIVER-TOO-OLD")
    args = types.SimpleNamespace(smoke=False)
    with pytest.raises(errors.RunError) as e:
        ranks.device_for(args)
    message = str(e.value)
    assert "DRIVER-TOO-OLD" in message
    assert "uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py --max-steps 5 --smoke" in message
    assert "--data" not in message  # the data ships with the package: the hint needs no path to it


def test_the_step_scalars_come_to_the_host_from_any_device():
    """fsdp-ft --cpu-offload: FSDP2 keeps the reduced gradients on the CPU, so clip_grad_norm_ returns the norm on
    the CPU beside the loss on the GPU. The scripts' one host copy per step takes scalars from both; fake tensors
    stand in for the GPU (they carry a device and check it as the real ops do)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ftkit import metrics

    with FakeTensorMode():
        loss = torch.zeros((), device="cuda")
        totals = torch.zeros(2, device="cuda")
        norm = torch.ones((), device="cpu")
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([totals, norm.reshape(1).to(totals.dtype)])  # what fsdp-ft did: a crash in its first step
        assert metrics.on_one_device(loss, norm).device.type == "cuda"
        assert metrics.on_one_device(*totals, norm).shape == (3,)
    # On real tensors: the values, exactly (fp32 -> fp64 loses nothing), in one list.
    assert metrics.host_values(torch.tensor(0.1), torch.tensor([2.5]), torch.tensor(3)) == [
        torch.tensor(0.1).item(),
        2.5,
        3.0,
    ]


@pytest.mark.parametrize(
    "script, sliced",
    [
        ("tp-ft", "parallelize_module(layer"),
        ("tp-sp-ft", "parallelize(model"),
        ("pp-ft", "del model, lm"),
        ("fsdp-tp-ft", "fully_shard(model"),
    ],
)
def test_a_rank_that_built_the_whole_model_releases_its_cached_blocks_after_slicing(script, sliced, monkeypatch):
    """Each rank of these scripts builds the whole bf16 model on its GPU and keeps its slice. The freed blocks stay
    in the caching allocator unless released: peak_reserved would be at least the whole model, on every rank, and
    that memory out of NCCL's reach. The release must come after the slicing and before the steps are measured."""
    from ftkit import metrics

    main = (ROOT / "experiments" / script / "train.py").read_text().split("\ndef main()")[1]
    release = main.index("metrics.release_cached_memory(device)")
    assert main.index(sliced) < release < main.index("rundir.start_log(")
    released = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    metrics.release_cached_memory(torch.device("cpu"))
    metrics.release_cached_memory(torch.device("cuda", 1))
    assert released == [True]  # on CUDA only
    assert "peak_reserved: what the caching allocator held" in metrics.memory_note(torch.device("cuda", 1))


def test_adamw_is_fused_on_cuda_and_the_default_elsewhere():
    """The choice `optim.adamw_cosine` makes from its parameters' devices: fused where all are on CUDA (parameters
    faked by their device, which is all the choice reads), the default where any is not; on the CPU the optimizer
    is built with fused off, as every CPU parity run is."""
    from ftkit import optim

    on = types.SimpleNamespace
    assert optim.fused_adamw([on(device=torch.device("cuda", 0)), on(device=torch.device("cuda", 0))])
    assert not optim.fused_adamw([on(device=torch.device("cuda", 0)), on(device=torch.device("cpu"))])
    assert not optim.fused_adamw([])
    args = types.SimpleNamespace(lr=1e-3, weight_decay=0.0, warmup_steps=1, max_steps=2)
    optimizer, _ = optim.adamw_cosine([torch.nn.Parameter(torch.zeros(2))], args)
    assert optimizer.defaults["fused"] is False
