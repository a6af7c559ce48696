"""experiments/pp-ft on 2 CPU processes (torchrun, gloo): GPipe, 1F1B, interleaved 1F1B and the zero-bubble schedules
(interleaved ZB, ZBV, DualPipeV) compute the same training step as the single-process LoRA reference; the
activations sent between stages are what theory says; no shape inference runs inside a timed step; the bubble is
recorded, shrinks with more micro-batches and is reported (the median of steps 2..N) against each schedule's theory;
the stage-local adapters merge into the full model's adapter, which gives the pipeline's eval loss on one process;
resume; a stage count that does not divide the layers is refused."""

from __future__ import annotations

import importlib.util
import json
import shutil
import statistics

import parity
import pytest
import torch
from conftest import ROOT

TRAIN = "experiments/pp-ft/train.py"
INFER = "experiments/pp-ft/infer.py"
STEPS = 4
MAX_LENGTH = 256


def flags(data_dir, micro: int, *extra: str) -> list[str]:
    return [
        "--smoke",
        "--data",
        str(data_dir),
        "--max-steps",
        str(STEPS),
        "--max-length",
        str(MAX_LENGTH),
        "--batch-size",
        "8",
        "--micro-batch-size",
        str(micro),
        "--eval-every",
        "2",
        "--save-every",
        "2",
        "--eval-examples",
        "8",
        "--no-progress",
        *extra,
    ]


def train_module():
    spec = importlib.util.spec_from_file_location("pp_train", ROOT / TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(tmp_path_factory, name: str, *args: str) -> parity.Launch:
    run = parity.torchrun(TRAIN, *args, "--output-dir", str(tmp_path_factory.mktemp("pp") / name))
    assert run.returncode == 0, run.report()
    return run


# Global batch 8 in every run. GPipe with 2 micro-batches of 4, 1F1B with 8 of 1 (GPipe and 1F1B have the same
# bubble, (p-1)/(m+p-1): 1/3 at m=2, 1/9 at m=8), interleaved 1F1B with 4 of 2 on 2 ranks x 2 stages.
@pytest.fixture(scope="module")
def gpipe(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "gpipe", *flags(data_dir, 4, "--schedule", "gpipe"))


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "1f1b", *flags(data_dir, 1, "--schedule", "1f1b"))


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory, data_dir):
    return launch(tmp_path_factory, "interleaved", *flags(data_dir, 2, "--schedule", "interleaved-1f1b"))


# The zero-bubble schedules, 2 ranks x 2 stages, m = 4: interleaved ZB on the interleaved layout, ZBV and DualPipeV
# on the V (rank 0: stages 0 and 3, rank 1: stages 1 and 2). Without activation checkpointing, under which every
# weight-gradient action recomputes its layer (test_the_weight_gradient_recomputes_checkpointed_layers): about a fifth
# less CPU per launch. The devlog's runs check them with it.
def zero_bubble(tmp_path_factory, data_dir, schedule: str) -> parity.Launch:
    return launch(tmp_path_factory, schedule, *flags(data_dir, 2, "--schedule", schedule, "--no-grad-checkpointing"))


@pytest.fixture(scope="module")
def interleaved_zb(tmp_path_factory, data_dir):
    return zero_bubble(tmp_path_factory, data_dir, "interleaved-zb")


@pytest.fixture(scope="module")
def zbv(tmp_path_factory, data_dir):
    return zero_bubble(tmp_path_factory, data_dir, "zbv")


@pytest.fixture(scope="module")
def dualpipev(tmp_path_factory, data_dir):
    return zero_bubble(tmp_path_factory, data_dir, "dualpipev")


ZERO_BUBBLE = ["interleaved_zb", "zbv", "dualpipev"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    # Micro-batches are accumulation here: the reference's micro-batch size changes summation order only.
    return parity.reference(tmp_path_factory.mktemp("ref"), *flags(data_dir, 2), quant="none")


@pytest.mark.parametrize("run_name", ["gpipe", "one_f_one_b", "interleaved", *ZERO_BUBBLE])
def test_same_step_as_the_single_process_reference(request, reference, run_name):
    run = request.getfixturevalue(run_name)
    loss = parity.compare_losses(run.run_dir, reference)
    eval_loss = parity.compare_losses(run.run_dir, reference, key="eval_loss")
    adapter = parity.compare_adapters(run.run_dir / "adapter", reference / "adapter")
    print(f"{run_name}: max |loss diff| {loss:.2e}, eval {eval_loss:.2e}, adapter {adapter:.2e}")
    assert loss <= parity.LOSS_TOL and eval_loss <= parity.LOSS_TOL
    assert adapter <= parity.ADAPTER_TOL
    assert [r["step"] for r in parity.metrics(run.run_dir)] == list(range(1, STEPS + 1))


@pytest.mark.parametrize(
    "run_name, stages, micro, crossings",
    [
        ("gpipe", 2, 4, 1),
        ("one_f_one_b", 2, 1, 1),
        ("interleaved", 4, 2, 3),
        ("interleaved_zb", 4, 2, 3),
        ("zbv", 4, 2, 2),  # on the V, stages 1 and 2 are both rank 1's: that boundary sends nothing
        ("dualpipev", 4, 2, 2),
    ],
)
def test_activation_bytes_between_stages_match_theory(request, run_name, stages, micro, crossings):
    """Each micro-batch crosses each stage boundary between two ranks twice: its activations (micro x seq x hidden x
    4 bytes in fp32) forward, their gradient (the same size) backward."""
    run = request.getfixturevalue(run_name)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    hidden = 128  # the tiny model
    per_micro = micro * MAX_LENGTH * hidden * 4
    m = 8 // micro
    assert summary["activation_bytes_per_microbatch"] == per_micro
    assert summary["pipeline"]["stages"] == stages and summary["pipeline"]["microbatches"] == m
    for row in parity.metrics(run.run_dir):
        assert row["comm"]["send"]["count"] == 2 * crossings * m
        assert row["comm"]["send"]["bytes"] == 2 * crossings * m * per_micro
    assert summary["comm_bytes_per_step"] == 2 * crossings * m * per_micro


def test_bubble_is_recorded_and_shrinks_with_more_microbatches(gpipe, one_f_one_b, interleaved):
    def summary(run):
        return json.loads((run.run_dir / "summary.json").read_text())

    few, many, inter = summary(gpipe), summary(one_f_one_b), summary(interleaved)
    assert few["bubble_theory"] == pytest.approx(1 / 3) and many["bubble_theory"] == pytest.approx(1 / 9)
    assert inter["bubble_theory"] == pytest.approx(1 / 9)  # (p-1)/(v*m+p-1), p=2, v=2, m=4
    for s in (few, many, inter):
        assert 0 < s["bubble"] < 1 and len(s["bubble_per_rank"]) == 2
    for row in parity.metrics(gpipe.run_dir):
        for busy, idle, total in zip(row["busy_s"], row["idle_s"], row["pipeline_time_s"]):
            assert busy > 0 and idle >= 0 and busy + idle == pytest.approx(total)
    print(f"bubble measured: gpipe m=2 {few['bubble']:.3f}, 1f1b m=8 {many['bubble']:.3f}")
    assert many["bubble"] < few["bubble"]


def test_summary_bubble_is_the_median_of_the_steps_after_the_first(gpipe, interleaved):
    """The first step also connects the ranks' point-to-point links: the summary's bubble is the median over steps
    2..N of each step's mean over ranks, per rank the median of that rank's, and says so."""
    for run in (gpipe, interleaved):
        summary = json.loads((run.run_dir / "summary.json").read_text())
        rows = parity.metrics(run.run_dir)[1:]
        assert summary["bubble"] == statistics.median(r["bubble"] for r in rows)
        assert summary["bubble_per_rank"] == [statistics.median(r["bubble_per_rank"][k] for r in rows) for k in (0, 1)]
        assert summary["bubble_steps"] == f"median over steps 2..{STEPS}"


@pytest.mark.parametrize("run_name", ["gpipe", "one_f_one_b", "interleaved", *ZERO_BUBBLE])
def test_no_shape_inference_inside_the_timed_step(request, run_name):
    """The stages are given their shapes (`pipeline_stage`), so torch runs no forward of its own to infer them:
    in every step, the first and the one after an eval (step 3) included, each rank runs exactly m forwards per
    stage it holds. Without the shapes, step 1 and every step after a `schedule.eval()` (which flips the schedule's
    mode and re-initialises it) ran one more per stage, with a backward (and the loss on the last stage), all inside
    the timed step."""
    run_dir = request.getfixturevalue(run_name).run_dir
    pipe = json.loads((run_dir / "summary.json").read_text())["pipeline"]
    per_rank = pipe["microbatches"] * pipe["stages_per_rank"]
    assert [r["stage_forwards"] for r in parity.metrics(run_dir)] == [[per_rank, per_rank]] * STEPS


@pytest.mark.parametrize("run_name", ZERO_BUBBLE)
def test_zero_bubble_theory(request, interleaved, run_name):
    """The zero-bubble schedules' own action order, with equal F, I and W times, idles (p-1)/(3vm+p-1) of the step:
    ZB-H1's (p-1)(T_F+T_B-T_W) per stage (Qi et al. 2023, Table 2), 1/25 at p=2, v=2, m=4, where interleaved 1F1B
    on the same stages idles 1/9. The same order with the run's own F, I, W times is reported next to it."""
    zb = json.loads((request.getfixturevalue(run_name).run_dir / "summary.json").read_text())
    inter = json.loads((interleaved.run_dir / "summary.json").read_text())
    assert zb["bubble_theory"] == pytest.approx(1 / 25)
    for s in (zb, inter):
        assert 0 < s["bubble"] < 1 and 0 <= s["bubble_theory_measured_costs"] < 1
    print(
        f"{run_name}: bubble measured {zb['bubble']:.3f}, theory {zb['bubble_theory']:.3f}, with measured costs "
        f"{zb['bubble_theory_measured_costs']:.3f} (interleaved 1f1b {inter['bubble_theory_measured_costs']:.3f})"
    )


def test_resume_with_dropout_continues_the_same_run(tmp_path, data_dir):
    """With LoRA dropout each stage draws random masks in every step: a copy of a GPipe run resumed from its step-2
    checkpoint (each rank's stages' optimizer state and RNG stream) must run steps 3-4 as the run itself did."""
    args = flags(data_dir, 4, "--schedule", "gpipe", "--lora-dropout", "0.1")
    whole = parity.torchrun(TRAIN, *args, "--output-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.report()
    out = tmp_path / "resumed"
    shutil.copytree(whole.run_dir, out)
    shutil.rmtree(out / "adapter")  # what the resumed run writes, compared below
    second = parity.torchrun(TRAIN, "--resume", str(out / "checkpoints" / "step-2"), "--output-dir", str(out))
    assert second.returncode == 0, second.report()
    assert "at step 2" in second.ranks[0]["stdout"]
    first, last = parity.rank_dropout_streams(out / "checkpoints" / "step-2")
    assert not torch.equal(first, last)  # the ranks run other layers: their dropout streams are their own
    assert [r["step"] for r in parity.metrics(out)] == list(range(1, STEPS + 1))
    assert parity.compare_losses(out, whole.run_dir) <= 1e-6
    assert parity.compare_adapters(out / "adapter", whole.run_dir / "adapter") <= 1e-6


@pytest.mark.parametrize("run_name, layout", [("interleaved", ((0, 2), (1, 3))), ("zbv", ((0, 3), (1, 2)))])
def test_timeline_has_every_action(request, run_name, layout):
    """The last step's forward and backward of every micro-batch on every stage, and the loss of every micro-batch
    on the last stage (3), per rank (for the figure). ZBV splits each backward into its input gradient (I) and
    its weight gradient (W), both timed as compute."""
    timeline = json.loads((request.getfixturevalue(run_name).run_dir / "timeline.json").read_text())
    assert timeline["ranks"] == 2 and timeline["stages"] == 4
    backward = "B" if run_name == "interleaved" else "IW"
    for stages, events in zip(layout, timeline["events"]):
        actions = sorted((stage, kind, mb) for stage, kind, mb, _, _ in events)
        expected = [(s, k, mb) for s in stages for k in "F" + backward for mb in range(4)]
        expected += [(3, "L", mb) for mb in range(4)] if 3 in stages else []
        assert actions == sorted(expected)
        assert all(0 <= start <= end for *_, start, end in events)


def test_schedule_bubble_of_hand_written_orders():
    """GPipe on 2 ranks with 2 micro-batches, written out as actions: idle (p-1)/(m+p-1) = 1/3 of the step. With each
    backward split into I and W, the first stage's I waits only for the next stage's I, not for its W: 1/4."""
    from torch.distributed.pipelining import schedules

    from ftkit.pipeline_timing import schedule_bubble

    def order(backward: str) -> dict[int, list]:
        kinds = [schedules.F] + [{"B": schedules.B, "I": schedules.I, "W": schedules.W}[k] for k in backward]
        return {r: [schedules._Action(r, kind, mb) for kind in kinds for mb in (0, 1)] for r in (0, 1)}

    assert schedule_bubble(order("B")) == pytest.approx(1 / 3)
    assert schedule_bubble(order("B"), {(s, k): c for s in (0, 1) for k, c in zip("FIW", (1, 2, 0))}) == (
        pytest.approx(1 / 3)
    )
    assert schedule_bubble(order("IW")) == pytest.approx(1 / 4)


def test_the_weight_gradient_recomputes_checkpointed_layers():
    """What the zero-bubble schedules' split costs under activation checkpointing (blogs/pp.md): torch's input-
    gradient pass (I) recomputes each checkpointed layer's forward once, and its weight-gradient pass (W) once per
    group of trainable weights in the layer (here two LoRA-like groups per layer); without checkpointing, never."""
    from torch import nn
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.checkpoint import checkpoint

    calls = [0]

    class Layer(nn.Module):  # a frozen linear plus a trainable low-rank branch, as LoRA adds
        def __init__(self):
            super().__init__()
            self.base, self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 4, bias=False), nn.Linear(4, 32, bias=False)
            self.base.requires_grad_(False)

        def forward(self, x):
            calls[0] += 1
            return torch.relu(self.base(x) + self.b(self.a(x)))

    for checkpointed, recomputed in ((False, (0, 0)), (True, (2, 4))):
        layers = nn.ModuleList(Layer() for _ in range(2))
        x = torch.randn(8, 32, requires_grad=True)
        y = x
        for layer in layers:
            y = checkpoint(layer, y, use_reentrant=False) if checkpointed else layer(y)
        calls[0] = 0
        _, groups = stage_backward_input((y,), [torch.ones_like(y)], [x], layers.parameters())
        in_i = calls[0]
        stage_backward_weight(layers.parameters(), groups)
        assert (in_i, calls[0] - in_i) == recomputed
        assert all(p.grad is not None for p in layers.parameters() if p.requires_grad)


def test_layer_indices_are_remapped_to_the_full_model():
    from ftkit.checkpoint import global_adapter_key as key

    assert key("layers.1.mlp.up_proj.lora_A.default.weight", 2) == (
        "base_model.model.model.layers.3.mlp.up_proj.lora_A.weight"
    )
    assert key("layers.0.self_attn.q_proj.lora_B.default.weight", 0) == (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    )
    with pytest.raises(ValueError):
        key("lm_head.weight", 2)


def test_merged_adapter_on_one_process_gives_the_pipelines_eval_loss(interleaved, data_dir):
    """The full model + the merged adapter, one process, no pipeline: the eval loss over the same held-out
    examples equals the one the pipeline's last stage computed from its logits at the last step."""
    from peft import PeftModel

    from ftkit import data, evaluation, models

    splits = data.load_splits(str(data_dir), None)
    tokenizer = models.load_tokenizer("tiny", data.corpus(splits["train"]))
    val_set, _ = data.ChatFormatter(tokenizer, MAX_LENGTH).encode_all(splits["val"])
    base = models.load_model(
        "tiny", quant="none", dtype=torch.float32, device=torch.device("cpu"), seed=0, vocab_size=len(tokenizer)
    )
    model = PeftModel.from_pretrained(base, interleaved.run_dir / "adapter")
    sums = evaluation.loss_sums(model, evaluation.micro_batches(val_set, 8, 2), torch.device("cpu"))
    pipeline_eval = parity.metrics(interleaved.run_dir)[-1]["eval_loss"]
    assert abs((sums[0] / sums[1]).item() - pipeline_eval) <= parity.LOSS_TOL


def test_infer_on_the_merged_adapter(gpipe, tmp_path):
    parity.infer_with_a_loud_adapter(INFER, gpipe.run_dir, tmp_path)


def test_stage_layout():
    module = train_module()
    layout, stages_of = module.stage_layout, module.rank_stages
    assert layout(4, 2, "1f1b") == (2, 2)
    assert layout(4, 2, "interleaved-1f1b") == (4, 1)
    assert layout(36, 4, "gpipe") == (4, 9)  # Qwen3-4B on 4 GPUs
    assert layout(36, 2, "zbv") == layout(36, 2, "dualpipev") == layout(36, 2, "interleaved-zb") == (4, 9)
    with pytest.raises(Exception, match="do not divide"):
        layout(36, 8, "interleaved-1f1b")  # 16 stages
    with pytest.raises(Exception, match="do not divide"):
        layout(36, 4, "zbv")  # 8 stages
    # Every stage on exactly one rank: a loop for interleaving, a V for ZBV and DualPipeV.
    assert [stages_of(r, 4, "interleaved-zb") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of(r, 4, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stages_of(r, 3, "1f1b") for r in range(3)] == [[0], [1], [2]]


def test_fewer_micro_batches_than_stages_are_refused_before_the_model(tmp_path, data_dir, monkeypatch):
    """4 stages on 4 ranks with 2 micro-batches a step (--batch-size 8, micro-batch 4): torch's Schedule1F1B would
    raise after every rank had loaded the model; refused first, with the batch that works."""
    argv = flags(data_dir, 4, "--output-dir", str(tmp_path / "o"))
    message = parity.refused(monkeypatch, TRAIN, *argv, world=4)
    assert "2 micro-batches a step are fewer than the 4 pipeline stages" in message and "--batch-size 16" in message
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "schedule, micro, batch, said",
    [
        ("dualpipev", 4, "8", "2 micro-batches a step are fewer than the 4 pipeline stages"),
        ("interleaved-1f1b", 1, "5", "5 micro-batches a step are not a whole number of rounds of 2 ranks"),
        ("interleaved-zb", 1, "5", "--batch-size 4, a multiple of 2"),
    ],
)
def test_a_micro_batch_count_the_schedule_cannot_lay_out_is_refused_before_the_model(
    schedule, micro, batch, said, tmp_path, data_dir, monkeypatch
):
    """torch's DualPipeV needs as many micro-batches as stages (4 on 2 ranks), its interleaved schedules a whole
    number of rounds (5 micro-batches on 2 ranks are 2 rounds and one over): each raises in its constructor, after
    every rank has loaded the model; refused first, with a batch that works."""
    argv = flags(data_dir, micro, "--schedule", schedule, "--output-dir", str(tmp_path / "o"))
    argv[argv.index("--batch-size") + 1] = batch
    message = parity.refused(monkeypatch, TRAIN, *argv, world=2)
    assert said in message and f"--schedule {schedule}" in message
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("world, schedule", [(3, "1f1b"), (4, "interleaved-1f1b"), (4, "zbv")])
def test_stages_that_do_not_divide_the_layers_are_refused(world, schedule, tmp_path, data_dir, monkeypatch):
    """3 stages on 3 ranks, or 8 on 4 ranks interleaved or on a V, for 4 layers: refused before the process group
    or the model."""
    argv = flags(data_dir, 2, "--schedule", schedule, "--output-dir", str(tmp_path / "o"))
    message = parity.refused(monkeypatch, TRAIN, *argv, world=world)
    assert f"{world if schedule == '1f1b' else 2 * world} pipeline stages" in message and "do not divide" in message
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("run_name", ["gpipe", "one_f_one_b", "interleaved", *ZERO_BUBBLE])
def test_no_host_sync_per_micro_batch(request, run_name):
    """1F1B runs 8 micro-batches a step: a sync per micro-batch (a loss .item() each) would count 8 or more."""
    counts = parity.host_syncs(request.getfixturevalue(run_name).run_dir, save_every=2)
    print(f"{run_name}: host syncs per plain step {counts}")
    assert max(counts) <= parity.MAX_HOST_SYNCS
