"""One rank's training step of the script at Qwen3-4B's shape, measured on fake tensors (`measure`): the model
built and given fake storage, `--steps` optimizer steps under the memory tracker, then one more with its FLOPs
counted and its collectives recorded; `report` makes the JSON of them."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import torch

from ftkit import comm
from ftkit.realscale import builders, nf4, report, stand_ins, step, trackers
from ftkit.realscale.configuration import Setup, setup
from ftkit.realscale.flops import MatmulDtypes, causal_sdpa_formulas

# How each script records its collectives (ftkit/comm.py), so this command records what the script's summary
# reports: FSDP2's and tp-sp-ft's through torch.distributed's functions, tp-ft's DTensor redistributions as
# functional collectives.
RECORDING = {"fsdp": comm.recording, "tp": comm.recording_functional, "tp-sp": comm.recording, "cp": comm.recording}


@dataclasses.dataclass
class Measured:
    """What the steps measured, and what of the model and the batch the report needs to set it beside the memory
    model, the convention and the script's theory."""

    config: object  # the model's (transformers) config
    counts: dict  # parameter counts: the whole model's
    batch: step.Batch
    stage: object | None  # pp: this rank's PipelineStage
    quantized: dict  # the 4-bit base's report ({} without one)
    peak: dict  # the memory tracker's peak snapshot
    dtypes: MatmulDtypes  # the counted step's FLOPs, this command's own count
    logical: int  # FlopCounterMode's count of the same step (a DTensor op at its logical shape)
    recorded: dict  # the counted step's collectives: bytes and count by kind
    theory: dict  # the script's theory for them


def measure(opts: argparse.Namespace) -> dict:
    import torch.distributed as dist

    s = setup(opts)
    if s.technique != "single" and not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=s.rank, world_size=s.world, store=FakeStore())

    started = time.perf_counter()
    measured, notes = measure_steps(s)
    elapsed = time.perf_counter() - started
    return report.result(s, measured, notes, elapsed)


def measure_steps(s: Setup) -> tuple[Measured, list[str]]:
    """The model built as the script builds it and the synthetic batch; in fake mode, the model given storage,
    parallelised as the script does (pp's stage, ddp's wrapper), its steps tracked and one counted. Returns the
    measurements and the stand-ins stated."""
    model, counts = builders.build(s.technique, s.script, s.args, s.world, s.device, s.opts.layers)
    config = model.config
    batch = step.synthetic_batch(s, config.vocab_size)
    notes = stand_ins.of_setup(s, batch.unmasked)
    with fake_cuda(s, batch.unmasked):
        constants = builders.materialise(model, s.device)
        quantized = nf4.quantization_report(model, constants) if s.nf4 else {}
        recorder = comm.CommRecorder(s.device)
        stage = schedule = None
        if s.pp:  # from here on, `model` is this rank's stage, as in pp-ft once it drops the other ranks' layers
            model, stage, schedule = builders.pipeline(
                s.script, model, s.args, s.world, s.device, s.accum, batch.n_target
            )
            comm.record_stage_sends([stage], recorder)
            notes.append(stand_ins.pipeline_stage(stage.is_first))
        if s.technique == "ddp":
            model = builders.wrap_ddp(model, s.args, recorder, notes)
        training = step.TrainingStep(s, model, batch, stage, schedule)
        tracker = tracked_steps(s, training, constants)
        dtypes, counter, recorded = counted_step(s, training, recorder, config.vocab_size)
        theory = report.collective_theory(
            s.technique, model, config, s.args, counts, batch.mb, s.runs, training.replicated, s.world, s.script
        )
        peak = tracker.get_tracker_snapshot("peak")
    measured = Measured(
        config=config,
        counts=counts,
        batch=batch,
        stage=stage,
        quantized=quantized,
        peak=peak,
        dtypes=dtypes,
        logical=counter.get_total_flops(),
        recorded=recorded,
        theory=theory,
    )
    return measured, notes


@contextlib.contextmanager
def fake_cuda(s: Setup, unmasked: bool):
    """Fake tensors on the CPU device, with what the CPU would do differently made CUDA's (`stand_ins`), and a
    4-bit base's matmul and (under FSDP) its quantization state as bitsandbytes' CUDA path has them (`nf4`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        stand_ins.cuda_dropout(),
        stand_ins.causal_mask_skipped(unmasked),
        stand_ins.lower_right_flash(s.script if s.technique == "cp" else None),
        nf4.dequantising_gemm_4bit() if s.nf4 else contextlib.nullcontext(),
        nf4.fsdp_quant_state() if s.nf4 and s.technique == "fsdp" else contextlib.nullcontext(),
    ):
        yield


def tracked_steps(s: Setup, training: step.TrainingStep, constants: list[torch.Tensor]):
    """`steps` optimizer steps of `accum` micro-steps each, memory tracked from the start; the tracker."""
    mb = training.batch.mb
    keys = ("input_ids", "target") if s.pp else ("input_ids", "attention_mask", "logit_positions", "targets")
    keys = ("input_ids", "position_ids", "logit_positions", "targets") if s.technique == "cp" else keys
    tracker = trackers.make_tracker(
        s.technique, training.model, training.optimizer, (*(mb[k] for k in keys), *constants)
    )
    with trackers.no_tracker_graph_leak(), tracker:
        for _ in range(s.opts.steps):
            training.optimizer_step_of_micro_steps(tracker)
    return tracker


def counted_step(s: Setup, training: step.TrainingStep, recorder: comm.CommRecorder, vocab: int):
    """One more optimizer step, its FLOPs counted (not inside the memory tracker: under both, the tracker reported
    tens of GiB of temporaries that it does not report alone) and its collectives recorded; (this command's count,
    FlopCounterMode, the collectives)."""
    from torch.utils.flop_counter import FlopCounterMode

    causal = causal_sdpa_formulas()
    dtypes = MatmulDtypes(vocab, causal)
    counter = FlopCounterMode(display=False, custom_mapping=causal)
    recorder.take()  # only the counted step's collectives
    recording = RECORDING[s.technique](recorder) if s.technique in RECORDING else contextlib.nullcontext()
    with dtypes, counter, recording:
        training.optimizer_step_of_micro_steps()
    recorded = {kind: {"bytes": c["bytes"], "count": c["count"]} for kind, c in recorder.take().items()}
    return dtypes, counter, recorded
