"""experiments/fsdp-ft on 2 CPU processes (torchrun, gloo): the same training step as the single-process LoRA
reference (--quant none), with and without gradient accumulation; bf16 mixed precision within a stated tolerance;
FSDP2's all-gather and reduce-scatter bytes as theory says; per-rank parameter memory as the memory model says;
resume from the sharded checkpoint, inference on the gathered adapter; QLoRA (--quant nf4), its 4-bit base sharded
as bytes, against the single-process QLoRA reference."""

from __future__ import annotations

import json
import shutil

import parity
import pytest
import torch

TRAIN = "experiments/fsdp-ft/train.py"
INFER = "experiments/fsdp-ft/infer.py"
# Small enough for CI, long enough to see the loss move and to cross an eval and a checkpoint: 4 steps of
# sequences of <= 256 tokens, fp32 (--smoke).
STEPS = 4
# --param-dtype bf16 against the fp32 run: the all-gathered weights and every matmul input are rounded to bf16
# (unit roundoff 2^-8 = 3.9e-3, relative), and the loss (~9 nats here) is a mean over ~600 target tokens of
# log-softmaxes whose logits carry that relative error, so most of it averages out. Measured: 1.3e-3 over the 4
# steps. 1e-2 is eight times that, and a tenth of what one step changes the loss by here (~0.1), so a wrong
# gradient or a missing rank still fails.
BF16_LOSS_TOL = 1e-2


def flags(data_dir, batch: int, *extra: str) -> list[str]:
    return [
        "--smoke",
        "--data",
        str(data_dir),
        "--max-steps",
        str(STEPS),
        "--max-length",
        "256",
        "--batch-size",
        str(batch),
        "--micro-batch-size",
        "2",
        "--eval-every",
        "2",
        "--save-every",
        "2",
        "--eval-examples",
        "8",
        "--no-progress",
        *extra,
    ]


def launch(tmp_path_factory, name: str, *args: str) -> parity.Launch:
    run = parity.torchrun(TRAIN, *args, "--output-dir", str(tmp_path_factory.mktemp("fsdp") / name))
    assert run.returncode == 0, run.report()
    return run


def summary(run: parity.Launch) -> dict:
    return json.loads((run.run_dir / "summary.json").read_text())


# Global batch 8 = micro 2 x 2 ranks x 2 accumulation steps; the reference runs it as 4 micro-batches.
@pytest.fixture(scope="module")
def accum(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "accum", *flags(data_dir, 8))


# Global batch 4 = micro 2 x 2 ranks: no accumulation. ZeRO-2-like (layers stay unsharded from forward to
# backward) and an explicit prefetch of 2 layers: neither changes the math, the first changes the traffic.
@pytest.fixture(scope="module")
def no_accum(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "no-accum", *flags(data_dir, 4, "--no-reshard-after-forward", "--prefetch", "2"))


@pytest.fixture(scope="module")
def bf16(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "bf16", *flags(data_dir, 8, "--param-dtype", "bf16"))


# qlora: the sharded 4-bit base computes what single-gpu-ft's unsharded one does (the all-gathered bytes are the
# bytes each rank quantized; each layer's quantization state, a module attribute, is replicated).
@pytest.mark.parametrize("run_name, batch, quant", [("accum", 8, "none"), ("no_accum", 4, "none"), ("qlora", 8, "nf4")])
def test_same_step_as_the_single_process_reference(request, tmp_path_factory, data_dir, run_name, batch, quant):
    run = request.getfixturevalue(run_name)
    ref = parity.reference(tmp_path_factory.mktemp("ref"), *flags(data_dir, batch), quant=quant)
    loss = parity.compare_losses(run.run_dir, ref)
    eval_loss = parity.compare_losses(run.run_dir, ref, key="eval_loss")
    adapter = parity.compare_adapters(run.run_dir / "adapter", ref / "adapter")
    print(f"{run_name}: max |loss diff| {loss:.2e}, eval {eval_loss:.2e}, adapter {adapter:.2e}")
    assert loss <= parity.LOSS_TOL and eval_loss <= parity.LOSS_TOL
    assert adapter <= parity.ADAPTER_TOL


def test_bf16_mixed_precision_stays_near_fp32(accum, bf16):
    diff = parity.compare_losses(bf16.run_dir, accum.run_dir)
    print(f"bf16 param dtype vs fp32: max |loss diff| {diff:.2e}")
    assert 1e-5 < diff <= BF16_LOSS_TOL  # it did compute in bf16, and stayed close


def test_all_gather_and_reduce_scatter_bytes_match_theory(accum, no_accum):
    """Per step, bytes of the full buffers: every unit all-gathered in each micro-step's forward, the layer units
    again in its backward when resharded after forward; the trainable gradients (fp32) reduce-scattered once."""
    counts = summary(accum)["parameters"]
    model_bytes = (counts["trainable"] + counts["frozen"]) * 4
    lora_bytes = counts["trainable"] * 4
    for run, accumulation, reshard in ((accum, 2, True), (no_accum, 1, False)):
        s = summary(run)
        layer_bytes = model_bytes - s["largest_unit_bytes"]  # the root (tied embedding + final norm) is largest
        expected = accumulation * (model_bytes + (layer_bytes if reshard else 0))
        assert s["theory_all_gather_bytes"] == expected
        for row in parity.metrics(run.run_dir):
            assert set(row["comm"]) == {"all_gather", "reduce_scatter"}
            assert row["comm"]["all_gather"]["bytes"] == expected, row["comm"]
            # 5 units in forward (4 layers + root), 4 layers again in backward if resharded; per micro-step.
            assert row["comm"]["all_gather"]["count"] == accumulation * (5 + (4 if reshard else 0))
            # Only the LoRA gradients, once per step (not per micro-step), one reduce-scatter per layer unit:
            # the root holds only frozen weights and reduces nothing.
            assert row["comm"]["reduce_scatter"]["bytes"] == lora_bytes
            assert row["comm"]["reduce_scatter"]["count"] == 4


def test_per_rank_parameter_memory_matches_the_memory_model(accum):
    s = summary(accum)
    counts = s["parameters"]
    # Each rank holds exactly half of every parameter (the tiny model's dimensions are even: no padding).
    assert s["param_shard_bytes"] * 2 == (counts["trainable"] + counts["frozen"]) * 4
    # ftkit.memory.predict(technique="fsdp"), as the script called it: the resident shards of the base weights
    # and of the adapters, to the byte.
    predicted = s["memory_predicted"]
    assert predicted["weights"] + predicted["lora"] == s["param_shard_bytes"]
    # What is gathered at once: the model predicts two layers (the current one and the prefetched next) plus
    # the root, which stays unsharded; the largest single unit here is the root (tied embedding + final norm).
    assert predicted["gathered"] >= s["largest_unit_bytes"]


def test_run_directory_and_sharded_checkpoint(accum):
    s = summary(accum)
    config = json.loads((accum.run_dir / "config.json").read_text())
    assert s["status"] == "completed" and s["steps_run"] == STEPS and s["fsdp_units"] == 5
    assert config["hardware"]["world_size"] == 2 and config["accumulation_steps"] == 2
    assert sorted(p.name for p in (accum.run_dir / "checkpoints").iterdir()) == ["step-2", "step-4"]
    ckpt = accum.run_dir / "checkpoints" / "step-4"
    assert {"rng-rank0.pt", "rng-rank1.pt", "scheduler.pt", "sharded"} <= {p.name for p in ckpt.iterdir()}
    # torch.distributed.checkpoint: one file per rank, with its own shards, and the metadata.
    assert {p.name for p in (ckpt / "sharded").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert "run directory:" in accum.ranks[0]["stdout"] and "run directory:" not in accum.ranks[1]["stdout"]


# LoRA dropout draws random masks in every step, on every rank: a resume that lost a rank's RNG stream would change
# the losses, where without dropout (--smoke's default) it would go unnoticed.
@pytest.fixture(scope="module")
def dropout(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "dropout", *flags(data_dir, 8, "--lora-dropout", "0.1"))


def resume_a_copy(run: parity.Launch, out, step: int, nproc: int = 2) -> parity.Launch:
    """Resume a copy of `run` from its step-`step` sharded checkpoint on `nproc` ranks: the later steps run again."""
    shutil.copytree(run.run_dir, out, ignore=shutil.ignore_patterns("adapter", "summary.json"))
    ckpt = out / "checkpoints" / f"step-{step}"
    resumed = parity.torchrun(TRAIN, "--resume", str(ckpt), "--output-dir", str(out), nproc=nproc)
    assert resumed.returncode == 0, resumed.report()
    assert "resumed from" in resumed.ranks[0]["stdout"] and f"at step {step}" in resumed.ranks[0]["stdout"]
    assert [r["step"] for r in parity.metrics(out)] == list(range(1, STEPS + 1))
    return resumed


def test_resume_continues_with_the_same_losses(dropout, tmp_path):
    """Steps 3-4 of the dropout run, resumed from its step-2 checkpoint, come out as they did the first time."""
    resume_a_copy(dropout, tmp_path / "resumed", step=2)
    assert parity.compare_losses(tmp_path / "resumed", dropout.run_dir) <= 1e-6
    assert parity.compare_adapters(tmp_path / "resumed" / "adapter", dropout.run_dir / "adapter") <= 1e-6


def test_each_rank_draws_its_own_dropout_masks(dropout):
    first, second = parity.rank_dropout_streams(dropout.run_dir / "checkpoints" / "step-2")
    assert not first.equal(second)  # the ranks' examples differ, and so do their dropout streams


def test_resume_on_another_number_of_ranks(accum, tmp_path):
    """torch.distributed.checkpoint reshards: the 2-rank run's step-2 checkpoint, resumed on 1 rank, gives the same
    steps up to summation order. Without dropout: new RNG streams (stated in the output) are what differs."""
    resumed = resume_a_copy(accum, tmp_path / "one-rank", step=2, nproc=1)
    assert "written by 2: the model, optimizer, schedule and data order continue" in resumed.ranks[0]["stdout"]
    assert parity.compare_losses(tmp_path / "one-rank", accum.run_dir) <= parity.LOSS_TOL
    assert parity.compare_adapters(tmp_path / "one-rank" / "adapter", accum.run_dir / "adapter") <= parity.ADAPTER_TOL


def test_infer_on_the_gathered_adapter(accum, tmp_path):
    parity.infer_with_a_loud_adapter(INFER, accum.run_dir, tmp_path)


# QLoRA (--quant nf4): every rank quantizes the checkpoint itself and FSDP2 shards the 4-bit base as uint8 bytes.
# With accumulation: 2 micro-steps per rank.
@pytest.fixture(scope="module")
def qlora(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "qlora", *flags(data_dir, 8, "--quant", "nf4"))


def test_qlora_shards_and_gathers_the_4bit_bytes(qlora, accum):
    """The 4-bit weights are sharded and all-gathered as uint8 (two weights per byte), not counted at --param-dtype:
    the shards, the largest unit and the all-gathers are smaller than bf16 LoRA's by the projections' share."""
    q, b = summary(qlora), summary(accum)
    assert q["config"]["quant"] == "nf4" and q["parameters"] == b["parameters"]  # the same logical model
    assert q["param_shard_bytes"] < b["param_shard_bytes"]
    assert q["theory_all_gather_bytes"] < b["theory_all_gather_bytes"]
    for row in parity.metrics(qlora.run_dir):
        assert row["comm"]["all_gather"]["bytes"] == q["theory_all_gather_bytes"], row["comm"]
        assert row["comm"]["reduce_scatter"]["bytes"] == b["theory_reduce_scatter_bytes"]  # the same LoRA gradients


def test_qlora_resumes_the_uninterrupted_run(qlora, tmp_path):
    resume_a_copy(qlora, tmp_path / "resumed", step=2)
    assert parity.compare_losses(tmp_path / "resumed", qlora.run_dir) <= 1e-6
    assert parity.compare_adapters(tmp_path / "resumed" / "adapter", qlora.run_dir / "adapter") <= 1e-6


def test_fully_shard_gathers_back_the_4bit_bytes_each_rank_quantized(tmp_path):
    """fsdp-ft's `shard_model` on the tiny model in NF4, 2 ranks: each 4-bit weight is sharded as uint8 (half its
    bytes per rank) and every unit's all-gather gives back exactly the bytes it was quantized to, its quantization
    state still on the module (tests/fsdp_4bit_gather.py)."""
    out = tmp_path / "gathered.json"
    run = parity.torchrun("tests/fsdp_4bit_gather.py", str(out))
    assert run.returncode == 0, run.report()
    weights = json.loads(out.read_text())["weights"]
    assert len(weights) == 4 * 7  # the seven projections of every layer
    for name, w in weights.items():
        assert w["dtype"] == "torch.uint8" and w["equal"] and w["same_quant_state"], (name, w)
        assert w["shard_bytes"] * 2 == w["bytes"], (name, w)


def test_a_float_4bit_storage_is_refused_at_any_param_dtype():
    """bitsandbytes can keep the packed bytes in a float tensor (bnb_4bit_quant_storage, FSDP1's workaround). FSDP2
    casts a float parameter to --param-dtype before the all-gather, which converts the bytes as numbers; and at the
    same dtype the packed elements that spell a NaN can come back canonicalised (bitsandbytes#1945, GPUs). Only an
    integer storage is safe, so the fix named is uint8, never a float storage. Checked on the quantization config,
    before any weight is loaded."""
    from transformers import BitsAndBytesConfig

    from ftkit import errors, models

    models.check_4bit_storage(models.bnb_config(torch.bfloat16))  # uint8: never cast, gathered as bytes
    models.check_4bit_storage(models.bnb_config(torch.float32))
    for storage in (torch.bfloat16, torch.float32, torch.float16):
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=storage)
        with pytest.raises(errors.ModelError) as refused:
            models.check_4bit_storage(config)
        message = str(refused.value)
        assert str(storage) in message and "bitsandbytes#1945" in message  # what is wrong, and where it is measured
        assert "Store them as uint8" in message and "--param-dtype to match" not in message  # the one safe fix


def test_a_float_4bit_storage_is_refused_before_any_work(tmp_path, data_dir, monkeypatch):
    """--quant nf4 with a bf16 storage and --param-dtype bf16 (the storage the old check let through, since FSDP2
    does not cast it): refused with the flags, before the process group and the model."""
    from transformers import BitsAndBytesConfig

    from ftkit import models

    def bf16_storage(compute_dtype):
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=torch.bfloat16
        )

    monkeypatch.setattr(models, "bnb_config", bf16_storage)
    out = tmp_path / "o"
    argv = flags(data_dir, 8, "--quant", "nf4", "--dtype", "bf16", "--param-dtype", "bf16", "--output-dir", str(out))
    message = parity.refused(monkeypatch, TRAIN, *argv, world=2)
    assert "uint8" in message and not out.exists()


def test_packed_nf4_bytes_held_as_floats_include_nans_a_float_op_rewrites():
    """Why a float storage is refused, on the CPU: NF4's packed bytes viewed as bf16 (or fp32) include NaN bit
    patterns, and any op that computes on them as floats (here x * 1) rewrites those as a quiet or canonical NaN, so
    the layer would dequantize other weights. Plain copies (a clone, a same-dtype .to, a cat: what gloo's all-gather
    and FSDP2's copy-in and copy-out do on a CPU) keep them, which is why no CPU run can prove a float storage
    safe on GPUs, where bitsandbytes#1945 measured the canonicalisation under FSDP2."""
    import bitsandbytes.functional as bnb_f

    weight = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    for storage in (torch.bfloat16, torch.float32):
        packed, state = bnb_f.quantize_4bit(weight, blocksize=64, quant_type="nf4", quant_storage=storage)
        assert packed.dtype == storage
        flat = packed.reshape(-1)
        nans = int(torch.isnan(flat).sum())
        print(f"{storage}: {nans} of {flat.numel()} packed elements are NaN bit patterns")
        assert nans > 0
        as_bytes = flat.view(torch.uint8)
        for copy in (flat.clone(), flat.to(storage), torch.cat([flat, flat])[: flat.numel()]):
            assert torch.equal(copy.view(torch.uint8), as_bytes)
        computed = flat * 1
        bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[storage]  # compared as bit patterns
        rewritten = int((computed.view(bits) != flat.view(bits)).sum())
        changed = bnb_f.dequantize_4bit(computed.view(packed.shape), state) != bnb_f.dequantize_4bit(packed, state)
        print(f"  x * 1 rewrote {rewritten} of them, changing {int(changed.sum())} dequantized weights")
        assert rewritten > 0 and changed.any()


def test_qlora_adapter_loads_on_an_nf4_base(qlora, tmp_path):
    """infer.py rebuilds the run's base as it trained (NF4) and loads the gathered adapter with stock PEFT."""
    parity.infer_with_a_loud_adapter(INFER, qlora.run_dir, tmp_path)
    assert json.loads((qlora.run_dir / "config.json").read_text())["args"]["quant"] == "nf4"


def test_qlora_compile_asked_for_is_refused_before_any_work(tmp_path, data_dir, monkeypatch):
    """--quant nf4 --compile: the layers cannot be compiled under FSDP2 (test below), so an explicit --compile is
    refused with the reason, before the process group; without it, --quant nf4 runs its layers eager."""
    out = tmp_path / "o"
    argv = flags(data_dir, 8, "--quant", "nf4", "--compile", "--output-dir", str(out))
    message = parity.refused(monkeypatch, TRAIN, *argv, world=2)
    assert "--quant nf4 --compile" in message and "Params4bit" in message and "Drop --compile" in message
    assert not out.exists()


def test_qlora_compile_by_default_runs_the_layers_eager(monkeypatch, capsys):
    """A GPU run's --compile is a default, not asked for: `--quant nf4` alone is not refused, and its layers run
    eager, said once and recorded (`compile_layers`' eager_because: `cli.eager_because`, in the script's call)."""
    import runpy

    from ftkit import cli, compilation

    parse_args = runpy.run_path(TRAIN)["parse_args"]
    monkeypatch.setattr("sys.argv", [TRAIN, "--quant", "nf4"])
    args = parse_args()
    assert args.compile and "compile" not in args.explicit_flags
    because = cli.eager_because(args)
    assert because == cli.FSDP_NF4_EAGER_BECAUSE and "Params4bit" in because
    assert compilation.compile_layers(torch.nn.Module(), True, eager_because=because) == {"eager": because}
    assert capsys.readouterr().out.count("the decoder layers run eager") == 1
    assert "eager_because=cli.eager_because(args)" in open(TRAIN).read()  # the script's own call passes it
    monkeypatch.setattr("sys.argv", [TRAIN, "--quant", "none"])
    assert cli.eager_because(parse_args()) is None  # a bf16 base compiles
    monkeypatch.setattr("sys.argv", [TRAIN, "--quant", "nf4", "--no-compile"])
    assert not parse_args().compile


def test_a_sharded_4bit_base_does_not_compile(tmp_path):
    """The reason the refusal gives, held: the tiny model in NF4 with LoRA, its layers compiled as --compile would
    (aot_eager: dynamo's capture, which is where it stops) and sharded by fsdp-ft's `shard_model`: dynamo stops in
    bitsandbytes' re-wrap of the all-gathered weight (tests/fsdp_4bit_compile.py). When this fails, a torch or
    bitsandbytes has fixed it: lift the refusal and prove the compiled losses equal the eager ones instead."""
    out = tmp_path / "compiled.json"
    env = {"FTKIT_COMPILE_BACKEND": "aot_eager"}
    run = parity.torchrun("tests/fsdp_4bit_compile.py", str(out), env=env)
    assert run.returncode == 0, run.report()
    error = json.loads(out.read_text())["error"]
    assert error is not None, "the sharded 4-bit layers compiled: lift fsdp-ft's --quant nf4 --compile refusal"
    assert error["type"] == "Unsupported", error
    assert "fix_4bit_weight_quant_state_from_module" in error["text"] and "Params4bit" in error["text"], error


def test_qlora_with_cpu_offload_is_refused_before_any_work(tmp_path, data_dir, monkeypatch):
    argv = flags(data_dir, 8, "--quant", "nf4", "--cpu-offload", "--output-dir", str(tmp_path / "o"))
    message = parity.refused(monkeypatch, TRAIN, *argv, world=2)
    assert "--cpu-offload" in message and not (tmp_path / "o").exists()


# --cpu-offload (FSDP2's CPUOffloadPolicy) on CPU: the same code path as on a GPU with the host on both sides of
# the copies, so its math, metrics and checkpoint run here. An eval after every step and a checkpoint only at the
# end: each step 2-4 follows a forward without backward, with no checkpoint save between them (saving reshards).
@pytest.fixture(scope="module")
def offload(tmp_path_factory, data_dir):
    return launch(
        tmp_path_factory, "offload", *flags(data_dir, 8, "--cpu-offload", "--eval-every", "1", "--save-every", "4")
    )


def test_cpu_offload_computes_the_same_step(offload, accum):
    assert summary(offload)["config"]["cpu_offload"] is True
    assert parity.compare_losses(offload.run_dir, accum.run_dir) <= parity.LOSS_TOL
    assert parity.compare_adapters(offload.run_dir / "adapter", accum.run_dir / "adapter") <= parity.ADAPTER_TOL


def test_the_step_after_an_eval_all_gathers_as_theory_says(offload):
    """FSDP2 keeps the root unit (embedding, tied lm_head, final norm) unsharded after a forward without
    backward; unless the script reshards it, the next step skips its all-gather and sends less than the theory."""
    s = summary(offload)
    rows = parity.metrics(offload.run_dir)
    assert all("eval_loss" in row for row in rows)
    assert [row["comm"]["all_gather"]["bytes"] for row in rows] == [s["theory_all_gather_bytes"]] * STEPS


def test_no_host_sync_per_micro_batch(accum):
    counts = parity.host_syncs(accum.run_dir, save_every=2)
    print(f"host syncs per plain step {counts}")
    assert max(counts) <= parity.MAX_HOST_SYNCS
    assert "lost_update_fraction" not in parity.metrics(accum.run_dir)[0]  # a diagnostic only when asked for
