"""experiments/tp-ft (DTensor parallelize_module) and experiments/tp-sp-ft (hand-rolled Megatron TP + SP) on 2 CPU
processes (torchrun, gloo): the same training step as the single-process LoRA reference, the same first-step
gradient for every LoRA tensor once the shards are reassembled, the collectives theory predicts, a reassembled
(and merged) adapter that gives one device the logits the sharded model gave, the naive plan's error, and a
TP degree that does not divide the KV heads refused before the model loads."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import parity
import pytest
import torch
from conftest import run_script
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from ftkit import batching, data, lora, models
from ftkit.activations import layer_saved_bytes
from ftkit.errors import RunError
from ftkit.memory import ModelShape
from ftkit.ranks import check_tp_degree

TP_TRAIN, TP_INFER = "experiments/tp-ft/train.py", "experiments/tp-ft/infer.py"
SP_TRAIN, SP_INFER = "experiments/tp-sp-ft/train.py", "experiments/tp-sp-ft/infer.py"
STEPS, BATCH, MICRO, MAX_LENGTH, LORA_RANK = 4, 4, 2, 256, 16


def flags(data_dir, *extra: str) -> list[str]:
    # No checkpointing, so each forward collective runs once (checkpointing reissues them in the recompute).
    return [
        "--smoke",
        "--data",
        str(data_dir),
        "--max-steps",
        str(STEPS),
        "--max-length",
        str(MAX_LENGTH),
        "--batch-size",
        str(BATCH),
        "--micro-batch-size",
        str(MICRO),
        "--eval-every",
        "2",
        "--eval-examples",
        "4",
        "--no-grad-checkpointing",
        "--no-progress",
        *extra,
    ]


def launch(tmp_path_factory, script: str, name: str, *args: str) -> parity.Launch:
    run = parity.torchrun(script, *args, "--output-dir", str(tmp_path_factory.mktemp("tp") / name))
    assert run.returncode == 0, run.report()
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    # Every step checkpointed: the gradient test starts from the reference's adapter after step 2.
    ref_flags = (*flags(data_dir), "--save-every", "1", "--keep-checkpoints", str(STEPS))
    return parity.reference(tmp_path_factory.mktemp("ref"), *ref_flags, quant="none")


@pytest.fixture(scope="module")
def tp(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, TP_TRAIN, "tp", *flags(data_dir, "--dump-grads", "--dump-logits"))


@pytest.fixture(scope="module")
def sp(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, SP_TRAIN, "sp", *flags(data_dir, "--dump-grads", "--dump-logits", "--merge"))


@pytest.fixture(scope="module")
def megatron_tp(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, SP_TRAIN, "megatron-tp", *flags(data_dir, "--no-sequence-parallel"))


RUNS = ["tp", "sp", "megatron_tp"]


@pytest.mark.parametrize("run_name", RUNS)
def test_same_step_as_the_single_process_reference(request, reference, run_name):
    run = request.getfixturevalue(run_name)
    loss = parity.compare_losses(run.run_dir, reference)
    eval_loss = parity.compare_losses(run.run_dir, reference, key="eval_loss")
    adapter = parity.compare_adapters(run.run_dir / "adapter", reference / "adapter")
    print(f"{run_name}: max |loss diff| {loss:.2e}, eval {eval_loss:.2e}, adapter {adapter:.2e}")
    assert loss <= parity.LOSS_TOL and eval_loss <= parity.LOSS_TOL
    assert adapter <= parity.ADAPTER_TOL


def reference_grads(data_dir, reference) -> dict[str, torch.Tensor]:
    """Step 3's LoRA gradients of the unsharded model, computed here as the single-process script does, from the
    reference run's adapter after step 2. Not earlier: lora_B starts at zero, and the warmup's first step runs at
    lr 0, so A's gradient (s dY B^T X) is zero in steps 1 and 2, and a wrong one would pass unseen."""
    splits = data.load_splits(str(data_dir))
    tokenizer = models.load_tokenizer("tiny", data.corpus(splits["train"]))
    train_set, _ = data.ChatFormatter(tokenizer, MAX_LENGTH).encode_all(splits["train"])
    batches = batching.GlobalBatches(train_set, BATCH, seed=0)
    model = models.load_model(
        "tiny", quant="none", dtype=torch.float32, device=torch.device("cpu"), seed=0, vocab_size=len(tokenizer)
    )
    model = lora.apply_lora(model, LORA_RANK, 32.0, 0.0, seed=0)
    set_peft_model_state_dict(
        model, load_file(reference / "checkpoints" / "step-2" / "adapter" / "adapter_model.safetensors")
    )
    n_target = batches.n_target(2)
    for mb in batches.micro_batches(2, MICRO):
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        (batching.token_loss_sum(logits[:, :-1], mb["labels"][:, 1:]) / n_target).backward()  # every position's loss
    return {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def ref_grads(data_dir, reference):
    grads = reference_grads(data_dir, reference)
    assert all(g.abs().max() > 0 for g in grads.values()), "a zero reference gradient checks nothing"
    return grads


@pytest.mark.parametrize("run_name", ["tp", "sp"])
def test_every_lora_gradient_matches_after_reassembly(request, ref_grads, run_name):
    """Including the replicated tensors (A of column layers, B of row layers), whose per-rank gradient is only
    a share: sp/megatron_tp sum the shares with one all-reduce, tp-ft's plan all-reduces B's input gradient."""
    grads = load_file(request.getfixturevalue(run_name).run_dir / "grads-step3.safetensors")
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    worst = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
    print(f"{run_name}: {len(grads)} LoRA gradients, max |diff| {worst:.2e} (largest element {scale:.2e})")
    assert all(grads[k].shape == ref_grads[k].shape for k in grads)
    assert worst <= 1e-5 * scale  # fp32, another summation order


def shapes(run) -> tuple[dict, list[dict]]:
    return json.loads((run.run_dir / "summary.json").read_text()), parity.metrics(run.run_dir)


def test_megatron_tp_all_reduces_twice_per_layer_each_way(megatron_tp):
    """Per micro-batch and layer: g after o_proj and down_proj in forward, f before attention and MLP in backward,
    each on one [micro, seq, hidden] activation - except layer 0's attention f, whose input (the frozen
    embedding's output) needs no gradient. Plus one all-reduce of the replicated LoRA gradients per step."""
    summary, rows = shapes(megatron_tp)
    layers = 4
    for row in rows:
        act = row["activation_bytes"]  # [micro, seq, hidden] fp32, summed over the step's micro-batches
        assert set(row["comm"]) == {"all_reduce"}
        assert row["comm"]["all_reduce"]["bytes"] == (4 * layers - 1) * act + summary["replicated_lora_grad_bytes"]
        assert row["comm"]["all_reduce"]["count"] == BATCH // MICRO * (4 * layers - 1) + 1
    # The summary states the same theory (ftkit.comm.tp_sp_collective_theory), beside what was recorded.
    assert summary["theory_comm_bytes_per_step"] == pytest.approx(summary["comm_bytes_per_step"], rel=1e-12)


def test_sequence_parallel_sends_the_same_bytes_as_reduce_scatter_plus_all_gather(sp, megatron_tp):
    """Each f/g all-reduce becomes an all-gather + reduce-scatter pair on the same activation (Korthikanti et al.
    2022, Sec. 4.2.2); SP adds the all-gather before lm_head and keeps layer 0's forward all-gather. On a ring,
    an all-reduce puts 2(N-1)/N of its buffer on the wire and each half (N-1)/N: the same wire bytes, plus those
    two activations."""
    summary, rows = shapes(sp)
    _, plain = shapes(megatron_tp)
    layers, n = 4, 2
    for row, other in zip(rows, plain):
        act = row["activation_bytes"]
        assert row["comm"]["all_gather"]["bytes"] == (4 * layers + 1) * act
        assert row["comm"]["reduce_scatter"]["bytes"] == (4 * layers - 1) * act
        assert row["comm"]["all_reduce"]["bytes"] == summary["replicated_lora_grad_bytes"]
        wire_sp = sum(
            parity_ring(kind, row["comm"][kind]["bytes"], n) for kind in ("all_gather", "reduce_scatter", "all_reduce")
        )
        wire_tp = parity_ring("all_reduce", other["comm"]["all_reduce"]["bytes"], n)
        assert wire_sp == wire_tp + 2 * (n - 1) / n * act
    steps = len(rows)
    by_kind = {kind: t["bytes"] / steps for kind, t in summary["comm"].items()}
    assert summary["theory_comm_by_kind_per_step"] == pytest.approx(by_kind, rel=1e-12)


def parity_ring(kind: str, size: float, world: int) -> float:
    from ftkit.comm import ring_wire_bytes

    return ring_wire_bytes(kind, size, world)


def test_parallelize_module_all_reduces_per_module(tp):
    """DTensor's plan works module by module: every ColwiseParallel module all-reduces its own input gradient
    (q, k, v, gate and up separately, 5 per layer where Megatron's f does 2) and so does each lora_B; forward,
    RowwiseParallel all-reduces o_proj's and down_proj's partial outputs and those of their lora_A."""
    summary, rows = shapes(tp)
    layers, micro = 4, BATCH // MICRO
    # Recorded on sampled steps (the dispatch mode costs Python work per op): the first and the eval steps.
    sampled = [row for row in rows if "comm" in row]
    assert [row["step"] for row in sampled] == [1, *range(2, STEPS + 1, 2)]
    assert "sampled steps" in summary["comm_note"]
    for row in sampled:
        act = row["activation_bytes"]
        rank_r = act * LORA_RANK // 128  # [micro, seq, r] of the tiny model (hidden 128)
        assert set(row["comm"]) == {"all_reduce"}
        assert row["comm"]["all_reduce"]["count"] == micro * (4 * layers + 10 * layers - 3)
        expected = (2 * layers + 5 * layers - 3) * act + (2 * layers + 5 * layers) * rank_r
        assert row["comm"]["all_reduce"]["bytes"] == expected
    assert summary["theory_comm_bytes_per_step"] == summary["comm_bytes_per_step"]


def logits_on_one_device(run_dir, merged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits the TP model gave, logits of the reassembled adapter / merged model on one process), on the real
    (unmasked) positions of the same batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dumped = torch.load(run_dir / "logits.pt")
    batch, tp_logits = dumped["batch"], dumped["logits"]
    cfg = json.loads((run_dir / "config.json").read_text())["args"]
    splits = data.load_splits(cfg["data"])
    tokenizer = models.load_tokenizer("tiny", data.corpus(splits["train"]))
    if merged:
        model = AutoModelForCausalLM.from_pretrained(run_dir / "merged", dtype=torch.float32)
    else:
        base = models.load_model(
            "tiny", quant="none", dtype=torch.float32, device=torch.device("cpu"), seed=0, vocab_size=len(tokenizer)
        )
        model = PeftModel.from_pretrained(base, run_dir / "adapter")
    with torch.no_grad():
        logits = model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    real = batch["attention_mask"].bool()
    return tp_logits[real], logits[real]


@pytest.mark.parametrize("run_name, merged", [("tp", False), ("sp", False), ("sp", True)])
def test_reassembled_adapter_gives_one_device_the_same_logits(request, run_name, merged):
    tp_logits, one = logits_on_one_device(request.getfixturevalue(run_name).run_dir, merged)
    diff = (tp_logits - one).abs().max().item()
    print(f"{run_name}{' merged' if merged else ''}: max |logit diff| {diff:.2e}")
    assert diff <= 1e-4  # logits of size ~10, fp32: relative 1e-5


def test_infer_on_the_reassembled_adapter(tp, sp, tmp_path):
    parity.infer_with_a_loud_adapter(TP_INFER, tp.run_dir, tmp_path)
    # --merged generates the finetuned column from the merged model (merged/), which the loud adapter leaves as it
    # is; the merged weights' logits are checked against the adapter's in test_reassembled_adapter_gives_...
    proc = run_script(
        SP_INFER, "--smoke", "--run", str(sp.run_dir), "--num-examples", "1", "--max-new-tokens", "4", "--merged"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ROUGE F1" in proc.stdout


def test_naive_plan_fails_with_the_shape_error(tmp_path, data_dir):
    run = parity.torchrun(TP_TRAIN, *flags(data_dir, "--naive-plan"), "--output-dir", str(tmp_path / "o"))
    assert run.returncode != 0
    err = [run.stderr(rank) for rank in (0, 1)]
    assert "--naive-plan" in err[0] and "must match the size of tensor" in err[0], run.report()
    assert "--naive-plan" not in err[1], run.report()  # the same failure on every rank, said once
    assert not any("Traceback" in e for e in err)


def test_tp_degree_must_divide_the_heads():
    qwen3_4b = SimpleNamespace(**models.QWEN3_4B_CONFIG)
    for ok in (1, 2, 4, 8):
        check_tp_degree(qwen3_4b, ok)
    for bad in (3, 16):
        with pytest.raises(RunError, match="8 key/value heads"):
            check_tp_degree(qwen3_4b, bad)


@pytest.mark.parametrize("script", [TP_TRAIN, SP_TRAIN])
def test_tp_degree_refused_before_the_model_loads(script, tmp_path, data_dir, monkeypatch):
    """3 ranks on the tiny model (4 KV heads): refused before the process group, the data or any weight."""
    message = parity.refused(monkeypatch, script, *flags(data_dir, "--output-dir", str(tmp_path / "o")), world=3)
    assert "does not divide the model's 4 key/value heads" in message and not (tmp_path / "o").exists()


def test_sequence_parallel_divides_the_norm_activations_by_the_tp_degree(sp, megatron_tp):
    """Per-rank bytes autograd saves in decoder layer 1 on the first micro-batch (both runs see the same one).
    Each RMSNorm saves its fp32 input and 1/rms, 4(h + 1) bytes per token, and SP divides that part by the TP
    degree: measured, to the byte. Everything else this layer saves is the same with and without SP (attention
    and the LoRA inputs see the whole sequence after the all-gather), so the layer saves less by exactly the
    norms' share."""
    h, tp = 128, 2
    sp_m = json.loads((sp.run_dir / "summary.json").read_text())["activations_measured"]
    tp_m = json.loads((megatron_tp.run_dir / "summary.json").read_text())["activations_measured"]
    assert tp_m["tokens"] == tp * sp_m["tokens"]
    for m in (sp_m, tp_m):
        assert m["norms"] == m["tokens"] * 2 * 4 * (h + 1)
    assert tp_m["layer"] - sp_m["layer"] == tp_m["norms"] - sp_m["norms"]
    # The memory model's layer (ftkit/activations.py's layer_saved_bytes, which predict() counts) saves less under SP by
    # the same bytes: the norms' part alone, the gathered inputs the LoRA A's save kept whole. (Megatron-LM's SP,
    # saving the local shard and gathering it again in backward, would save less by the whole hidden part.)
    shape, tokens = ModelShape.from_config(models.TINY_CONFIG), tp_m["tokens"]
    model = {
        sp_on: layer_saved_bytes(shape, tokens, tp=tp, sequence_parallel=sp_on, act_bytes=4, lora_rank=16)
        for sp_on in (False, True)
    }
    assert tp_m["layer"] - sp_m["layer"] == model[False] - model[True]
    # Beyond the model, the layer's attention saves RoPE's cos and sin ([rows, 1, width, head_dim] fp32 each, a set
    # per row since packed rows carry their own positions): made once per forward and shared by every layer, so the
    # model counts them in no layer.
    rope = 2 * tokens * shape.head_dim * 4
    assert tp_m["layer"] - model[False] == sp_m["layer"] - model[True] == rope
    print(
        f"layer 1 per rank: TP {tp_m['layer']:,} B, TP+SP {sp_m['layer']:,} B; "
        f"norms {tp_m['norms']:,} -> {sp_m['norms']:,}"
    )


@pytest.mark.parametrize("run_name", ["tp", "sp", "megatron_tp"])
def test_no_host_sync_per_micro_batch(request, run_name):
    counts = parity.host_syncs(request.getfixturevalue(run_name).run_dir, save_every=10**6)
    print(f"{run_name}: host syncs per plain step {counts}")
    assert max(counts) <= parity.MAX_HOST_SYNCS


# LoRA dropout draws random masks on every rank in every step: a resume that lost a rank's RNG stream would change
# the losses, where without dropout (--smoke's default) it would go unnoticed.
DROPOUT = ("--lora-dropout", "0.1")


def resumed_equals_uninterrupted(script: str, tmp_path, data_dir, stop: bool) -> None:
    """An uninterrupted run with LoRA dropout 0.1, and the same run continued from its step-2 checkpoint: either
    stopped there (--stop-after 2) and continued with the command it prints, or a copy resumed from the uninterrupted
    run's own checkpoint. The per-step losses and the adapter must be the same."""
    whole_flags = flags(data_dir, *DROPOUT, "--save-every", "2")
    whole = parity.torchrun(script, *whole_flags, "--output-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.report()
    # The ranks hold the same tokens, replicated inputs included: they draw the same dropout masks.
    assert torch.equal(*parity.rank_dropout_streams(whole.run_dir / "checkpoints" / "step-2"))
    out = tmp_path / "resumed"
    if stop:
        first = parity.torchrun(script, *flags(data_dir, *DROPOUT), "--output-dir", str(out), "--stop-after", "2")
        assert first.returncode == 0, first.report()
        assert not (out / "adapter").exists() and (out / "checkpoints" / "step-2" / "trainer_state.json").exists()
        assert f"{script} --resume {out}" in first.ranks[0]["stdout"], first.report()
        second = parity.torchrun(script, "--resume", str(out))
    else:
        shutil.copytree(whole.run_dir, out, ignore=shutil.ignore_patterns("adapter", "summary.json"))
        second = parity.torchrun(script, "--resume", str(out / "checkpoints" / "step-2"), "--output-dir", str(out))
    assert second.returncode == 0, second.report()
    assert [r["step"] for r in parity.metrics(out)] == list(range(1, STEPS + 1))
    assert parity.compare_losses(out, whole.run_dir) <= 1e-6
    assert parity.compare_adapters(out / "adapter", whole.run_dir / "adapter") <= 1e-6


def test_tp_ft_resumes_the_uninterrupted_run(tmp_path, data_dir):
    """DTensor shards, replicated adapters and AdamW state through torch.distributed.checkpoint."""
    resumed_equals_uninterrupted(TP_TRAIN, tmp_path, data_dir, stop=False)


def test_tp_sp_ft_stops_and_resumes_as_the_uninterrupted_run(tmp_path, data_dir):
    """The hand-rolled slices through one file per rank (checkpoint.save_per_rank), via --stop-after 2 and the
    printed --resume command."""
    resumed_equals_uninterrupted(SP_TRAIN, tmp_path, data_dir, stop=True)
