"""The JSON of one measurement (`result`): the tracked peak beside the memory model's prediction (`ftkit.memory`),
the counted FLOPs beside the MFU convention (`ftkit.metrics`), the recorded collectives beside the script's own
theory (`ftkit.comm`), and the configuration and the stand-ins that qualify them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftkit import cli, comm, hardware, memory, metrics
from ftkit.realscale import LABEL, SCRIPTS, SEQUENCE_SPLIT, TENSOR_PARALLEL
from ftkit.realscale.configuration import Setup

if TYPE_CHECKING:
    from ftkit.realscale.measure import Measured


def result(s: Setup, m: Measured, stand_ins: list[str], elapsed: float) -> dict:
    technique = s.technique
    matmul_total = sum(m.dtypes.by_dtype.values())
    scale = s.accum / s.runs  # exact: every micro-step counts the same
    return {
        "technique": technique,
        "script": f"experiments/{SCRIPTS[technique]}/train.py",
        "world_size": s.world,
        "rank": s.rank,
        "label": LABEL,
        "config": config_report(s, m),
        "parameters": m.counts,
        **m.quantized,
        **memory_report(s, m),
        **flops_report(s, m, stand_ins),
        **collectives_report(technique, m.recorded, m.theory, s.runs),
        "bf16_matmul_fraction": m.dtypes.by_dtype.get("bfloat16", 0) / matmul_total if matmul_total else None,
        "matmul_flops_by_dtype": {k: v * scale for k, v in sorted(m.dtypes.by_dtype.items())},
        "stand_ins": stand_ins,
        "versions": hardware.versions(),
        "seconds": round(elapsed, 1),
    }


def config_report(s: Setup, m: Measured) -> dict:
    args, opts, technique, accum = s.args, s.opts, s.technique, s.accum
    return {
        "model": args.model,
        "layers": m.config.num_hidden_layers,
        "dtype": args.dtype,
        "quant": getattr(args, "quant", "none") if technique in ("single", "ddp", "fsdp") else "none",
        "micro_batch_size": args.micro_batch_size,
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "accumulation_steps": accum,
        "micro_steps_run": s.runs,
        "answer_tokens": opts.answer_tokens,
        "lora_rank": args.lora_rank,
        "lora_alpha": args.lora_alpha,
        "lora_dropout": args.lora_dropout,
        "grad_checkpointing": args.grad_checkpointing,
        "checkpointing": args.checkpointing,
        "steps_tracked": opts.steps,
        **({"reshard_after_forward": args.reshard_after_forward} if technique == "fsdp" else {}),
        **({"sequence_parallel": args.sequence_parallel} if technique == "tp-sp" else {}),
        **({"schedule": args.schedule, "pipeline_microbatches": accum, "stage": m.stage.stage_index} if s.pp else {}),
    }


def memory_report(s: Setup, m: Measured) -> dict:
    """The tracked peak by category, beside the memory model's prediction for the same configuration, at the
    batch's answer positions (as the scripts' summaries call it) and at every position; pp: for either stage."""
    peak = next(iter(m.peak.values()), {}) if m.peak else {}
    categories = {k: int(v) for k, v in peak.items() if k != "Total"}
    tracked_total = int(peak.get("Total", 0))
    predicted, predicted_upper, pp_stages = predictions(s, m.config)
    return {
        "tracked_peak_bytes": tracked_total,
        "categories": categories,
        "predicted_bytes": int(predicted["total"]),
        "predicted": predicted,
        "predicted_bytes_every_position": int(predicted_upper["total"]),
        "tracked_over_predicted": tracked_total / predicted["total"] if predicted["total"] else None,
        **(
            {
                "predicted_bytes_by_stage": {k: int(v) for k, v in pp_stages.items()},
                "predicted_busiest_stage": max(pp_stages, key=pp_stages.get),
                "predicted_note": f"the memory model's '{s.opts.pp_stage}' stage, what rank {s.rank} holds and the "
                "tracked peak is compared with ('first': the embedding, and the most micro-batches in flight; "
                "'last': the final norm, the lm_head with its own copy of the tied embedding, and the loss); "
                "pp-ft's summary states the busier of the two, predicted_busiest_stage",
            }
            if s.pp
            else {}
        ),
    }


def predictions(s: Setup, config) -> tuple[dict, dict, dict]:
    """The memory model's prediction at the answer positions, at every position, and (pp) the total for either
    stage."""
    args, opts, technique = s.args, s.opts, s.technique
    setting = {"quant": args.quant} if technique in ("single", "ddp", "fsdp") else {}
    if technique != "single":
        setting["world_size"] = s.world
    if technique == "fsdp":
        setting["reshard_after_forward"] = args.reshard_after_forward
    pp_stages = {}
    if s.pp:  # as pp-ft's summary calls it (GPipe and 1F1B only here), for the stage tracked
        setting.update(pp_schedule=args.schedule, num_microbatches=s.accum)
        pp_stages = {
            where: metrics.predicted_memory(
                config, args, "pp", logit_positions=opts.answer_tokens, pp_stage=where, **setting
            )["total"]
            for where in ("first", "last")
        }
        setting["pp_stage"] = opts.pp_stage
    # The memory model's name for it: tp-sp-ft without sequence parallelism is plain Megatron TP.
    modelled = "tp" if technique == "tp-sp" and not args.sequence_parallel else technique
    predicted = metrics.predicted_memory(config, args, modelled, logit_positions=opts.answer_tokens, **setting)
    predicted_upper = metrics.predicted_memory(config, args, modelled, **setting)
    return predicted, predicted_upper, pp_stages


def flops_report(s: Setup, m: Measured, stand_ins: list[str]) -> dict:
    """The counted step's FLOPs, scaled to the whole optimizer step, beside the convention's for this rank's share
    of it, in all and by component; a disagreement between the two counts is added to the stand-ins."""
    technique, world, args, dtypes = s.technique, s.world, s.args, m.dtypes
    lengths = [args.max_length] * args.micro_batch_size * s.accum  # this rank's sequences per optimizer step
    # The convention's FLOPs for those sequences, and the share of them that is this rank's: all of them with data
    # parallelism (each rank its own sequences), 1/world of them with TP (every rank runs every sequence); with PP
    # its stage's layers, 1/world of the decoder layers, and the whole lm_head on the last stage, none on the first;
    # with CP 1/world of every sequence's tokens and, the chunks balanced, of its causal attention.
    share = 1 / world if technique in (*SEQUENCE_SPLIT, "pp") else 1
    scale = s.accum / s.runs  # exact: every micro-step counts the same
    # This command's count (MatmulDtypes: local shards), checked against FlopCounterMode's, which counts a DTensor
    # op at its logical shape: the two agree where no DTensor computes (single, ddp, fsdp's gathered weights).
    logical = m.logical
    without_rc = sum(dtypes.by_dtype.values())
    with_rc = without_rc + dtypes.recompute
    if technique != "tp" and with_rc != logical:
        stand_ins.append(
            f"FLOPs: FlopCounterMode counted {logical} with recompute, this command's own count of the same ops "
            f"{with_rc}: they should agree, and the difference is unexplained"
        )
    shape = memory.ModelShape.from_config(m.config)
    attn_convention = 6 * shape.layers * shape.q_dim * sum(n * n for n in lengths) * share
    # Where the step computes logits (logits_to_keep): each sequence's answer positions, the batch's k per row.
    logit_positions = m.batch.mb["logit_positions"].shape[-1] * len(lengths)
    convention, lm_head_convention = rank_share(s, m, lengths, share, sum(lengths))
    at_logits, _ = rank_share(s, m, lengths, share, logit_positions)
    return {
        "flops_counted": without_rc * scale,
        "flops_counted_with_recompute": with_rc * scale,
        **({"flops_logical_with_recompute": logical * scale} if technique == "tp" else {}),
        "flops_convention": convention,
        "flops_counted_over_convention": without_rc * scale / convention,
        "flops_convention_at_logits": at_logits,
        "flops_counted_over_convention_at_logits": without_rc * scale / at_logits,
        "flops_counted_by_component": {k: v * scale for k, v in sorted(dtypes.by_component.items())},
        "flops_convention_by_component": {
            "attention": attn_convention,
            "lm_head": lm_head_convention,
            "projections_and_adapters": convention - attn_convention - lm_head_convention,
        },
        "flops_note": flops_note(s, m, logit_positions),
    }


def flops_repeated(result: dict) -> dict[str, float]:
    """The counted FLOPs of a result (`flops_counted`: this rank, per optimizer step) that the MFU convention leaves
    out as work the step repeats, not work it needs, as it leaves out checkpointing's recomputed forward (kept apart
    in `flops_counted_with_recompute`). From the result's own numbers, so every committed JSON is accounted alike:

    - "attention_scores": SDPA's backward recomputes the scores Q K^T before propagating through them.
      FlopCounterMode's backward formula is 5 matmuls (that recompute, then dP, dV, dQ, dK), its forward's 2: the
      count's attention is 7 units, the convention's 6 (backward at twice the forward), so 1/7 of the counted
      attention is the recompute (the causal formulas scale every unit alike). It is most of the gap at long
      sequences, where attention is most of the step: cp-ft's 32,768 tokens.
    - "tp_replicated": tp-ft and tp-sp-ft shard the decoder layers' base projections, and the convention's share of
      a rank is 1/world of the step, but every rank computes the whole lm_head (the scripts do not shard it) and the
      adapter halves that stay whole (lora_A of a column-parallel projection, lora_B of a row-parallel one: rank x
      n_in or n_out weights each, `lora.ROW_PARALLEL`, 6 FLOPs per weight and token): (world - 1) / world of them is
      the other ranks' share, done again on this one."""
    from ftkit import models
    from ftkit.lora import ROW_PARALLEL

    c, world = result["config"], result["world_size"]
    counted = result["flops_counted_by_component"]
    repeated = {"attention_scores": counted.get("attention", 0.0) / 7, "tp_replicated": 0.0}
    if result["technique"] in TENSOR_PARALLEL:
        shape = memory.ModelShape.from_config({**models.QWEN3_4B_CONFIG, "num_hidden_layers": c["layers"]})
        whole = sum(n_out if name in ROW_PARALLEL else n_in for name, (n_in, n_out) in shape.linears().items())
        tokens = c["max_length"] * c["micro_batch_size"] * c["accumulation_steps"]  # this rank's: every sequence
        adapters = 6 * tokens * shape.layers * c["lora_rank"] * whole
        repeated["tp_replicated"] = (counted.get("lm_head", 0.0) + adapters) * (1 - 1 / world)
    return repeated


def model_flops_over_convention(result: dict) -> float:
    """The counted FLOPs less the work the convention leaves out as repeated (`flops_repeated`), over the MFU
    convention's share of this rank (the lm_head at the positions the step computes logits at): within 1% of 1 for
    every committed run (tests/test_realscale.py holds it within 5%)."""
    needed = result["flops_counted"] - sum(flops_repeated(result).values())
    return needed / result["flops_convention_at_logits"]


def rank_share(s: Setup, m: Measured, lengths: list[int], share: float, positions: int) -> tuple[float, float]:
    """The convention's FLOPs for this rank's sequences, the lm_head counted at `positions`, and the share of
    them that is this rank's; (total, lm_head)."""
    shape = memory.ModelShape.from_config(m.config)
    total = metrics.step_flops(lengths, m.config, m.counts["trainable"], positions) * share
    lm_head = 4 * shape.embedding_params() * positions * share
    if s.pp:  # the lm_head runs on the last stage, over every sequence
        whole = lm_head / share if m.stage.is_last else 0.0
        total, lm_head = total - lm_head + whole, whole
    if s.technique == "cp" and positions < sum(lengths):  # rank 0 holds the last chunk: every answer position
        total, lm_head = total - lm_head + lm_head / share, lm_head / share
    return total, lm_head


def flops_note(s: Setup, m: Measured, logit_positions: int) -> str:
    technique, world, rank, stage = s.technique, s.world, s.rank, m.stage
    return (
        f"per optimizer step on rank {rank} (its micro-batch x accumulation sequences); the global "
        "step is "
        f"{s.dp} times this. Convention: {metrics.MFU_CONVENTION}; convention at logits: the same with the lm_head "
        f"at the {logit_positions} positions the step computes logits at (logits_to_keep: the answer positions). "
        "Counted: FlopCounterMode's formulas, with SDPA counted over the query-key pairs the causal mask keeps "
        "(causal_sdpa_formulas: FlopCounterMode's own count the whole s x s), its backward's recompute of the "
        "scores included (the convention leaves it out: 7/6 of its attention), the lm_head where it runs"
        + (
            f". TP: every rank runs every sequence, and the convention here is rank 0's 1/{world} share of the "
            "step; the script shards the decoder layers only, so every rank computes the whole lm_head (and holds "
            "the whole embedding)"
            if technique in TENSOR_PARALLEL
            else f". CP: rank {rank} runs 1/{world} of every sequence's tokens (its first and last chunks) and as "
            "much of its causal attention as every other rank; the convention here is that share of the step, and "
            "the whole lm_head at the answer positions, which sit in the last chunk"
            if technique == "cp"
            else f". PP: rank {rank} runs stage {stage.stage_index} of {world} on every sequence: 1/{world} of the "
            "decoder layers, and "
            + (
                "the final norm and the lm_head (at the answer positions); the convention here is those layers' "
                "share of the step and the whole lm_head"
                if stage.is_last
                else "the embedding (no matmul); the convention here is those layers' share of the step (the "
                "lm_head is the last stage's)"
            )
            if s.pp
            else ""
        )
    )


def collective_theory(
    technique: str, model, config, args, counts: dict, mb: dict, micro_steps: int, replicated: list, world: int, script
):
    """The bytes per collective kind that the script's summary states as theory (`theory_*`), for an optimizer
    step of `micro_steps` micro-batches like `mb`, from the same functions (ftkit/comm.py; cp-ft's `comm_theory`)."""
    if technique == "cp":  # mb is this rank's share, 1/world of every padded sequence
        trainable = [p for p in model.parameters() if p.requires_grad]
        return script.comm_theory(config, args, micro_steps * mb["input_ids"].numel() * world, trainable)
    if technique == "fsdp":  # as fsdp-ft's summary: floating parameters in --param-dtype, 4-bit codes as stored
        from torch.distributed.fsdp import FSDPModule

        param_dtype = cli.torch_dtype(args.param_dtype)
        layer_units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        return comm.fsdp_theory(
            comm.gathered_bytes(model.parameters(), param_dtype),
            sum(comm.gathered_bytes(unit.parameters(), param_dtype) for unit in layer_units),
            micro_steps,
            args.reshard_after_forward,
            counts["trainable"] * cli.torch_dtype(args.reduce_dtype).itemsize,
            world,
        )
    # pp-ft's activation_bytes_per_microbatch, once per micro-batch: stage 0 sends each one's output forward, the
    # last stage its input gradient backward, both [micro, seq, hidden] in the compute dtype.
    if technique == "pp":
        return {"send": mb["input_ids"].numel() * config.hidden_size * cli.torch_dtype(args.dtype).itemsize}
    if technique == "ddp":  # ddp-ft's summary: the trainable gradients, once per optimizer step (no_sync before)
        return {"all_reduce": comm.nbytes([p for p in model.parameters() if p.requires_grad])}
    # The TP scripts' row: the step's block-boundary activations [micro, seq, hidden], summed over its micro-batches.
    hidden = config.hidden_size
    row = {
        "comm": {},
        "activation_bytes": micro_steps * mb["input_ids"].numel() * hidden * cli.torch_dtype(args.dtype).itemsize,
    }
    if technique == "tp":
        return {"all_reduce": comm.tp_all_reduce_theory(config, args, [row], world)}
    if technique == "tp-sp":
        return comm.tp_sp_collective_theory(config, args, [row], comm.nbytes(replicated))
    return {}


def collectives_report(technique: str, recorded: dict, theory: dict, micro_steps: int) -> dict:
    """The counted step's collectives beside the theory, or why there are none to show."""
    if technique == "single":
        return {"collectives_note": "one device: no collectives"}
    return {
        "collective_bytes": {kind: int(s["bytes"]) for kind, s in sorted(recorded.items())},
        "collective_counts": {kind: int(s["count"]) for kind, s in sorted(recorded.items())},
        "collective_bytes_theory": {kind: float(b) for kind, b in sorted(theory.items()) if b},
        "collectives_note": f"the counted optimizer step (micro-steps: {micro_steps}), recorded as the script "
        "records them (ftkit/comm.py): bytes of the whole buffer each collective was given on this rank (the fake "
        "group returns at once, so no time); theory: the script's own formula for the same micro-steps",
    }
